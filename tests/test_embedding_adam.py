"""EmbeddingAdam against independent references, on the backend KERAS_BACKEND selects.

References: the numpy implementation of docs/algorithms.md#embeddingadam
(`tests/reference/numpy_embedding_adam.py`), TF Addons LazyAdam's published
formula (written out below), `keras.optimizers.Adam` and `torch.optim.SparseAdam`.
Sparse gradients are built directly (`tf.IndexedSlices` on TensorFlow, a torch
sparse COO tensor on torch); JAX has no sparse gradient type, so there every case
runs on dense gradients (a row is touched when it has any non-zero entry).
"""

from __future__ import annotations

import math
import re

import keras
import numpy as np
import pytest
from keras import ops

import keras_tpu_optim as kto
from tests.reference.numpy_embedding_adam import KerasEma, NumpyEmbeddingAdam, clip_by_norm

BACKEND = keras.backend.backend()
# "sparse": tf.IndexedSlices, a JAX BCOO, a torch sparse COO tensor.
GRAD_KINDS = ["dense", "sparse"]
ROWS, DIM = 9, 3

# Steps of a sparse gradient: ids (with duplicates) and, per id, a gradient row seed.
STEP_IDS = [
    [1, 4, 1, 7, 4],
    [0, 1, 2, 2],
    [7, 7, 7, 3],
    [4, 8, 1],
    [2, 4, 6, 4, 0, 6],
    [5, 1],
]


def schedule_reference(step):
    """`ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)` at a 0-based step, from its docs."""
    return 0.05 * 0.5 ** (step / 2)


def make_schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)


def initial_table(shape=(ROWS, DIM), seed=0, dtype=np.float32):
    return np.random.default_rng(seed).uniform(-0.1, 0.1, size=shape).astype(dtype)


def step_values(ids, seed, trailing_shape=(DIM,)):
    return (
        np.random.default_rng(seed)
        .normal(0.0, 0.5, size=(len(ids),) + trailing_shape)
        .astype(np.float32)
    )


def densify(ids, values, shape):
    dense = np.zeros(shape, np.float32)
    np.add.at(dense, np.asarray(ids), values)
    return dense


def make_gradient(kind, ids, values, shape, dtype="float32"):
    """A gradient for `optimizer.apply`: dense (summed duplicates) or the backend's sparse type."""
    if kind == "dense":
        return ops.cast(ops.convert_to_tensor(densify(ids, values, shape)), dtype)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.IndexedSlices(
            tf.cast(tf.constant(values), dtype),
            tf.constant(ids, dtype=tf.int32),
            dense_shape=tf.constant(shape, dtype=tf.int32),
        )
    if BACKEND == "jax":
        import jax.numpy as jnp
        from jax.experimental import sparse as jax_sparse

        return jax_sparse.BCOO(
            (jnp.asarray(values, dtype), jnp.asarray(ids, jnp.int32)[:, None]), shape=tuple(shape)
        )
    if BACKEND == "torch":
        import torch

        return torch.sparse_coo_tensor(
            torch.tensor(ids, dtype=torch.int64)[None],
            torch.tensor(values).to(getattr(torch, dtype)),
            size=shape,
            device=ops.convert_to_tensor(0.0).device,
            check_invariants=True,
        )
    raise AssertionError(f"no sparse gradients on {BACKEND}")


def feed(reference, kind, ids, values):
    if kind == "dense":
        reference.apply_dense(densify(ids, values, reference.weights.shape))
    else:
        reference.apply_sparse(ids, values)


def to_numpy(x):
    return ops.convert_to_numpy(ops.cast(x, "float32"))


def slot(optimizer, variable, name):
    matches = [v for v in optimizer.variables if v.name == f"{variable.name}_{name}"]
    assert len(matches) == 1, [v.name for v in optimizer.variables]
    return matches[0]


def state(optimizer, variable):
    return (
        to_numpy(variable),
        to_numpy(slot(optimizer, variable, "momenta")),
        to_numpy(slot(optimizer, variable, "velocities")),
    )


def assert_matches_reference(optimizer, variable, reference, rtol=1e-5, atol=1e-6):
    weights, momenta, velocities = state(optimizer, variable)
    np.testing.assert_allclose(
        weights, reference.weights.astype(np.float64), rtol=rtol, atol=atol, err_msg="weights"
    )
    np.testing.assert_allclose(momenta, reference.momenta, rtol=rtol, atol=atol, err_msg="momenta")
    np.testing.assert_allclose(
        velocities, reference.velocities, rtol=rtol, atol=atol, err_msg="velocities"
    )
    if getattr(optimizer, "bias_correction", "global") == "per_row":
        row_steps = slot(optimizer, variable, "row_steps")
        assert keras.backend.standardize_dtype(row_steps.dtype) == "int32"
        np.testing.assert_array_equal(
            ops.convert_to_numpy(row_steps), reference.row_steps, err_msg="row_steps"
        )


def run_against_reference(
    options,
    kind,
    *,
    shape=(ROWS, DIM),
    steps=STEP_IDS,
    reference_options=None,
    learning_rate=0.05,
    reference_learning_rate=None,
):
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=learning_rate, **options)
    reference = NumpyEmbeddingAdam(
        init,
        learning_rate=learning_rate if reference_learning_rate is None else reference_learning_rate,
        **(options if reference_options is None else reference_options),
    )
    for seed, ids in enumerate(steps):
        values = step_values(ids, seed, shape[1:])
        optimizer.apply([make_gradient(kind, ids, values, shape)], [variable])
        feed(reference, kind, ids, values)
        assert_matches_reference(optimizer, variable, reference)
    return optimizer, variable, reference


# --------------------------------------------------------------------------- options vs numpy

