"""EmbeddingAdam under Keras's `gradient_accumulation_steps`, its tables' rows accumulated sparsely.

References: the numpy reference with Keras's accumulation written out from
docs/algorithms.md (`KerasAccumulation`: every N-th micro-batch one lazy update
on the mean, of the rows named in any of the N), and the same optimizer with
Keras's own dense accumulation (`KerasDenseAccumulation` below, the behaviour
before rows were accumulated sparsely). Sparse gradients are `tf.IndexedSlices`,
torch sparse COO tensors and JAX BCOO arrays (which JAX densifies: Keras's JAX
step is stateless and dense).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_tpu_optim as kto
from keras_tpu_optim import _private, _saving
from tests.reference.numpy_embedding_adam import KerasAccumulation, KerasEma, NumpyEmbeddingAdam

# The module pytest collected (as `test_embedding_adam`), not a second copy of it: a second
# import would register its Keras-serializable test functions again, under the same names.
from test_embedding_adam import (
    GRAD_KINDS,
    NEW_OPTIONS,
    ROWS,
    DIM,
    densify,
    initial_table,
    make_gradient,
    make_schedule,
    schedule_reference,
    slot,
    step_values,
    to_numpy,
)

BACKEND = keras.backend.backend()

# Micro-batches: duplicates, rows touched at irregular intervals, rows touched only in a
# window's first micro-batches (7 and 3 under N=4; 6 under N=3), an empty one. 12 = lcm(2, 3, 4).
ACCUMULATION_IDS = [
    np.array(ids, np.int64)
    for ids in [
        [1, 4, 1, 7],
        [0, 1, 2, 2],
        [7, 7, 3],
        [4, 8, 1, 8],
        [6, 2],
        [5, 1, 5],
        [6, 6, 0],
        [],
        [8, 2, 4],
        [1, 1],
        [0, 7, 3],
        [5],
    ]
]

OPTION_CASES = {
    "defaults": ({}, {}),
    "clip": (
        {"clipvalue": (-0.3, 0.25), "clipnorm": 0.8},
        {"clipvalue": (-0.3, 0.25), "clipnorm": 0.8},
    ),
    "global_clipnorm": ({"global_clipnorm": 0.5}, {"clipnorm": 0.5}),
    "decay": (
        {"weight_decay_factor": 0.5, "clip_weight_max": 0.07, "epsilon": 0.01},
        {"weight_decay_factor": 0.5, "clip_weight_max": 0.07, "epsilon": 0.01},
    ),
    "keras_weight_decay": (
        {"weight_decay": 0.3},
        {"weight_decay_factor": 0.3, "multiply_weight_decay_factor_by_learning_rate": True},
    ),
    "rowwise_per_row": (NEW_OPTIONS, NEW_OPTIONS),
    "last_occurrence": (
        {"use_gradient_accumulation": False, "sum_inside_sqrt": False},
        {"use_gradient_accumulation": False, "sum_inside_sqrt": False},
    ),
}


class KerasDenseAccumulation(kto.EmbeddingAdam):
    """EmbeddingAdam with Keras's own dense accumulator: the behaviour the row accumulation must equal."""

    @property
    def _accumulates_rows(self):
        return False


def rows_of(optimizer, variable):
    """Everything a row holds: weights and each slot (momenta, velocities, row_steps)."""
    names = ["momenta", "velocities"] + (
        ["row_steps"] if optimizer.bias_correction == "per_row" else []
    )
    return [to_numpy(variable)] + [to_numpy(slot(optimizer, variable, name)) for name in names]


def assert_rows_match_reference(optimizer, variable, reference, rtol=1e-5, atol=1e-6):
    ours = rows_of(optimizer, variable)
    theirs = [reference.weights, reference.momenta, reference.velocities]
    for name, a, b in zip(["weights", "momenta", "velocities"], ours, theirs):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
    if optimizer.bias_correction == "per_row":
        np.testing.assert_array_equal(ours[3], reference.row_steps, err_msg="row_steps")


def _apply(optimizer, gradient, variable, mode):
    """`optimizer.apply` eagerly, or on TF in a tf.function (with XLA: mode "xla")."""
    if mode == "eager":
        optimizer.apply([gradient], [variable])
        return
    import tensorflow as tf

    functions = optimizer.__dict__.setdefault("_test_functions", {})
    if mode not in functions:
        functions[mode] = tf.function(
            lambda g: optimizer.apply([g], [variable]), jit_compile=mode == "xla"
        )
    functions[mode](gradient)