OPTION_CASES = {
    "defaults": {},
    "sum_inside_sqrt_large_eps": {"epsilon": 0.05},
    "sum_outside_sqrt_large_eps": {"sum_inside_sqrt": False, "epsilon": 0.05},
    "clipvalue_scalar": {"clipvalue": 0.3},
    "clipvalue_min_only": {"clipvalue": (-0.2, None)},
    "clipvalue_max_only": {"clipvalue": (None, 0.1)},
    "clipvalue_both": {"clipvalue": (-0.4, 0.25)},
    "clipvalue_positive_floor": {"clipvalue": (0.05, 0.6)},
    "clip_weight_min": {"clip_weight_min": -0.08},
    "clip_weight_max": {"clip_weight_max": 0.06},
    "clip_weight_both": {"clip_weight_min": -0.07, "clip_weight_max": 0.05},
    "weight_decay_factor": {"weight_decay_factor": 0.3},
    "weight_decay_factor_lr_false": {
        "weight_decay_factor": 0.3,
        "multiply_weight_decay_factor_by_learning_rate": False,
    },
    "weight_decay_factor_times_lr": {
        "weight_decay_factor": 2.0,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    "betas": {"beta_1": 0.5, "beta_2": 0.8},
    "beta_1_zero": {"beta_1": 0.0},
    "not_lazy": {"lazy_adam": False},
    "not_lazy_all_options": {
        "lazy_adam": False,
        "sum_inside_sqrt": False,
        "epsilon": 0.01,
        "clipvalue": (-0.3, None),
        "clip_weight_max": 0.07,
        "weight_decay_factor": 1.5,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    "all_options": {
        "beta_1": 0.8,
        "beta_2": 0.95,
        "epsilon": 0.01,
        "sum_inside_sqrt": False,
        "clipvalue": (None, 0.3),
        "clip_weight_min": -0.09,
        "clip_weight_max": 0.08,
        "weight_decay_factor": 0.2,
        "multiply_weight_decay_factor_by_learning_rate": False,
    },
    "all_options_inside_sqrt": {
        "epsilon": 0.02,
        "clipvalue": 0.35,
        "clip_weight_min": -0.06,
        "weight_decay_factor": 1.0,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    # Rowwise second moment, per-row bias correction, and both with every other option.
    "rowwise": {"second_moment": "rowwise"},
    "rowwise_large_eps": {"second_moment": "rowwise", "epsilon": 0.05},
    "rowwise_outside_sqrt": {"second_moment": "rowwise", "sum_inside_sqrt": False, "epsilon": 0.05},
    "per_row": {"bias_correction": "per_row"},
    "per_row_betas": {"bias_correction": "per_row", "beta_1": 0.5, "beta_2": 0.8},
    "per_row_beta_1_zero": {"bias_correction": "per_row", "beta_1": 0.0},
    "per_row_decay_times_lr": {
        "bias_correction": "per_row",
        "weight_decay_factor": 2.0,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    "rowwise_per_row": {"second_moment": "rowwise", "bias_correction": "per_row"},
    "rowwise_per_row_all_options": {
        "second_moment": "rowwise",
        "bias_correction": "per_row",
        "beta_1": 0.8,
        "beta_2": 0.95,
        "epsilon": 0.01,
        "sum_inside_sqrt": False,
        "clipvalue": (None, 0.3),
        "clip_weight_min": -0.09,
        "clip_weight_max": 0.08,
        "weight_decay_factor": 1.5,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    "not_lazy_rowwise_per_row": {
        "lazy_adam": False,
        "second_moment": "rowwise",
        "bias_correction": "per_row",
        "weight_decay_factor": 1.5,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
}


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("options", list(OPTION_CASES.values()), ids=list(OPTION_CASES))
def test_options_match_numpy_reference(options, kind):
    run_against_reference(options, kind)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay_factor": 0.5, "clipvalue": (-0.2, 0.3), "clip_weight_max": 0.05},
        {"lazy_adam": False},
    ],
    ids=["defaults", "decay_and_clipping", "not_lazy"],
)
def test_rank_1_variable_rows_are_elements(options, kind):
    steps = [[0, 3, 3, 5], [1, 5], [7, 0, 0], [2, 3, 8], [5, 5, 4]]
    run_against_reference(options, kind, shape=(ROWS,), steps=steps)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("sum_inside_sqrt", [True, False])
def test_learning_rate_schedule_over_several_steps(kind, sum_inside_sqrt):
    options = {
        "sum_inside_sqrt": sum_inside_sqrt,
        "epsilon": 0.01,
        "weight_decay_factor": 1.0,
        "multiply_weight_decay_factor_by_learning_rate": True,
    }
    optimizer, _, reference = run_against_reference(
        options, kind, learning_rate=make_schedule(), reference_learning_rate=schedule_reference
    )
    assert len(STEP_IDS) >= 5 and reference.iterations == len(STEP_IDS)
    assert int(ops.convert_to_numpy(optimizer.iterations)) == len(STEP_IDS)


def test_zero_argument_callable_learning_rate():
    rates = iter([0.05, 0.02, 0.01, 0.03, 0.04, 0.01, 0.02])
    current = {"value": 0.05}

    def learning_rate():
        return current["value"]

    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=learning_rate)
    reference = NumpyEmbeddingAdam(init, learning_rate=lambda step: current["value"])
    for seed, ids in enumerate(STEP_IDS):
        current["value"] = next(rates)
        values = step_values(ids, seed)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
        assert_matches_reference(optimizer, variable, reference)


@pytest.mark.parametrize("sum_inside_sqrt", [True, False])
def test_duplicate_ids_without_accumulation_last_occurrence_wins(sum_inside_sqrt):
    options = {
        "use_gradient_accumulation": False,
        "sum_inside_sqrt": sum_inside_sqrt,
        "weight_decay_factor": 0.4,
        "clip_weight_min": -0.09,
    }
    _, _, reference = run_against_reference(options, "sparse")
    # The test discriminates: summing the duplicates would give other numbers.
    summed = NumpyEmbeddingAdam(
        initial_table(), learning_rate=0.05, **{**options, "use_gradient_accumulation": True}
    )
    for seed, ids in enumerate(STEP_IDS):
        summed.apply_sparse(ids, step_values(ids, seed))
    assert not np.allclose(summed.weights, reference.weights, rtol=1e-4, atol=1e-5)


def test_duplicate_ids_with_accumulation_equal_their_dense_sum():
    _, sparse_variable, _ = run_against_reference({"clipvalue": 0.4}, "sparse")
    _, dense_variable, _ = run_against_reference({"clipvalue": 0.4}, "dense")
    np.testing.assert_allclose(
        to_numpy(sparse_variable), to_numpy(dense_variable), rtol=1e-6, atol=1e-7
    )


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="int64 IndexedSlices indices are a TensorFlow gradient type"
)
def test_int64_indexed_slices():
    import tensorflow as tf

    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05)
    for seed, ids in enumerate(STEP_IDS[:3]):
        values = step_values(ids, seed)
        gradient = tf.IndexedSlices(
            tf.constant(values), tf.constant(ids, tf.int64), tf.constant(init.shape, tf.int64)
        )
        optimizer.apply([gradient], [variable])
        reference.apply_sparse(ids, values)
    assert_matches_reference(optimizer, variable, reference)


# --------------------------------------------------------------------------- laziness

LAZY_OPTIONS = {
    "weight_decay_factor": 0.5,
    "clipvalue": (-0.3, 0.2),
    "clip_weight_min": -0.2,
    "clip_weight_max": 0.2,
    "epsilon": 0.01,
}


def _lazy_cases():
    cases = [
        (kind, None, rank, accumulate)
        for kind in GRAD_KINDS
        for rank in (1, 2)
        for accumulate in (True, False)
    ]
    if BACKEND == "jax":
        # A row capacity below the rows touched: the whole-table fallback. Eager it is slow,
        # so one case here; test_jax_jit_stateless_apply covers both sides under jit.
        cases.append(("dense", 2, 2, True))
    return cases


@pytest.mark.parametrize("kind,max_touched_rows,rank,use_gradient_accumulation", _lazy_cases())
def test_untouched_rows_keep_weights_and_slots_bit_for_bit(
    kind, max_touched_rows, rank, use_gradient_accumulation
):
    options = dict(LAZY_OPTIONS)
    if not use_gradient_accumulation:
        options.pop("clipvalue")
        options["use_gradient_accumulation"] = False
    shape = (ROWS, DIM) if rank == 2 else (ROWS,)
    variable = keras.Variable(initial_table(shape), name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, max_touched_rows=max_touched_rows, **options)
    # With capacity 2: steps 1-2 touch 3 rows (fallback), the last one 2 rows (gather/scatter).
    steps = STEP_IDS if max_touched_rows is None else [STEP_IDS[0], STEP_IDS[1], STEP_IDS[5]]
    for seed, ids in enumerate(steps):
        before = [np.array(x) for x in state(optimizer, variable)] if seed else None
        values = step_values(ids, seed, shape[1:])
        optimizer.apply([make_gradient(kind, ids, values, shape)], [variable])
        if before is None:
            continue
        after = state(optimizer, variable)
        untouched = np.setdiff1d(np.arange(ROWS), ids)
        touched = np.unique(ids)
        for name, old, new in zip(("weights", "momenta", "velocities"), before, after):
            np.testing.assert_array_equal(
                new[untouched], old[untouched], err_msg=f"untouched {name} changed"
            )
            assert not np.array_equal(new[touched], old[touched]), f"touched {name} did not change"


def test_dense_gradient_row_with_one_nonzero_entry_is_touched():
    init = initial_table()
    gradient = np.zeros(init.shape, np.float32)
    gradient[2, 1] = (
        0.7  # one non-zero entry: row 2 is updated, all of it (weight decay, momenta of zeros)
    )
    gradient[5, :] = [0.1, -0.2, 0.3]
    variable = keras.Variable(init, name="table")
    options = {"weight_decay_factor": 0.5}
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **options)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    optimizer.apply([ops.convert_to_tensor(gradient)], [variable])
    reference.apply_dense(gradient)
    assert_matches_reference(optimizer, variable, reference)
    weights = to_numpy(variable)
    assert not np.array_equal(
        weights[2], init[2]
    )  # decay moved the zero-gradient entries of row 2 too
    np.testing.assert_array_equal(
        np.delete(weights, [2, 5], axis=0), np.delete(init, [2, 5], axis=0)
    )


# --------------------------------------------------------------------------- other references


def tfa_lazy_adam(weights, steps, learning_rate, beta_1, beta_2, epsilon):
    """TF Addons LazyAdam, from its published formula (sparse update on the gradient's unique rows).

    lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t); for the rows in the gradient
    only: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, w -= lr_t m / (sqrt(v) + eps).
    Duplicate indices are summed first (Keras 2 deduplicates IndexedSlices).
    """
    w = np.array(weights, np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (ids, values) in enumerate(steps, start=1):
        rows, inverse = np.unique(ids, return_inverse=True)
        g = np.zeros((len(rows),) + w.shape[1:])
        np.add.at(g, inverse, values)
        lr_t = learning_rate * math.sqrt(1 - beta_2**t) / (1 - beta_1**t)
        m[rows] = beta_1 * m[rows] + (1 - beta_1) * g
        v[rows] = beta_2 * v[rows] + (1 - beta_2) * g * g
        w[rows] -= lr_t * m[rows] / (np.sqrt(v[rows]) + epsilon)
    return w


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_sum_outside_sqrt_matches_tf_addons_lazy_adam(kind):
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, beta_1=0.8, beta_2=0.9, epsilon=0.02, sum_inside_sqrt=False
    )
    steps = []
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        steps.append((ids, values))
        optimizer.apply([make_gradient(kind, ids, values, init.shape)], [variable])
    expected = tfa_lazy_adam(init, steps, 0.05, 0.8, 0.9, 0.02)
    np.testing.assert_allclose(to_numpy(variable), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    BACKEND != "torch", reason="torch.optim.SparseAdam is the torch backend's reference"
)
@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_matches_torch_sparse_adam(kind):
    # torch 2.13 SparseAdam (torch/optim/_functional.py::sparse_adam): coalesces (sums
    # duplicate indices), step_size = lr * sqrt(1 - b2^t) / (1 - b1^t) and
    # denom = sqrt(v) + eps with v NOT bias-corrected, i.e. exactly
    # w -= lr_t * m / (sqrt(v) + eps): our sum_inside_sqrt=False with the same eps,
    # unscaled. eps is large here so that its placement matters.
    import torch

    init = initial_table()
    lr, betas, eps = 0.05, (0.8, 0.95), 0.03
    param = torch.nn.Parameter(torch.tensor(init))
    torch_optimizer = torch.optim.SparseAdam([param], lr=lr, betas=betas, eps=eps)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=lr, beta_1=betas[0], beta_2=betas[1], epsilon=eps, sum_inside_sqrt=False
    )
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        sparse = torch.sparse_coo_tensor(
            torch.tensor(ids)[None], torch.tensor(values), size=init.shape, check_invariants=True
        )
        param.grad = sparse
        torch_optimizer.step()
        optimizer.apply([make_gradient(kind, ids, values, init.shape)], [variable])
        np.testing.assert_allclose(to_numpy(variable), param.detach().numpy(), rtol=1e-5, atol=1e-6)
        torch_state = torch_optimizer.state[param]
        np.testing.assert_allclose(
            to_numpy(slot(optimizer, variable, "momenta")),
            torch_state["exp_avg"].numpy(),
            rtol=1e-5,
            atol=1e-7,
        )
        np.testing.assert_allclose(
            to_numpy(slot(optimizer, variable, "velocities")),
            torch_state["exp_avg_sq"].numpy(),
            rtol=1e-5,
            atol=1e-7,
        )


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("learning_rate", ["float", "schedule"])
def test_not_lazy_matches_keras_adam(kind, learning_rate):
    # keras/src/optimizers/adam.py: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t) and
    # w -= alpha * m / (sqrt(v) + eps): our lazy_adam=False, sum_inside_sqrt=False.
    init = initial_table()
    ours_variable = keras.Variable(init, name="table")
    keras_variable = keras.Variable(init, name="table")
    rate = (lambda: make_schedule()) if learning_rate == "schedule" else (lambda: 0.05)
    ours = kto.EmbeddingAdam(
        learning_rate=rate(),
        beta_1=0.85,
        beta_2=0.97,
        epsilon=0.01,
        lazy_adam=False,
        sum_inside_sqrt=False,
    )
    reference = keras.optimizers.Adam(learning_rate=rate(), beta_1=0.85, beta_2=0.97, epsilon=0.01)
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        ours.apply([make_gradient(kind, ids, values, init.shape)], [ours_variable])
        reference.apply([ops.convert_to_tensor(densify(ids, values, init.shape))], [keras_variable])
    expected = to_numpy(keras_variable)
    assert not np.allclose(expected, init)
    np.testing.assert_allclose(to_numpy(ours_variable), expected, rtol=1e-5, atol=1e-6)
    # Not lazy: rows never in a gradient after step 1 still moved (momentum).
    assert not np.array_equal(to_numpy(ours_variable)[1], init[1])


# --------------------------------------------------------------------------- Keras base keywords


def _two_variables():
    table = initial_table(seed=1)
    excluded = initial_table((ROWS, 2), seed=2)
    return table, excluded


def test_keras_weight_decay_is_lazy_decay_times_lr_t_and_honours_exclusions():
    table_init, excluded_init = _two_variables()
    table = keras.Variable(table_init, name="table")
    excluded = keras.Variable(excluded_init, name="excluded")
    optimizer = kto.EmbeddingAdam(learning_rate=make_schedule(), weight_decay=2.0)
    optimizer.exclude_from_weight_decay(var_names=["excluded"])
    table_ref = NumpyEmbeddingAdam(
        table_init,
        learning_rate=schedule_reference,
        weight_decay_factor=2.0,
        multiply_weight_decay_factor_by_learning_rate=True,
    )
    excluded_ref = NumpyEmbeddingAdam(excluded_init, learning_rate=schedule_reference)
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        other_ids = ids[::-1][:2]
        other_values = step_values(other_ids, 100 + seed, (2,))
        optimizer.apply(
            [
                make_gradient("dense", ids, values, table_init.shape),
                make_gradient("dense", other_ids, other_values, excluded_init.shape),
            ],
            [table, excluded],
        )
        table_ref.apply_dense(densify(ids, values, table_init.shape))
        excluded_ref.apply_dense(densify(other_ids, other_values, excluded_init.shape))
        assert_matches_reference(optimizer, table, table_ref)
        assert_matches_reference(optimizer, excluded, excluded_ref)


def test_use_ema_with_overwrite_frequency():
    init = initial_table()
    momentum, frequency = 0.8, 3
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, use_ema=True, ema_momentum=momentum, ema_overwrite_frequency=frequency
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05)
    average = None
    steps = STEP_IDS + STEP_IDS[:1]
    for step, ids in enumerate(steps):
        values = step_values(ids, step)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
        # Keras: average = m * average + (1 - m) * w (m = 0 on the first step); every
        # `frequency` iterations the model variable is overwritten by the average.
        weights = reference.weights.astype(np.float64)
        average = weights if average is None else momentum * average + (1 - momentum) * weights
        if (step + 1) % frequency == 0:
            reference.weights = average.astype(np.float32)
        assert_matches_reference(optimizer, variable, reference)


@pytest.mark.parametrize("steps", [2, 3])
def test_gradient_accumulation_steps_equal_one_step_on_the_mean(steps):
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=make_schedule(),
        gradient_accumulation_steps=steps,
        weight_decay_factor=0.5,
        clipvalue=0.4,
    )
    # As for every Keras optimizer: `iterations` (bias correction) counts updates, while a
    # schedule is evaluated at the micro-batch counter, k * update + k - 1 at update `update`.
    reference = NumpyEmbeddingAdam(
        init,
        learning_rate=lambda update: schedule_reference(steps * update + steps - 1),
        weight_decay_factor=0.5,
        clipvalue=0.4,
    )
    micro_batches = [STEP_IDS[i] for i in range(2 * steps)]
    collected = []
    for position, ids in enumerate(micro_batches):
        gradient = densify(ids, step_values(ids, position), init.shape)
        before = to_numpy(variable)
        optimizer.apply([ops.convert_to_tensor(gradient)], [variable])
        collected.append(gradient)
        if len(collected) < steps:
            np.testing.assert_array_equal(to_numpy(variable), before)
            continue
        reference.apply_dense(np.mean(collected, axis=0))
        collected = []
        assert_matches_reference(optimizer, variable, reference)
    assert reference.iterations == 2 and int(ops.convert_to_numpy(optimizer.iterations)) == 2


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_loss_scale_factor_unscales_gradients(kind):
    init = initial_table()
    scale = 1024.0
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, loss_scale_factor=scale, clipvalue=(-0.25, 0.3)
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, clipvalue=(-0.25, 0.3))
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient(kind, ids, values * scale, init.shape)], [variable])
        feed(reference, kind, ids, values)
        assert_matches_reference(optimizer, variable, reference)


def test_clipnorm_then_clipvalue():
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, clipnorm=0.6, clipvalue=(-0.2, None), weight_decay_factor=0.3
    )
    reference = NumpyEmbeddingAdam(
        init, learning_rate=0.05, clipnorm=0.6, clipvalue=(-0.2, None), weight_decay_factor=0.3
    )
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
        assert_matches_reference(optimizer, variable, reference)


def test_global_clipnorm():
    table_init, other_init = _two_variables()
    table = keras.Variable(table_init, name="table")
    other = keras.Variable(other_init, name="other")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, global_clipnorm=0.5)
    table_ref = NumpyEmbeddingAdam(table_init, learning_rate=0.05)
    other_ref = NumpyEmbeddingAdam(other_init, learning_rate=0.05)
    for seed, ids in enumerate(STEP_IDS):
        g1 = densify(ids, step_values(ids, seed), table_init.shape)
        g2 = densify(ids[:2], step_values(ids[:2], 50 + seed, (2,)), other_init.shape)
        optimizer.apply([ops.convert_to_tensor(g1), ops.convert_to_tensor(g2)], [table, other])
        norm = math.sqrt(
            np.sum(np.square(g1, dtype=np.float64)) + np.sum(np.square(g2, dtype=np.float64))
        )
        factor = 0.5 / max(norm, 0.5)
        table_ref.apply_dense(g1 * factor)
        other_ref.apply_dense(g2 * factor)
        assert_matches_reference(optimizer, table, table_ref)
        assert_matches_reference(optimizer, other, other_ref)


@pytest.mark.backend_neutral
def test_clipnorm_reference_is_active():
    # Guard for the two tests above: the norms used really exceed the thresholds.
    ids = STEP_IDS[0]
    gradient = densify(ids, step_values(ids, 0), (ROWS, DIM))
    assert not np.allclose(clip_by_norm(gradient, 0.6), gradient)