def run_against_reference(
    steps,
    kind,
    options,
    reference_options,
    *,
    mode="eager",
    learning_rate=0.05,
    reference_learning_rate=None,
    ids_list=ACCUMULATION_IDS,
):
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=learning_rate, gradient_accumulation_steps=steps, **options
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(
        init,
        learning_rate=learning_rate if reference_learning_rate is None else reference_learning_rate,
        **reference_options,
    )
    accumulation = KerasAccumulation(reference, steps)
    for seed, ids in enumerate(ids_list):
        values = step_values(ids, seed)
        before = rows_of(optimizer, variable)
        _apply(optimizer, make_gradient(kind, ids, values, init.shape), variable, mode)
        if kind == "dense":
            updated = accumulation.apply_dense(densify(ids, values, init.shape))
        else:
            updated = accumulation.apply_sparse(ids, values)
        if not updated:
            # Between updates nothing but the accumulator (and the window marks) changes.
            for a, b in zip(rows_of(optimizer, variable), before):
                np.testing.assert_array_equal(a, b)
        assert_rows_match_reference(optimizer, variable, reference)
    assert (
        int(ops.convert_to_numpy(optimizer.iterations))
        == reference.iterations
        == len(ids_list) // steps
    )
    return optimizer, variable


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("steps", [2, 3, 4])
def test_row_accumulation_equals_the_reference(steps, case, kind):
    if steps != 3 and case not in ("defaults", "rowwise_per_row", "clip"):
        pytest.skip(
            "every option case runs with steps=3; steps=2 and 4 run a subset (2 shared CPU cores)"
        )
    options, reference_options = OPTION_CASES[case]
    run_against_reference(steps, kind, options, reference_options)


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_row_accumulation_with_a_schedule(kind):
    steps = 3
    # `iterations` (bias correction) counts updates; a schedule is evaluated at the micro-batch
    # counter, steps * update + steps - 1 at update `update` (as for every Keras optimizer).
    run_against_reference(
        steps,
        kind,
        {"weight_decay_factor": 0.5},
        {"weight_decay_factor": 0.5},
        learning_rate=make_schedule(),
        reference_learning_rate=lambda update: schedule_reference(steps * update + steps - 1),
    )


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function and jit_compile are TensorFlow's graph paths"
)
@pytest.mark.parametrize("mode", ["function", "xla"])
@pytest.mark.parametrize("case", ["defaults", "clip", "rowwise_per_row", "last_occurrence"])
def test_row_accumulation_in_tf_function_and_xla(mode, case):
    options, reference_options = OPTION_CASES[case]
    run_against_reference(4, "sparse", options, reference_options, mode=mode)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="jit_compile is TensorFlow's XLA path")