# --------------------------------------------------------------------------- dtypes


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_table_dtypes(dtype, kind):
    numpy_dtype = _bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    # Weights and gradients exactly representable in every dtype, so all start from the same numbers.
    init = (np.round(initial_table() * 256) / 256).astype(np.float32)
    variable = keras.Variable(init, name="table", dtype=dtype)
    options = {"weight_decay_factor": 0.5, "clipvalue": 0.4}
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **options)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, weight_dtype=numpy_dtype, **options)
    ulp = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}[dtype]
    for seed, ids in enumerate(STEP_IDS[:4]):
        values = np.round(step_values(ids, seed) * 64) / 64
        optimizer.apply([make_gradient(kind, ids, values, init.shape, dtype)], [variable])
        feed(reference, kind, ids, values)
    assert keras.backend.standardize_dtype(variable.dtype) == dtype
    for name in ("momenta", "velocities"):
        assert keras.backend.standardize_dtype(slot(optimizer, variable, name).dtype) == "float32"
    weights, momenta, velocities = state(optimizer, variable)
    expected = reference.weights.astype(np.float64)
    # A few roundings of the stored weight, each at most one unit in the last place.
    np.testing.assert_allclose(
        weights, expected, rtol=4 * ulp, atol=1e-6 if dtype == "float32" else 4 * ulp * 0.1
    )
    # Slots stay float32: without weights in their formula they match to float32 round-off.
    np.testing.assert_allclose(momenta, reference.momenta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(velocities, reference.velocities, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- XLA

XLA_OPTIONS = {
    "weight_decay_factor": 0.5,
    "clipvalue": (-0.3, 0.25),
    "clip_weight_max": 0.07,
    "epsilon": 0.01,
}


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function(jit_compile=True) is TensorFlow's XLA path"
)
@pytest.mark.parametrize("use_gradient_accumulation", [True, False])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_tensorflow_xla_with_indexed_slices(use_gradient_accumulation, ids_dtype):
    import tensorflow as tf

    options = dict(XLA_OPTIONS)
    if not use_gradient_accumulation:
        options.pop("clipvalue")
        options["use_gradient_accumulation"] = False
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=make_schedule(), **options)
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=schedule_reference, **options)

    @tf.function(jit_compile=True)
    def train_step(ids, values):
        gradient = tf.IndexedSlices(values, ids, dense_shape=tf.constant(init.shape, tf.int32))
        optimizer.apply([gradient], [variable])

    # XLA groups duplicates by a sort (static shapes): runs of duplicates, a step without ids.
    for seed, ids in enumerate(STEP_IDS + [[3, 3, 3, 3], [], [8, 0, 8, 0, 8]]):
        values = step_values(ids, seed)
        train_step(tf.constant(ids, getattr(tf, ids_dtype), shape=[len(ids)]), tf.constant(values))
        reference.apply_sparse(np.asarray(ids, np.int64), values)
        assert_matches_reference(optimizer, variable, reference)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function(jit_compile=True) is TensorFlow's XLA path"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rank", [1, 2])
def test_tensorflow_xla_sums_duplicates_without_copying_a_table(dtype, rank):
    """Under XLA duplicate ids are grouped by a sort and summed in float32.

    Same numbers as the reference, untouched rows bit-for-bit, a non-finite
    row does not leak into the sums, and the compiled step has no copy of a
    table (XLA copies one if it cannot order the reads before the writes).
    """
    import tensorflow as tf

    init = initial_table() if rank == 2 else initial_table()[:, 0].copy()
    init[5] = np.nan  # row 5's weights: its slots must still get exact gradient sums
    variable = keras.Variable(init, name="table", dtype=dtype)
    optimizer = kto.EmbeddingAdam(learning_rate=0.05)
    optimizer.build([variable])
    numpy_dtype = _bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, weight_dtype=numpy_dtype)

    @tf.function(jit_compile=True)
    def train_step(ids, values):
        gradient = tf.IndexedSlices(values, ids, dense_shape=tf.constant(init.shape, tf.int32))
        optimizer.apply([gradient], [variable])

    def arguments(ids, seed):
        values = step_values(ids, seed)
        values = values if rank == 2 else values[:, 0]
        return np.asarray(ids, np.int64), values.astype(numpy_dtype)

    hlo = train_step.experimental_get_compiler_ir(
        *(tf.constant(a) for a in arguments(STEP_IDS[0], 0))
    )(stage="optimized_hlo")
    table_shape = ",".join(str(d) for d in init.shape)
    copies = [line for line in hlo.splitlines() if f"[{table_shape}]" in line and " copy(" in line]
    assert not copies, "the compiled step copies a table:\n" + "\n".join(copies)

    for seed, ids in enumerate(STEP_IDS + [[5, 5, 2]]):
        before = state(optimizer, variable)
        ids_np, values = arguments(ids, seed)
        train_step(tf.constant(ids_np), tf.constant(values))
        reference.apply_sparse(ids_np, values.astype(np.float32))
        ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-23
        weights, momenta, velocities = state(optimizer, variable)
        np.testing.assert_allclose(
            weights, reference.weights.astype(np.float64), rtol=4 * ulp, atol=1e-6
        )
        np.testing.assert_allclose(momenta, reference.momenta, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(velocities, reference.velocities, rtol=1e-5, atol=1e-7)
        untouched = np.setdiff1d(np.arange(init.shape[0]), ids_np)
        for old, new in zip(before, (weights, momenta, velocities)):
            np.testing.assert_array_equal(new[untouched], old[untouched])
    assert (
        np.all(np.isnan(weights[5])) and np.all(np.isfinite(momenta[5])) and np.any(momenta[5] != 0)
    )


ROW_SLOT_OPTIONS = {
    "use_ema": {"use_ema": True},
    "use_ema_per_row": {"use_ema": True, "bias_correction": "per_row"},
    "use_ema_rowwise": {"use_ema": True, "second_moment": "rowwise"},
}


def _copies_of_rows(hlo: str, rows: int) -> list:
    """The lines of an optimized HLO module that copy an array of `rows` rows (a table or a `(rows,)` slot)."""
    return [
        line for line in hlo.splitlines() if " copy(" in line and re.search(rf"\[{rows}[,\]]", line)
    ]


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs eagerly: no compiler to insert copies")
@pytest.mark.parametrize("case", list(ROW_SLOT_OPTIONS))
def test_compiled_row_update_copies_no_table_or_row_slot(case):
    """The compiled sparse step writes the table and every per-row slot in place.

    XLA copies a whole array when a scatter into it does not depend on the
    gather from it (it keeps the gather's input). The EMA's `average_steps`
    was such a slot: two `(rows,)` copies a step on TF (at 10M rows 8.5 ms a
    step instead of 3.6). Checked on TF under `jit_compile=True` and on JAX
    under `jax.jit` with the state donated (a BCOO gradient, the rows path);
    the numbers are the reference's.
    """
    rows, dim = 1009, 8
    ids = [3, 1000, 3, 17]
    values = step_values(ids, 0, (dim,))
    init = initial_table((rows, dim))
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **ROW_SLOT_OPTIONS[case])
    optimizer.build([variable])
    reference_options = {k: v for k, v in ROW_SLOT_OPTIONS[case].items() if k != "use_ema"}
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **reference_options)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def train_step(ids, values):
            optimizer.apply(
                [tf.IndexedSlices(values, ids, dense_shape=tf.constant([rows, dim], tf.int64))],
                [variable],
            )

        arguments = (tf.constant(ids, tf.int64), tf.constant(values))
        hlo = train_step.experimental_get_compiler_ir(*arguments)(stage="optimized_hlo")
        train_step(*arguments)
    else:
        from bench_common import (
            jit_stateless_apply,
        )  # as Keras's trainer: state donated, returned in input order
        from jax.experimental import sparse as jax_sparse

        gradient = jax_sparse.BCOO((values, np.asarray(ids, np.int32)[:, None]), shape=(rows, dim))
        apply = jit_stateless_apply(optimizer)
        optimizer_values = [v.value for v in optimizer.variables]
        hlo = apply.lower(optimizer_values, [gradient], [variable.value]).compile().as_text()
        optimizer_values, trainable_values = apply(optimizer_values, [gradient], [variable.value])
        for target, value in zip(optimizer.variables, optimizer_values):
            target.assign(value)
        variable.assign(trainable_values[0])
    copies = _copies_of_rows(hlo, rows)
    assert not copies, "the compiled step copies a table or a per-row slot:\n" + "\n".join(copies)
    reference.apply_sparse(np.asarray(ids, np.int64), values)
    np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)
    # The first EMA update copies the weights; the touched rows' averages now reflect one update.
    by_name = {v.name: v for v in optimizer.variables}
    expected_steps = np.zeros(rows, np.int32)
    expected_steps[ids] = 1
    np.testing.assert_array_equal(
        ops.convert_to_numpy(by_name["table_average_steps"]), expected_steps
    )


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit(optimizer.stateless_apply) is JAX's XLA path")
@pytest.mark.parametrize("max_touched_rows", [None, 2, 5])
@pytest.mark.parametrize("rank", [1, 2])
def test_jax_jit_stateless_apply(max_touched_rows, rank):
    import jax

    shape = (ROWS, DIM) if rank == 2 else (ROWS,)
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=make_schedule(), max_touched_rows=max_touched_rows, **XLA_OPTIONS
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=schedule_reference, **XLA_OPTIONS)
    apply = jax.jit(optimizer.stateless_apply)
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [variable.value]
    # 5 distinct rows touched in the first step: three rounds at capacity 2, one at 5.
    steps = [[0, 2, 4, 6, 8, 2], [1, 3], [5, 5, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8], [8]]
    for seed, ids in enumerate(steps):
        values = step_values(ids, seed, shape[1:])
        before = [np.array(v) for v in [trainable_values[0], *optimizer_values]]
        trainable_values, optimizer_values = apply(
            optimizer_values, [ops.convert_to_tensor(densify(ids, values, shape))], trainable_values
        )
        reference.apply_dense(densify(ids, values, shape))
        untouched = np.setdiff1d(np.arange(ROWS), ids)
        after = [np.asarray(v) for v in [trainable_values[0], *optimizer_values]]
        for old, new in zip(before, after):
            if old.shape == shape:  # the table and its slots, bit for bit on untouched rows
                np.testing.assert_array_equal(new[untouched], old[untouched])
    for target, value in zip(optimizer.variables, optimizer_values):
        target.assign(value)
    variable.assign(trainable_values[0])
    assert_matches_reference(optimizer, variable, reference)
    assert int(ops.convert_to_numpy(optimizer.iterations)) == len(steps)


@pytest.mark.skipif(BACKEND != "jax", reason="BCOO gradients under jax.jit are JAX's sparse path")
@pytest.mark.parametrize("use_gradient_accumulation", [True, False])
@pytest.mark.parametrize("rank", [1, 2])
def test_jax_jit_bcoo_gradients_update_only_their_rows(use_gradient_accumulation, rank):
    """Under jit, with duplicates and explicit zeros: a BCOO's indices are the touched rows, as an IndexedSlices'."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    shape = (ROWS, DIM) if rank == 2 else (ROWS,)
    options = {**XLA_OPTIONS, "use_gradient_accumulation": use_gradient_accumulation}
    if not use_gradient_accumulation:
        options.pop("clipvalue", None)
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=make_schedule(), **options)
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=schedule_reference, **options)
    apply = jax.jit(optimizer.stateless_apply, donate_argnums=(0, 2))
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [variable.value]
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed, shape[1:])
        values[-1] = 0.0  # an explicit zero still names its row
        gradient = jax_sparse.BCOO(
            (jnp.asarray(values), jnp.asarray(ids, jnp.int32)[:, None]), shape=shape
        )
        before = [np.array(v) for v in [trainable_values[0], *optimizer_values]]
        trainable_values, optimizer_values = apply(optimizer_values, [gradient], trainable_values)
        reference.apply_sparse(ids, values)
        untouched = np.setdiff1d(np.arange(ROWS), ids)
        after = [np.asarray(v) for v in [trainable_values[0], *optimizer_values]]
        for old, new in zip(before, after):
            if old.shape == shape:
                np.testing.assert_array_equal(new[untouched], old[untouched])
    for target, value in zip(optimizer.variables, optimizer_values):
        target.assign(value)
    variable.assign(trainable_values[0])
    assert_matches_reference(optimizer, variable, reference)


@pytest.mark.skipif(BACKEND != "jax", reason="the touched-row bitmap is the JAX path's")
@pytest.mark.parametrize("num_rows", [31, 32, 33, 200, 1000])
def test_jax_touched_row_bitmap_lists_rows_in_order(num_rows):
    """Round after round, the bitmap yields exactly np.nonzero's rows: word edges, bit 31, the last row."""
    import jax
    import jax.numpy as jnp

    from keras_tpu_optim._backend.jax import rows as sparse_jax

    rng = np.random.default_rng(num_rows)
    masks = [rng.random(num_rows) < p for p in (0.0, 0.05, 0.5, 1.0)]
    edges = np.zeros(num_rows, bool)
    edges[[i for i in (0, 30, 31, 32, 63, 64, num_rows - 1) if i < num_rows]] = True
    masks.append(edges)
    clear = jax.jit(sparse_jax.clear_through)
    # A capacity of 1 lists a row a round: on the small tables only (a full 1000-row mask is 1000 rounds).
    for capacity in (1, 3, 32, 40) if num_rows <= 64 else (3, 32, 40):
        first = jax.jit(lambda words: sparse_jax.first_set_bits(words, capacity, num_rows))
        for mask in masks:
            expected = np.flatnonzero(mask)
            words = sparse_jax.pack_bits(jnp.asarray(mask))
            assert int(jnp.sum(jax.lax.population_count(words))) == len(expected)
            listed = []
            while len(listed) < len(expected):
                ids = np.asarray(first(words))
                listed.extend(ids[ids < num_rows])
                # Padding only after the real ids, and only in the last round.
                np.testing.assert_array_equal(ids[ids < num_rows], ids[: np.sum(ids < num_rows)])
                words = clear(words, jnp.asarray(ids[capacity - 1], jnp.int32))
            np.testing.assert_array_equal(listed, expected)
            assert int(jnp.sum(words)) == 0


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit(optimizer.stateless_apply) is JAX's XLA path")
@pytest.mark.parametrize("max_touched_rows", [None, 1, 7, 64])
def test_jax_rounds_on_a_table_of_many_words(max_touched_rows):
    """Rows across several 32-row words, in one round or many, against the numpy reference."""
    import jax

    shape = (100, 4)
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.01, max_touched_rows=max_touched_rows, **XLA_OPTIONS
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.01, **XLA_OPTIONS)
    apply = jax.jit(optimizer.stateless_apply)
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [variable.value]
    steps = [[0, 31, 32, 63, 64, 99, 31], list(range(0, 100, 3)), [99], list(range(100)) + [5, 5]]
    for seed, ids in enumerate(steps):
        gradient = densify(ids, step_values(ids, seed, shape[1:]), shape)
        trainable_values, optimizer_values = apply(
            optimizer_values, [ops.convert_to_tensor(gradient)], trainable_values
        )
        reference.apply_dense(gradient)
    for target, value in zip(optimizer.variables, optimizer_values):
        target.assign(value)
    variable.assign(trainable_values[0])
    assert_matches_reference(optimizer, variable, reference)


# --------------------------------------------------------------------------- rowwise v, per-row bias correction

NEW_OPTIONS = {"second_moment": "rowwise", "bias_correction": "per_row"}