@pytest.mark.parametrize("case", ["defaults", "clip", "last_occurrence"])
def test_row_accumulation_under_xla_in_a_list_of_steps_times_ids(case):
    """Under XLA a window's rows fit a static list of N x ids (micro-batches of one size), else of the table's rows."""
    rows, ids_per_step, steps = 40, 3, 3
    rng = np.random.default_rng(7)
    # Windows of at most 9 distinct rows (duplicates too), then one whose last micro-batch is smaller.
    ids_list = [rng.integers(0, rows, ids_per_step) for _ in range(3 * steps)] + [
        rng.integers(0, rows, 5),
        rng.integers(0, rows, 5),
        [1],
    ]
    ids_list[0][1] = ids_list[0][0]
    options, reference_options = OPTION_CASES[case]
    shape = (rows, DIM)
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, gradient_accumulation_steps=steps, **options)
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **reference_options)
    accumulation = KerasAccumulation(reference, steps)
    for seed, ids in enumerate(ids_list):
        ids = np.asarray(ids, np.int64)
        values = step_values(ids, seed)
        _apply(optimizer, make_gradient("sparse", ids, values, shape), variable, "xla")
        accumulation.apply_sparse(ids, values)
        assert_rows_match_reference(optimizer, variable, reference)
    assert reference.iterations == 4


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("case", ["defaults", "clip", "rowwise_per_row", "decay"])
def test_row_accumulation_equals_keras_dense_accumulation(case, kind):
    """The same optimizer with Keras's own table-sized accumulator (fed the dense gradients) gives the same numbers.

    (Keras's own accumulator cannot take a torch sparse or a BCOO gradient.)
    """
    options, _ = OPTION_CASES[case]
    init = initial_table()
    results = []
    for cls, cls_kind in ((kto.EmbeddingAdam, kind), (KerasDenseAccumulation, "dense")):
        variable = keras.Variable(init, name="table")
        optimizer = cls(learning_rate=0.05, gradient_accumulation_steps=4, **options)
        for seed, ids in enumerate(ACCUMULATION_IDS):
            optimizer.apply(
                [make_gradient(cls_kind, ids, step_values(ids, seed), init.shape)], [variable]
            )
        results.append(rows_of(optimizer, variable))
    for ours, keras_dense in zip(*results):
        np.testing.assert_allclose(ours, keras_dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("frequency", [None, 2])
@pytest.mark.parametrize("options", [{}, NEW_OPTIONS], ids=["defaults", "rowwise_per_row"])
def test_row_accumulation_with_lazy_ema(options, frequency, kind):
    """Keras updates the EMA at every micro-step; the first update's micro-steps copy the weights."""
    steps, momentum = 3, 0.8
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05,
        use_ema=True,
        ema_momentum=momentum,
        ema_overwrite_frequency=frequency,
        gradient_accumulation_steps=steps,
        **options,
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **options)
    accumulation, ema = (
        KerasAccumulation(reference, steps),
        KerasEma(reference, momentum, frequency, steps),
    )
    for seed, ids in enumerate(ACCUMULATION_IDS):
        values = step_values(ids, seed)
        optimizer.apply([make_gradient(kind, ids, values, init.shape)], [variable])
        accumulation.apply_sparse(ids, values)
        ema.after_apply()
        np.testing.assert_allclose(
            to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6, err_msg=f"step {seed}"
        )
    optimizer.finalize_variable_values([variable])
    ema.finalize()
    np.testing.assert_allclose(to_numpy(variable), reference.weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_row_accumulation_under_loss_scale_optimizer(kind):
    if BACKEND == "torch" and kind == "sparse":
        pytest.skip(
            "Keras's LossScaleOptimizer calls torch.isfinite on the gradient, which has no sparse kernel"
        )
    scale, steps = 2.0**10, 2
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = keras.optimizers.LossScaleOptimizer(
        kto.EmbeddingAdam(learning_rate=0.05, gradient_accumulation_steps=steps, **NEW_OPTIONS),
        initial_scale=scale,
        dynamic_growth_steps=1000,
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    accumulation = KerasAccumulation(reference, steps)
    if BACKEND == "jax":
        import jax

        apply = jax.jit(optimizer.stateless_apply)
    for seed, ids in enumerate(ACCUMULATION_IDS):
        values = step_values(ids, seed)
        gradient = make_gradient(kind, ids, values * scale, init.shape)
        if BACKEND == "jax":
            trainable, state_values = apply(
                [v.value for v in optimizer.variables], [gradient], [variable.value]
            )
            for target, value in zip([variable, *optimizer.variables], [*trainable, *state_values]):
                target.assign(value)
        else:
            optimizer.apply([gradient], [variable])
        accumulation.apply_sparse(ids, values)
        assert_rows_match_reference(optimizer.inner_optimizer, variable, reference)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit of stateless_apply is JAX's path")
@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_row_accumulation_under_jax_jit(kind):
    import jax

    steps = 3
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, gradient_accumulation_steps=steps, **NEW_OPTIONS
    )
    optimizer.build([variable])
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    accumulation = KerasAccumulation(reference, steps)
    apply = jax.jit(optimizer.stateless_apply)
    for seed, ids in enumerate(ACCUMULATION_IDS):
        values = step_values(ids, seed)
        gradient = make_gradient(kind, ids, values, init.shape)
        trainable, state_values = apply(
            [v.value for v in optimizer.variables], [gradient], [variable.value]
        )
        for target, value in zip([variable, *optimizer.variables], [*trainable, *state_values]):
            target.assign(value)
        accumulation.apply_sparse(ids, values)
        assert_rows_match_reference(optimizer, variable, reference)


# --------------------------------------------------------------------------- state


def test_window_slot_only_with_lazy_accumulation():
    def window_slots(**kwargs):
        optimizer = kto.EmbeddingAdam(**kwargs)
        optimizer.build([keras.Variable(initial_table(), name="table")])
        return [v for v in optimizer.variables if v.name.endswith("accumulation_window")]

    (window,) = window_slots(gradient_accumulation_steps=2)
    assert (
        tuple(window.shape) == (ROWS,) and keras.backend.standardize_dtype(window.dtype) == "int32"
    )
    assert window_slots() == []
    assert window_slots(gradient_accumulation_steps=2, lazy_adam=False) == []


def _fresh(steps, options, init):
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, gradient_accumulation_steps=steps, **options)
    optimizer.build([variable])
    return optimizer, variable


def _state(optimizer, variable):
    return [to_numpy(variable)] + [ops.convert_to_numpy(v) for v in optimizer.variables]