@pytest.mark.parametrize("second_moment", ["full", "rowwise"])
@pytest.mark.parametrize("bias_correction", ["global", "per_row"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_slot_shapes_and_dtypes(second_moment, bias_correction, rank):
    shape = {1: (ROWS,), 2: (ROWS, DIM), 3: (ROWS, 2, DIM)}[rank]
    variable = keras.Variable(initial_table(shape), name="table")
    optimizer = kto.EmbeddingAdam(second_moment=second_moment, bias_correction=bias_correction)
    optimizer.build([variable])
    layout = {
        v.name: (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
        for v in optimizer.variables
    }
    assert layout["table_momenta"] == (shape, "float32")
    assert layout["table_velocities"] == (
        (ROWS,) if second_moment == "rowwise" else shape,
        "float32",
    )
    if bias_correction == "per_row":
        assert layout["table_row_steps"] == ((ROWS,), "int32")
    else:
        assert "table_row_steps" not in layout  # created only when an option needs it
    slots = optimizer._state_of(variable).slots
    expected = 2 + (bias_correction == "per_row")
    assert len(slots) == expected
    if rank == 2 and bias_correction == "global":
        # The state is (1 + 1/dim) x the table with a rowwise v, 2x with a full one.
        size = sum(math.prod(s.shape) for s in slots)
        assert size == (ROWS * DIM + ROWS if second_moment == "rowwise" else 2 * ROWS * DIM)


@pytest.mark.backend_neutral
def test_new_options_references_discriminate():
    """Guards: per-row correction and a rowwise v change the numbers of a lazy run (the tests above test something)."""

    def final(**options):
        reference = NumpyEmbeddingAdam(initial_table(), learning_rate=0.05, **options)
        for seed, ids in enumerate(STEP_IDS):
            reference.apply_sparse(ids, step_values(ids, seed))
        return reference

    plain = final()
    per_row = final(bias_correction="per_row")
    assert not np.allclose(per_row.weights, plain.weights, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(per_row.row_steps, [2, 4, 2, 1, 3, 1, 1, 2, 1])
    rowwise = final(second_moment="rowwise")
    assert not np.allclose(rowwise.weights, plain.weights, rtol=1e-4, atol=1e-6)
    assert rowwise.velocities.shape == (ROWS,)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"second_moment": "rowwise"},
        {
            "second_moment": "rowwise",
            "sum_inside_sqrt": False,
            "epsilon": 0.01,
            "weight_decay": 1.0,
            "clipvalue": 0.3,
            "clip_weight_min": -0.08,
        },
    ],
    ids=["defaults", "rowwise", "rowwise_all_options"],
)
def test_not_lazy_per_row_equals_global(options, kind):
    """With `lazy_adam=False` every row is updated every step: each row's count is the step, so per_row == global."""
    init = initial_table()
    results = {}
    for bias_correction in ("global", "per_row"):
        variable = keras.Variable(init, name="table")
        optimizer = kto.EmbeddingAdam(
            learning_rate=make_schedule(),
            lazy_adam=False,
            bias_correction=bias_correction,
            **options,
        )
        for seed, ids in enumerate(STEP_IDS):
            optimizer.apply(
                [make_gradient(kind, ids, step_values(ids, seed), init.shape)], [variable]
            )
        results[bias_correction] = state(optimizer, variable)
        if bias_correction == "per_row":
            np.testing.assert_array_equal(
                ops.convert_to_numpy(slot(optimizer, variable, "row_steps")),
                np.full(ROWS, len(STEP_IDS)),
            )
    for name, a, b in zip(
        ("weights", "momenta", "velocities"), results["global"], results["per_row"]
    ):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("use_gradient_accumulation", [True, False])
def test_new_options_untouched_rows_keep_everything_bit_for_bit(
    kind, rank, use_gradient_accumulation
):
    options = {**LAZY_OPTIONS, **NEW_OPTIONS}
    if not use_gradient_accumulation:
        options.pop("clipvalue")
        options["use_gradient_accumulation"] = False
    shape = (ROWS, DIM) if rank == 2 else (ROWS,)
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **options)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    names = ("weights", "momenta", "velocities", "row_steps")
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed, shape[1:])
        before = (
            [np.array(x) for x in state(optimizer, variable)]
            + [ops.convert_to_numpy(slot(optimizer, variable, "row_steps"))]
            if seed
            else None
        )
        optimizer.apply([make_gradient(kind, ids, values, shape)], [variable])
        feed(reference, kind, ids, values)
        assert_matches_reference(optimizer, variable, reference)
        if before is None:
            continue
        after = list(state(optimizer, variable)) + [
            ops.convert_to_numpy(slot(optimizer, variable, "row_steps"))
        ]
        untouched, touched = np.setdiff1d(np.arange(ROWS), ids), np.unique(ids)
        for name, old, new in zip(names, before, after):
            np.testing.assert_array_equal(
                new[untouched], old[untouched], err_msg=f"untouched {name} changed"
            )
            assert not np.array_equal(new[touched], old[touched]), f"touched {name} did not change"


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize(
    "options",
    [
        NEW_OPTIONS,
        {
            **NEW_OPTIONS,
            "weight_decay_factor": 0.5,
            "clipvalue": 0.3,
            "clip_weight_max": 0.05,
            "lazy_adam": False,
        },
    ],
    ids=["lazy", "not_lazy_decay_and_clipping"],
)
def test_new_options_rank_1_variable(options, kind):
    steps = [[0, 3, 3, 5], [1, 5], [7, 0, 0], [2, 3, 8], [5, 5, 4]]
    run_against_reference(options, kind, shape=(ROWS,), steps=steps)


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_new_options_rank_3_variable(kind):
    """Rows of shape (2, DIM): the rowwise v is the mean of g^2 over the whole row."""
    run_against_reference({**NEW_OPTIONS, "weight_decay_factor": 0.5}, kind, shape=(ROWS, 2, DIM))


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_new_options_with_a_schedule(kind):
    options = {
        **NEW_OPTIONS,
        "epsilon": 0.01,
        "weight_decay_factor": 1.0,
        "multiply_weight_decay_factor_by_learning_rate": True,
    }
    run_against_reference(
        options, kind, learning_rate=make_schedule(), reference_learning_rate=schedule_reference
    )


def test_new_options_with_keras_weight_decay():
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, weight_decay=2.0, **NEW_OPTIONS)
    reference = NumpyEmbeddingAdam(
        init,
        learning_rate=0.05,
        weight_decay_factor=2.0,
        multiply_weight_decay_factor_by_learning_rate=True,
        **NEW_OPTIONS,
    )
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
        assert_matches_reference(optimizer, variable, reference)


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_new_options_under_loss_scale_optimizer(kind):
    if BACKEND == "torch" and kind == "sparse":
        pytest.skip(
            "Keras's LossScaleOptimizer calls torch.isfinite on the gradient, which has no sparse kernel "
            "(whatever the optimizer's options)"
        )
    init = initial_table()
    variable = keras.Variable(init, name="table")
    options = {**NEW_OPTIONS, "clipvalue": (-0.25, 0.3)}
    optimizer = keras.optimizers.LossScaleOptimizer(
        kto.EmbeddingAdam(learning_rate=0.05, **options),
        initial_scale=2.0**10,
        dynamic_growth_steps=1000,
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    if BACKEND == "jax":
        import jax

        apply = jax.jit(optimizer.stateless_apply)
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        gradient = make_gradient(kind, ids, values * 2.0**10, init.shape)
        if BACKEND == "jax":
            trainable, state_values = apply(
                [v.value for v in optimizer.variables], [gradient], [variable.value]
            )
            for target, value in zip([variable, *optimizer.variables], [*trainable, *state_values]):
                target.assign(value)
        else:
            optimizer.apply([gradient], [variable])
        feed(reference, kind, ids, values)
        assert_matches_reference(optimizer.inner_optimizer, variable, reference)


def test_new_options_with_keras_gradient_accumulation():
    """Keras's `gradient_accumulation_steps`: one update on the mean; a row's count grows per update."""
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, gradient_accumulation_steps=2, **NEW_OPTIONS)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    collected = []
    for position, ids in enumerate(STEP_IDS[:4]):
        gradient = densify(ids, step_values(ids, position), init.shape)
        optimizer.apply([ops.convert_to_tensor(gradient)], [variable])
        collected.append(gradient)
        if len(collected) == 2:
            reference.apply_dense(np.mean(collected, axis=0))
            collected = []
            assert_matches_reference(optimizer, variable, reference)


def test_new_options_skipped_nonfinite_step_leaves_row_steps():
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, skip_nonfinite_updates=True, **NEW_OPTIONS)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    for seed, ids in enumerate(STEP_IDS[:3]):
        values = step_values(ids, seed)
        if seed == 1:
            bad = densify(ids, values, init.shape)
            bad[ids[0], 0] = np.nan
            optimizer.apply([ops.convert_to_tensor(bad)], [variable])
            assert_matches_reference(optimizer, variable, reference)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
        assert_matches_reference(optimizer, variable, reference)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_new_options_table_dtypes(dtype, kind):
    numpy_dtype = _bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    init = (np.round(initial_table() * 256) / 256).astype(np.float32)
    variable = keras.Variable(init, name="table", dtype=dtype)
    options = {**NEW_OPTIONS, "weight_decay_factor": 0.5, "clipvalue": 0.4}
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **options)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, weight_dtype=numpy_dtype, **options)
    ulp = {"bfloat16": 2.0**-7, "float16": 2.0**-10}[dtype]
    for seed, ids in enumerate(STEP_IDS[:4]):
        values = np.round(step_values(ids, seed) * 64) / 64
        optimizer.apply([make_gradient(kind, ids, values, init.shape, dtype)], [variable])
        feed(reference, kind, ids, values)
    for name in ("momenta", "velocities"):
        assert keras.backend.standardize_dtype(slot(optimizer, variable, name).dtype) == "float32"
    weights, momenta, velocities = state(optimizer, variable)
    np.testing.assert_allclose(
        weights, reference.weights.astype(np.float64), rtol=4 * ulp, atol=4 * ulp * 0.1
    )
    np.testing.assert_allclose(momenta, reference.momenta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(velocities, reference.velocities, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(slot(optimizer, variable, "row_steps")), reference.row_steps
    )


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function(jit_compile=True) is TensorFlow's XLA path"
)
@pytest.mark.parametrize("use_gradient_accumulation", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("jit_compile", [True, False])
def test_tensorflow_new_options_with_indexed_slices_in_tf_function(
    use_gradient_accumulation, dtype, jit_compile
):
    import tensorflow as tf

    options = {**XLA_OPTIONS, **NEW_OPTIONS}
    if not use_gradient_accumulation:
        options.pop("clipvalue")
        options["use_gradient_accumulation"] = False
    numpy_dtype = _bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    init = (np.round(initial_table() * 256) / 256).astype(np.float32)
    variable = keras.Variable(init, name="table", dtype=dtype)
    optimizer = kto.EmbeddingAdam(learning_rate=make_schedule(), **options)
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(
        init, learning_rate=schedule_reference, weight_dtype=numpy_dtype, **options
    )

    @tf.function(jit_compile=jit_compile)
    def train_step(ids, values):
        gradient = tf.IndexedSlices(values, ids, dense_shape=tf.constant(init.shape, tf.int32))
        optimizer.apply([gradient], [variable])

    ulp = 2.0**-7 if dtype == "bfloat16" else 2.0**-23
    for seed, ids in enumerate(STEP_IDS + [[3, 3, 3, 3], [], [8, 0, 8, 0, 8]]):
        values = np.round(step_values(ids, seed) * 64) / 64
        train_step(
            tf.constant(ids, tf.int64, shape=[len(ids)]), tf.constant(values.astype(numpy_dtype))
        )
        reference.apply_sparse(np.asarray(ids, np.int64), values)
        weights, momenta, velocities = state(optimizer, variable)
        np.testing.assert_allclose(
            weights, reference.weights.astype(np.float64), rtol=4 * ulp, atol=1e-6
        )
        np.testing.assert_allclose(momenta, reference.momenta, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(velocities, reference.velocities, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(
            ops.convert_to_numpy(slot(optimizer, variable, "row_steps")), reference.row_steps
        )


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit(optimizer.stateless_apply) is JAX's XLA path")
@pytest.mark.parametrize("gradient", ["dense", "dense_capacity_2", "bcoo", "bcoo_last_wins"])
def test_jax_jit_new_options(gradient):
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    options = {**XLA_OPTIONS, **NEW_OPTIONS}
    if gradient == "bcoo_last_wins":
        options.pop("clipvalue")
        options["use_gradient_accumulation"] = False
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=make_schedule(),
        max_touched_rows=2 if gradient.endswith("_2") else None,
        **options,
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=schedule_reference, **options)
    apply = jax.jit(optimizer.stateless_apply, donate_argnums=(0, 2))
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [variable.value]
    for seed, ids in enumerate(STEP_IDS):
        values = step_values(ids, seed)
        if gradient.startswith("bcoo"):
            grad = jax_sparse.BCOO(
                (jnp.asarray(values), jnp.asarray(ids, jnp.int32)[:, None]), shape=init.shape
            )
            reference.apply_sparse(ids, values)
        else:
            grad = ops.convert_to_tensor(densify(ids, values, init.shape))
            reference.apply_dense(densify(ids, values, init.shape))
        before = [np.array(v) for v in [trainable_values[0], *optimizer_values]]
        trainable_values, optimizer_values = apply(optimizer_values, [grad], trainable_values)
        untouched = np.setdiff1d(np.arange(ROWS), ids)
        for old, new in zip(
            before, [np.asarray(v) for v in [trainable_values[0], *optimizer_values]]
        ):
            if (
                old.ndim and old.shape[0] == ROWS
            ):  # the table and every slot, bit for bit on untouched rows
                np.testing.assert_array_equal(new[untouched], old[untouched])
    for target, value in zip(optimizer.variables, optimizer_values):
        target.assign(value)
    variable.assign(trainable_values[0])
    assert_matches_reference(optimizer, variable, reference)


# --------------------------------------------------------------------------- lazy EMA

EMA_STEPS = STEP_IDS + [[1], [2, 3], [8], [0, 5, 5]]


def average_of(optimizer, variable):
    matches = [v for v in optimizer.variables if v.name == f"{variable.name}_average"]
    assert len(matches) == 1, [v.name for v in optimizer.variables]
    return matches[0]


def _ema_run(
    kind,
    options,
    *,
    momentum=0.8,
    frequency=None,
    accumulation=None,
    steps=EMA_STEPS,
    shape=(ROWS, DIM),
    check_lazy=True,
):
    """Lazy EMA vs Keras's dense EMA (KerasEma) around the numpy reference: every observable value."""
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05,
        use_ema=True,
        ema_momentum=momentum,
        ema_overwrite_frequency=frequency,
        gradient_accumulation_steps=accumulation,
        **options,
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    ema = KerasEma(reference, momentum, frequency, accumulation)
    collected = []
    for seed, ids in enumerate(steps):
        values = step_values(ids, seed, shape[1:])
        average_before = (
            np.array(to_numpy(average_of(optimizer, variable))) if optimizer.built else None
        )
        optimizer.apply([make_gradient(kind, ids, values, shape)], [variable])
        if accumulation:
            collected.append(densify(ids, values, shape))
            if len(collected) == accumulation:
                reference.apply_dense(np.mean(collected, axis=0))
                collected = []
        else:
            feed(reference, kind, ids, values)
        ema.after_apply()
        # The weights a user sees (overwritten every `frequency` updates) are Keras's.
        np.testing.assert_allclose(
            to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6, err_msg=f"step {seed}"
        )
        iterations = seed // (accumulation or 1)
        overwrite = frequency and (iterations + 1) % frequency == 0
        if check_lazy and average_before is not None and not overwrite and seed:
            # O(rows touched): the stored averages of untouched rows are not written.
            untouched = np.setdiff1d(np.arange(shape[0]), ids)
            np.testing.assert_array_equal(
                to_numpy(average_of(optimizer, variable))[untouched], average_before[untouched]
            )
    optimizer.catch_up_moving_averages()
    np.testing.assert_allclose(
        to_numpy(average_of(optimizer, variable)), ema.average, rtol=1e-5, atol=1e-6
    )
    optimizer.finalize_variable_values([variable])
    ema.finalize()
    np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)
    return optimizer, variable


EMA_OPTION_CASES = {
    "defaults": {},
    "all_options": {
        "weight_decay_factor": 0.5,
        "clipvalue": (-0.3, 0.25),
        "clip_weight_max": 0.07,
        "epsilon": 0.01,
    },
    "rowwise_per_row": NEW_OPTIONS,
}


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("frequency", [None, 3])
@pytest.mark.parametrize("options", list(EMA_OPTION_CASES.values()), ids=list(EMA_OPTION_CASES))
def test_lazy_ema_equals_keras_dense_ema(kind, frequency, options):
    _ema_run(kind, options, frequency=frequency)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.99, 1.0])
def test_lazy_ema_momentum_edges(momentum):
    _ema_run("dense", {}, momentum=momentum, frequency=4)


def test_lazy_ema_without_accumulation_of_duplicates():
    _ema_run("sparse", {"use_gradient_accumulation": False, **NEW_OPTIONS}, frequency=3)


@pytest.mark.parametrize("rank", [1, 3])
def test_lazy_ema_other_ranks(rank):
    shape = (ROWS,) if rank == 1 else (ROWS, 2, DIM)
    steps = [[0, 3, 3, 5], [1, 5], [7, 0, 0], [2, 3, 8], [5, 5, 4], [6], [1, 2]]
    _ema_run("dense", NEW_OPTIONS, frequency=3, steps=steps, shape=shape)


@pytest.mark.parametrize("frequency", [None, 2])
@pytest.mark.parametrize("options", [{}, NEW_OPTIONS], ids=["defaults", "rowwise_per_row"])
def test_lazy_ema_with_keras_gradient_accumulation(frequency, options):
    # Keras updates the EMA at every micro-step; the first update's micro-steps copy the weights.
    _ema_run("dense", options, frequency=frequency, accumulation=2, check_lazy=False)


def test_lazy_ema_state_and_not_lazy_keeps_keras_ema():
    variable = keras.Variable(initial_table(), name="table")
    optimizer = kto.EmbeddingAdam(use_ema=True)
    optimizer.build([variable])
    steps = slot(optimizer, variable, "average_steps")
    assert tuple(steps.shape) == (ROWS,) and keras.backend.standardize_dtype(steps.dtype) == "int32"
    dense = kto.EmbeddingAdam(use_ema=True, lazy_adam=False)
    dense.build([keras.Variable(initial_table(), name="table")])
    assert not [v for v in dense.variables if v.name.endswith("average_steps")]
    _ema_run("dense", {"lazy_adam": False}, frequency=3, check_lazy=False)