def _without_window(store):
    """A saved store as a version without the `accumulation_window` slot wrote it."""
    signature = _saving.decode(store[_saving.STATE_SIGNATURE_KEY])
    keep = [
        i
        for i, entry in enumerate(signature["variables"])
        if entry["role"] != "accumulation_window"
    ]
    old = {str(new): store[str(i)] for new, i in enumerate(keep)}
    signature["variables"] = [signature["variables"][i] for i in keep]
    old[_saving.STATE_SIGNATURE_KEY] = _saving.encode(json.loads(json.dumps(signature)))
    return old


@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("stop", [5, 6, 7])  # mid-window (N=4: 2nd, 3rd and last micro-batch next)
@pytest.mark.parametrize("saved_by", ["this_version", "without_window"])
def test_save_mid_window_and_resume_continues_exactly(saved_by, stop, kind):
    steps, options = 4, NEW_OPTIONS
    init = initial_table()
    gradients = [(ids, step_values(ids, seed)) for seed, ids in enumerate(ACCUMULATION_IDS)]
    uninterrupted, variable = _fresh(steps, options, init)
    for ids, values in gradients:
        uninterrupted.apply([make_gradient(kind, ids, values, init.shape)], [variable])
    expected = _state(uninterrupted, variable)

    first, variable = _fresh(steps, options, init)
    for ids, values in gradients[:stop]:
        first.apply([make_gradient(kind, ids, values, init.shape)], [variable])
    store = {}
    first.save_own_variables(store)
    if saved_by == "without_window":
        store = _without_window(store)
    resumed, resumed_variable = _fresh(steps, options, to_numpy(variable))
    resumed.load_own_variables(store)
    for ids, values in gradients[stop:]:
        resumed.apply([make_gradient(kind, ids, values, init.shape)], [resumed_variable])
    for got, want in zip(_state(resumed, resumed_variable), expected):
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- cost


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="JAX keeps Keras's stateless dense accumulation (dense gradients are "
    "table-sized anyway); only TF IndexedSlices and torch sparse tensors accumulate by rows",
)
@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_sparse_micro_steps_never_read_untouched_accumulator_rows(mode):
    """An untouched accumulator row holding NaN stays NaN and reaches nothing.

    Keras's dense accumulation reads and writes every row: it would add the
    NaN into the mean, update the row (a NaN row counts as touched) and zero
    it at the update step.
    """
    if mode != "eager" and BACKEND != "tensorflow":
        pytest.skip("tf.function and jit_compile are TensorFlow's graph paths")
    init = initial_table()
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.05, gradient_accumulation_steps=3)
    optimizer.build([variable])
    (accumulator,) = _private.gradient_accumulators(optimizer)
    untouched = 3
    poisoned = np.zeros((ROWS, DIM), np.float32)
    poisoned[untouched] = np.nan
    accumulator.assign(poisoned)
    ids_list = [[0, 1, 1], [2, 4], [5, 0], [8, 7, 7], [6], [1, 2]]  # never row 3
    for seed, ids in enumerate(ids_list):
        _apply(
            optimizer,
            make_gradient("sparse", ids, step_values(ids, seed), init.shape),
            variable,
            mode,
        )
    acc = to_numpy(accumulator)
    assert np.isnan(acc[untouched]).all()
    assert (
        np.isfinite(np.delete(acc, untouched, axis=0)).all()
        and not np.delete(acc, untouched, axis=0).any()
    )
    weights = to_numpy(variable)
    assert np.isfinite(weights).all()
    np.testing.assert_array_equal(weights[untouched], init[untouched])
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 2


@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("rank", [1, 3])
def test_row_accumulation_of_other_ranks(rank, kind, mode):
    """A rank-1 table's rows are elements; a rank-3 table's rows are matrices."""
    if mode == "xla" and (BACKEND != "tensorflow" or kind == "dense"):
        pytest.skip("jit_compile is TensorFlow's XLA path (run with its IndexedSlices)")
    shape = (ROWS,) if rank == 1 else (ROWS, 2, DIM)
    steps = 2
    init = initial_table(shape)
    variable = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        learning_rate=0.05, gradient_accumulation_steps=steps, **NEW_OPTIONS
    )
    reference = NumpyEmbeddingAdam(init, learning_rate=0.05, **NEW_OPTIONS)
    accumulation = KerasAccumulation(reference, steps)
    for seed, ids in enumerate(ACCUMULATION_IDS[:8]):
        values = step_values(ids, seed, shape[1:])
        _apply(optimizer, make_gradient(kind, ids, values, shape), variable, mode)
        accumulation.apply_sparse(ids, values)
        assert_rows_match_reference(optimizer, variable, reference)