def test_lazy_ema_in_fit_finalizes_to_keras_ema():
    """`fit` ends with `finalize_variable_values`: the model's weights are Keras's EMA of the trajectory."""
    from _kto_models import compile_model, make_data, make_model, weights_of

    x, y = make_data("recommender", 96)
    trajectory = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            trajectory.append(weights_of(self.model))

    plain = compile_model(
        make_model("recommender"), "recommender", kto.EmbeddingAdam(0.02, **NEW_OPTIONS)
    )
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
    averaged = compile_model(
        make_model("recommender"),
        "recommender",
        kto.EmbeddingAdam(0.02, use_ema=True, ema_momentum=0.7, **NEW_OPTIONS),
    )
    averaged.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expected = None
    for weights in trajectory:
        weights = [w.astype(np.float64) for w in weights]
        expected = (
            weights if expected is None else [0.7 * e + 0.3 * w for e, w in zip(expected, weights)]
        )
    assert len(trajectory) == 6
    for got, want in zip(weights_of(averaged), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit(optimizer.stateless_apply) is JAX's XLA path")
@pytest.mark.parametrize("gradient", ["dense", "dense_capacity_2", "bcoo"])
def test_jax_jit_lazy_ema(gradient):
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    options = {**XLA_OPTIONS, **NEW_OPTIONS}
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05,
        use_ema=True,
        ema_momentum=0.8,
        ema_overwrite_frequency=3,
        max_touched_rows=2 if gradient.endswith("_2") else None,
        **options,
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    ema = KerasEma(reference, 0.8, 3)
    apply = jax.jit(optimizer.stateless_apply, donate_argnums=(0, 2))
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [variable.value]
    for seed, ids in enumerate(EMA_STEPS):
        values = step_values(ids, seed)
        if gradient == "bcoo":
            grad = jax_sparse.BCOO(
                (jnp.asarray(values), jnp.asarray(ids, jnp.int32)[:, None]), shape=init.shape
            )
            reference.apply_sparse(ids, values)
        else:
            grad = ops.convert_to_tensor(densify(ids, values, init.shape))
            reference.apply_dense(densify(ids, values, init.shape))
        ema.after_apply()
        trainable_values, optimizer_values = apply(optimizer_values, [grad], trainable_values)
        np.testing.assert_allclose(
            np.asarray(trainable_values[0]), reference.weights, rtol=1e-5, atol=1e-6
        )
    for target, value in zip(optimizer.variables, optimizer_values):
        target.assign(value)
    variable.assign(trainable_values[0])
    optimizer.finalize_variable_values([variable])
    np.testing.assert_allclose(to_numpy(variable), ema.average, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function is TensorFlow's graph path")
@pytest.mark.parametrize("jit_compile", [True, False])
def test_tensorflow_lazy_ema_in_tf_function(jit_compile):
    import tensorflow as tf

    options = {**XLA_OPTIONS, **NEW_OPTIONS}
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3, **options
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    ema = KerasEma(reference, 0.8, 3)

    @tf.function(jit_compile=jit_compile)
    def train_step(ids, values):
        optimizer.apply(
            [tf.IndexedSlices(values, ids, dense_shape=tf.constant(init.shape, tf.int32))],
            [variable],
        )

    for seed, ids in enumerate(EMA_STEPS):
        values = step_values(ids, seed)
        train_step(tf.constant(ids, tf.int32), tf.constant(values))
        reference.apply_sparse(ids, values)
        ema.after_apply()
        np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)
    optimizer.finalize_variable_values([variable])
    np.testing.assert_allclose(to_numpy(variable), ema.average, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- slots, config, validation


def test_slot_variable_creation_fn_is_used():
    calls = []

    def create_slots(variable, slot_names, initializers):
        calls.append((variable, list(slot_names), list(initializers)))
        return {
            name: keras.Variable(
                init(variable.shape, "float32"), name=f"custom_{name}", trainable=False
            )
            for name, init in zip(slot_names, initializers)
        }

    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, slot_variable_creation_fn=create_slots)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05)
    for seed, ids in enumerate(STEP_IDS[:3]):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
    assert len(calls) == 1
    called_variable, names, initializers = calls[0]
    assert (
        called_variable is variable
        and names == ["momenta", "velocities"]
        and len(initializers) == 2
    )
    by_name = {v.name: v for v in optimizer.variables}
    assert "custom_momenta" in by_name and "custom_velocities" in by_name
    np.testing.assert_allclose(
        to_numpy(by_name["custom_momenta"]), reference.momenta, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        to_numpy(by_name["custom_velocities"]), reference.velocities, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)


FULL_CONFIG = dict(
    beta_1=0.8,
    beta_2=0.95,
    epsilon=0.01,
    lazy_adam=True,
    sum_inside_sqrt=False,
    use_gradient_accumulation=True,
    clip_weight_min=-0.09,
    clip_weight_max=0.08,
    weight_decay_factor=0.3,
    multiply_weight_decay_factor_by_learning_rate=True,
    clipvalue=(-0.2, None),
    low_dimensional_packing_status=True,
    max_touched_rows=4096,
    clipnorm=5.0,
    second_moment="rowwise",
    bias_correction="per_row",
)


def _assert_same_numbers(restored, config, reference_learning_rate):
    init = initial_table()
    variable = keras.Variable(init, name="table")
    ref_options = {
        k: v
        for k, v in config.items()
        if k not in ("low_dimensional_packing_status", "max_touched_rows")
    }
    reference = NumpyEmbeddingAdam(init, learning_rate=reference_learning_rate, **ref_options)
    for seed, ids in enumerate(STEP_IDS[:3]):
        values = step_values(ids, seed)
        restored.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
    assert_matches_reference(restored, variable, reference)


def test_get_config_from_config_round_trip():
    optimizer = kto.EmbeddingAdam(learning_rate=make_schedule(), **FULL_CONFIG)
    config = optimizer.get_config()
    for key, value in FULL_CONFIG.items():
        expected = list(value) if isinstance(value, tuple) else value
        got = list(config[key]) if isinstance(config[key], (tuple, list)) else config[key]
        assert got == expected, key
    restored = kto.EmbeddingAdam.from_config(config)
    assert restored.get_config() == config
    assert restored.low_dimensional_packing_status is True
    assert tuple(restored.get_config()["clipvalue"]) == (-0.2, None)
    _assert_same_numbers(restored, FULL_CONFIG, schedule_reference)


def test_keras_serialize_deserialize_round_trip():
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, **FULL_CONFIG)
    serialized = keras.optimizers.serialize(optimizer)
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is kto.EmbeddingAdam
    assert restored.get_config() == optimizer.get_config()
    assert restored.low_dimensional_packing_status is True
    assert tuple(restored.get_config()["clipvalue"]) == (-0.2, None)
    _assert_same_numbers(restored, FULL_CONFIG, 0.05)


@keras.saving.register_keras_serializable(package="tests_embedding_adam")
def registered_slot_fn(variable, slot_names, initializers):
    return {
        name: keras.Variable(
            init(variable.shape, "float32"), name=f"registered_{name}", trainable=False
        )
        for name, init in zip(slot_names, initializers)
    }


def test_slot_variable_creation_fn_with_the_new_options():
    """The user's function makes `momenta` and `velocities` (of shape `(rows,)` when rowwise); `row_steps` is ours."""

    def create_slots(variable, slot_names, initializers):
        shapes = {"momenta": variable.shape, "velocities": variable.shape[:1]}
        return {
            name: keras.Variable(
                init(shapes[name], "float32"), name=f"custom_{name}", trainable=False
            )
            for name, init in zip(slot_names, initializers)
        }

    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, slot_variable_creation_fn=create_slots, **NEW_OPTIONS
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    for seed, ids in enumerate(STEP_IDS[:3]):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient("dense", ids, values, init.shape)], [variable])
        reference.apply_dense(densify(ids, values, init.shape))
    by_name = {v.name: v for v in optimizer.variables}
    np.testing.assert_allclose(
        to_numpy(by_name["custom_velocities"]), reference.velocities, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(by_name["table_row_steps"]), reference.row_steps
    )
    np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)

    # A full-size velocities slot does not fit a rowwise second moment.
    wrong = kto.EmbeddingAdam(slot_variable_creation_fn=registered_slot_fn, second_moment="rowwise")
    with pytest.raises(ValueError, match=r"\(9,\) for slot 'velocities'"):
        wrong.build([keras.Variable(init, name="table")])


def test_registered_slot_variable_creation_fn_round_trips():
    optimizer = kto.EmbeddingAdam(slot_variable_creation_fn=registered_slot_fn)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert restored.slot_variable_creation_fn is registered_slot_fn


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"beta_1": 1.0}, "beta_1"),
        ({"beta_1": -0.1}, "beta_1"),
        ({"beta_2": 1.0}, "beta_2"),
        ({"beta_2": -1e-3}, "beta_2"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -1e-7}, "epsilon"),
        ({"use_gradient_accumulation": False, "lazy_adam": False}, "use_gradient_accumulation"),
        ({"use_gradient_accumulation": False, "clipvalue": 1.0}, "clipvalue"),
        ({"use_gradient_accumulation": False, "clipvalue": (None, 1.0)}, "clipvalue"),
        ({"clip_weight_min": 0.5, "clip_weight_max": 0.1}, "clip_weight_min"),
        ({"clipvalue": (1.0, -1.0)}, "clipvalue"),
        ({"slot_variable_creation_fn": "not callable"}, "slot_variable_creation_fn"),
        ({"weight_decay": 0.1, "weight_decay_factor": 0.1}, "weight_decay"),
        ({"second_moment": "factored"}, "second_moment"),
        ({"bias_correction": "local"}, "bias_correction"),
    ],
)
def test_validation_errors_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        kto.EmbeddingAdam(**kwargs)


def test_boundary_values_are_accepted():
    optimizer = kto.EmbeddingAdam(
        beta_1=0.0, beta_2=0.0, clip_weight_min=0.1, clip_weight_max=0.1, clipvalue=(0.2, 0.2)
    )
    assert optimizer.beta_1 == 0.0 and optimizer.beta_2 == 0.0
