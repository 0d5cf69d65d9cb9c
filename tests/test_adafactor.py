"""keras_tpu_optim.Adafactor against independent references, on the backend KERAS_BACKEND selects.

References: `keras.optimizers.Adafactor` wherever its behaviour and ours coincide
(default arguments, every base keyword), and `tests/reference/numpy_adafactor.py`,
numpy written from docs/algorithms.md#adafactor, for everything Keras lacks. Nothing here compares
the optimizer with its own output.
"""

from __future__ import annotations

import math

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_tpu_optim as kto
from tests.reference.numpy_adafactor import NumpyAdafactor

BACKEND = keras.backend.backend()

# Keras's own numpy conversions on torch trip numpy 2's copy-keyword warning, thousands of times.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

# Rank 0 to 4, with the degenerate 1xN and Nx1 matrices and a rank-3 variable; the
# tall ones (>= 16 rows) take TF's folded column means, 37 rows with a remainder.
SHAPES = [(), (5,), (1, 7), (6, 1), (4, 6), (2, 3, 5), (2, 2, 3, 4), (37, 5), (2, 16, 3)]
SLOT_SUFFIXES = ("_row_second_moment", "_column_second_moment", "_second_moment", "_momentum")


# --------------------------------------------------------------------------- helpers


def make_data(shapes=SHAPES, steps=20, seed=0):
    """Initial values and per-step gradients; gradient scales vary a lot from step to step
    so that the second-moment averages (and gradient clipping) matter."""
    rng = np.random.default_rng(seed)
    inits = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = []
    for _ in range(steps):
        scale = 10.0 ** rng.uniform(-1.5, 1.5)
        grads.append([(scale * rng.normal(size=s)).astype("float32") for s in shapes])
    return inits, grads


def numpy_dtype(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def to_float64(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), dtype=np.float64)


def make_variables(inits, dtype="float32", names=None):
    names = names or [f"w{i}" for i in range(len(inits))]
    return [keras.Variable(x, dtype=dtype, name=name) for x, name in zip(inits, names)]


def to_tensors(grads, dtype="float32"):
    return [ops.cast(ops.convert_to_tensor(g), dtype) for g in grads]


def run_keras(optimizer, inits, grad_steps, dtype="float32", names=None):
    """Apply `optimizer` step by step; returns (variables, per-step float64 values)."""
    variables = make_variables(inits, dtype, names)
    history = []
    for grads in grad_steps:
        optimizer.apply(to_tensors(grads, dtype), variables)
        history.append([to_float64(v) for v in variables])
    return variables, history


def run_numpy(reference, inits, grad_steps, dtype="float32", names=None):
    """The numpy reference on the same data, variables and gradients rounded to `dtype`."""
    np_dtype = numpy_dtype(dtype)
    names = names or [f"w{i}" for i in range(len(inits))]
    params = [x.astype(np_dtype) for x in inits]
    history = []
    for grads in grad_steps:
        params = reference.step(params, [g.astype(np_dtype) for g in grads], names)
        history.append([p.astype(np.float64) for p in params])
    return history


def assert_histories_close(actual, expected, rtol=1e-4, atol=1e-6):
    assert len(actual) == len(expected)
    for step, (actual_step, expected_step) in enumerate(zip(actual, expected), start=1):
        for i, (a, e) in enumerate(zip(actual_step, expected_step)):
            assert a.shape == e.shape, f"step {step}, variable {i}"
            np.testing.assert_allclose(
                a, e, rtol=rtol, atol=atol, err_msg=f"step {step}, variable {i} of shape {e.shape}"
            )


def assert_moved(history, inits, rtol=1e-3):
    """Guard against vacuous comparisons: the reference's variables did change."""
    for i, (final, init) in enumerate(zip(history[-1], inits)):
        assert not np.allclose(final, init.astype(np.float64), rtol=rtol, atol=0), (
            f"variable {i} never moved"
        )


def assert_histories_differ(a, b, margin=1e-3):
    """Guard: the option under test changes the numbers by far more than the tolerance."""
    gap = max(float(np.max(np.abs(x - y) / (np.abs(y) + 1e-3))) for x, y in zip(a[-1], b[-1]))
    assert gap > margin, f"the option under test barely changes the result (relative gap {gap:.2e})"


def slot_variables(optimizer):
    return [v for v in optimizer.variables if v.name.endswith(SLOT_SUFFIXES)]


# --------------------------------------------------------------------------- default arguments


@pytest.mark.parametrize("learning_rate", [None, 0.3], ids=["default", "lr0.3_capped_after_t11"])
def test_default_arguments_match_keras_adafactor_and_numpy(learning_rate):
    kwargs = {} if learning_rate is None else {"learning_rate": learning_rate}
    inits, grads = make_data()
    _, ours = run_keras(kto.Adafactor(**kwargs), inits, grads)
    _, keras_history = run_keras(keras.optimizers.Adafactor(**kwargs), inits, grads)
    numpy_history = run_numpy(NumpyAdafactor(**kwargs), inits, grads)
    assert_moved(numpy_history, inits)
    assert_histories_close(ours, keras_history)
    assert_histories_close(ours, numpy_history)


# --------------------------------------------------------------------------- options Keras lacks

OPTION_CASES = {
    "relative_step_false": dict(learning_rate=0.5, relative_step=False),
    "beta_1_0.9": dict(learning_rate=0.05, beta_1=0.9),
    "beta_1_0.0": dict(learning_rate=0.05, beta_1=0.0),
    "min_dim_size_to_factor_4": dict(learning_rate=0.05, min_dim_size_to_factor=4),
    "min_dim_size_to_factor_1": dict(learning_rate=0.05, min_dim_size_to_factor=1),
    "no_parameter_scale": dict(learning_rate=0.05, multiply_by_parameter_scale=False),
    "all_options": dict(
        learning_rate=0.2,
        relative_step=False,
        beta_1=0.8,
        min_dim_size_to_factor=3,
        multiply_by_parameter_scale=False,
        beta_2_decay=-0.5,
        epsilon_1=1e-20,
        epsilon_2=1e-2,
        clip_threshold=0.5,
    ),
    "hyperparameters_with_parameter_scale": dict(
        learning_rate=0.2,
        beta_2_decay=-0.6,
        epsilon_2=0.5,
        clip_threshold=2.0,
        min_dim_size_to_factor=2,
    ),
    # big_vision's cap: 1 - t^-0.8 exceeds 0.5 from t = 3 on.
    "beta_2_cap_0.5": dict(learning_rate=0.05, beta_2_cap=0.5),
    "beta_2_cap_with_options": dict(
        learning_rate=0.2, beta_2_cap=0.7, beta_1=0.5, min_dim_size_to_factor=3
    ),
    # Floored at t = 1 until the offset is passed (10 steps: 7 of them past it).
    "decay_offset_3": dict(learning_rate=0.05, decay_offset=3),
}

# The same runs with the option switched back to Keras's behaviour: each option must matter.
OPTION_BASELINES = {
    "relative_step_false": dict(learning_rate=0.5),
    "beta_1_0.9": dict(learning_rate=0.05),
    "beta_1_0.0": None,  # beta_1=0 is the identity on the update: equal to no momentum
    "min_dim_size_to_factor_4": dict(learning_rate=0.05),
    "min_dim_size_to_factor_1": None,  # every matrix is factored, as by default
    "no_parameter_scale": dict(learning_rate=0.05),
    "all_options": dict(learning_rate=0.2),
    "hyperparameters_with_parameter_scale": dict(learning_rate=0.2),
    "beta_2_cap_0.5": dict(learning_rate=0.05),
    "beta_2_cap_with_options": dict(learning_rate=0.2, beta_1=0.5, min_dim_size_to_factor=3),
    "decay_offset_3": dict(learning_rate=0.05),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_numpy_reference(case):
    kwargs = OPTION_CASES[case]
    inits, grads = make_data(steps=10, seed=1)
    _, ours = run_keras(kto.Adafactor(**kwargs), inits, grads)
    expected = run_numpy(NumpyAdafactor(**kwargs), inits, grads)
    assert_moved(expected, inits)
    assert_histories_close(ours, expected)
    baseline = OPTION_BASELINES[case]
    if baseline is not None:
        assert_histories_differ(expected, run_numpy(NumpyAdafactor(**baseline), inits, grads))


# --------------------------------------------------------------------------- against optax

# Rank 2 to 4 with the two largest axes not the last two (and ties: optax's argsort
# puts the later of equal axes last), a vector, a matrix too small to factor at
# min_dim_size_to_factor=3, and a plain last-two matrix.
OPTAX_SHAPES = [
    (8, 3),
    (7, 2, 5),
    (5, 3, 8),
    (6, 6, 2),
    (2, 9, 3, 4),
    (3, 5, 5, 2),
    (5,),
    (9, 2, 1),
    (3, 4),
]
OPTAX_CASES = {
    "two_largest": dict(factored_dims="two_largest"),
    "two_largest_decay_offset": dict(factored_dims="two_largest", decay_offset=4),
    "two_largest_bf16_momentum": dict(
        factored_dims="two_largest", beta_1=0.9, momentum_dtype="bfloat16"
    ),
    "two_largest_decay_offset_momentum": dict(
        factored_dims="two_largest", decay_offset=2, beta_1=0.8
    ),
}


def _optax_adafactor(kwargs, learning_rate):
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    return optax.adafactor(
        learning_rate=learning_rate,
        min_dim_size_to_factor=3,
        decay_rate=0.8,
        decay_offset=kwargs.get("decay_offset", 0),
        multiply_by_parameter_scale=True,
        clipping_threshold=1.0,
        momentum=kwargs.get("beta_1"),
        dtype_momentum=jnp.bfloat16 if kwargs.get("momentum_dtype") == "bfloat16" else jnp.float32,
        eps=1e-30,
        factored=True,
    )


@pytest.mark.parametrize("case", list(OPTAX_CASES))
def test_factored_dims_decay_offset_momentum_dtype_match_optax(case):
    """`optax.adafactor` (`scale_by_factored_rms`, `ema`) with the same settings: parameters, statistics
    (values and shapes), momentum (values and dtype).

    optax counts steps from its state's `count`; both start at iterations 6, so
    that a `decay_offset` of 4 is passed as optax expects (before it, optax's
    schedule is not finite).
    """
    import jax.numpy as jnp

    kwargs = OPTAX_CASES[case]
    learning_rate, start = 0.05, 6
    # A bfloat16 momentum (up to ~0.3 here, unfactored) is stored to 2^-9 relative: a
    # rounding that falls the other way than optax's moves a parameter by up to ~1e-3, once a step.
    atol = 5e-3 if kwargs.get("momentum_dtype") == "bfloat16" else 1e-6
    inits, grads = make_data(OPTAX_SHAPES, steps=8, seed=11)
    tx = _optax_adafactor(kwargs, learning_rate)
    params = [jnp.asarray(x) for x in inits]
    state = tx.init(params)
    state = (state[0]._replace(count=jnp.asarray(start, jnp.int32)), *state[1:])
    optimizer = kto.Adafactor(
        learning_rate=learning_rate, relative_step=False, min_dim_size_to_factor=3, **kwargs
    )
    variables = make_variables(inits)
    optimizer.build(variables)
    optimizer.iterations.assign(start)
    import jax

    update = jax.jit(tx.update)  # the reference compiled once, not op by op for each of 9 shapes
    for step, step_grads in enumerate(grads, start=1):
        updates, state = update([jnp.asarray(g) for g in step_grads], state, params)
        params = [p + u for p, u in zip(params, updates)]
        optimizer.apply(to_tensors(step_grads), variables)
        for i, (ours, theirs) in enumerate(zip(variables, params)):
            np.testing.assert_allclose(
                to_float64(ours),
                np.asarray(theirs, np.float64),
                rtol=2e-4,
                atol=atol,
                err_msg=f"step {step}, variable {i} of shape {OPTAX_SHAPES[i]}",
            )
    assert_moved([[np.asarray(p, np.float64) for p in params]], inits)
    factored = state[0]
    for i, variable in enumerate(variables):
        slots = optimizer._state_of(variable).slots
        if len(slots) == 2:
            expected = (factored.v_row[i], factored.v_col[i])
        else:
            expected = (factored.v[i],)
            assert factored.v_row[i].shape == (1,), f"optax factors variable {i}; we do not"
        for slot, want in zip(slots, expected):
            assert tuple(slot.shape) == want.shape, f"variable {i} of shape {OPTAX_SHAPES[i]}"
            np.testing.assert_allclose(
                to_float64(slot), np.asarray(want, np.float64), rtol=2e-4, err_msg=f"{i}"
            )
    if "beta_1" in kwargs:
        ema = next(s for s in state if hasattr(s, "ema")).ema
        for i, (variable, want) in enumerate(zip(variables, ema)):
            momentum = optimizer._state_of(variable).momentum
            assert keras.backend.standardize_dtype(momentum.dtype) == kwargs.get(
                "momentum_dtype", "float32"
            )
            assert np.dtype(want.dtype) == numpy_dtype(kwargs.get("momentum_dtype", "float32"))
            np.testing.assert_allclose(
                to_float64(momentum),
                np.asarray(want, np.float64),
                rtol=1e-2,
                atol=atol / 10,
                err_msg=f"momentum {i}",
            )


def test_two_largest_slot_shapes_follow_optax_rule():
    """Which axes are factored, ties and `min_dim_size_to_factor` included, as optax's `_factored_dims`."""
    factorized = pytest.importorskip("optax._src.factorized")
    shapes = [
        (8, 3),
        (3, 8),
        (4, 4),
        (4, 4, 4),
        (8, 4, 8),
        (2, 9, 3, 4),
        (1, 7),
        (2, 2, 3),
        (6, 1, 6),
        (5,),
    ]
    for min_dim in (None, 1, 3, 5):
        optimizer = kto.Adafactor(factored_dims="two_largest", min_dim_size_to_factor=min_dim)
        variables = make_variables([np.zeros(s, "float32") for s in shapes])
        optimizer.build(variables)
        for shape, variable in zip(shapes, variables):
            dims = factorized._factored_dims(shape, True, 0 if min_dim is None else min_dim)
            slots = optimizer._state_of(variable).slots
            if dims is None:
                assert [tuple(s.shape) for s in slots] == [shape], (shape, min_dim)
                continue
            second, largest = dims
            without = lambda axis: tuple(d for i, d in enumerate(shape) if i != axis)  # noqa: E731
            assert [tuple(s.shape) for s in slots] == [without(largest), without(second)], (
                shape,
                min_dim,
            )


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(beta_1=0.9),
        dict(min_dim_size_to_factor=4),
        dict(beta_1=0.5, min_dim_size_to_factor=3),
    ],
    ids=["default", "beta_1", "min_dim_size_to_factor", "both"],
)
def test_slots_are_named_shaped_and_float32(kwargs):
    optimizer = kto.Adafactor(**kwargs)
    inits = make_data(steps=0)[0]
    # Half the variables bfloat16: the statistics are float32 all the same.
    variables = make_variables(inits[::2]) + make_variables(
        inits[1::2], "bfloat16", [f"h{i}" for i in range(3)]
    )
    optimizer.build(variables)
    reference = NumpyAdafactor(**kwargs)
    expected = {}
    for var in variables:
        shape = tuple(var.shape)
        prefix = var.path.replace("/", "_")
        if reference.is_factored(shape):
            expected[prefix + "_row_second_moment"] = shape[:-1]
            expected[prefix + "_column_second_moment"] = shape[:-2] + shape[-1:]
        else:
            expected[prefix + "_second_moment"] = shape
        if "beta_1" in kwargs:
            expected[prefix + "_momentum"] = shape
    slots = slot_variables(optimizer)
    assert {v.name: tuple(v.shape) for v in slots} == expected
    assert len(slots) == len(expected)
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in slots)


def test_no_full_size_second_moment_for_factored_variables():
    optimizer = kto.Adafactor()
    variables = make_variables(make_data(steps=0)[0])
    optimizer.build(variables)
    shapes = [tuple(v.shape) for v in optimizer.variables]
    for var in variables:
        if len(var.shape) >= 2:
            assert tuple(var.shape) not in shapes, (
                f"full-size buffer for {var.path} {tuple(var.shape)}"
            )
    # Only rank < 2 variables keep an element-wise second moment.
    state_size = sum(math.prod(v.shape) for v in slot_variables(optimizer))
    expected = sum(
        math.prod(s) if len(s) < 2 else math.prod(s[:-1]) + math.prod(s[:-2] + s[-1:])
        for s in SHAPES
    )
    assert state_size == expected


# --------------------------------------------------------------------------- base keywords, vs Keras


def compare_with_keras(kwargs, steps=10, seed=2, names=None, setup=None, inits_grads=None):
    """Ours and keras.optimizers.Adafactor with the same keywords on the same data."""
    inits, grads = inits_grads or make_data(steps=steps, seed=seed)
    ours_opt, keras_opt = kto.Adafactor(**kwargs), keras.optimizers.Adafactor(**kwargs)
    if setup is not None:
        setup(ours_opt)
        setup(keras_opt)
    ours_vars, ours = run_keras(ours_opt, inits, grads, names=names)
    keras_vars, keras_history = run_keras(keras_opt, inits, grads, names=names)
    assert_moved(keras_history, inits)
    assert_histories_close(ours, keras_history)
    return (ours_opt, ours_vars, ours), (keras_opt, keras_vars, keras_history)


WD_NAMES = ["w0_scale", "w1_bias", "w2_kernel", "w3_kernel", "w4_kernel", "w5_bias", "w6_kernel"]


def test_weight_decay_with_exclusions_matches_keras_and_numpy():
    kwargs = dict(learning_rate=0.1, weight_decay=0.2)
    (_, _, ours), _ = compare_with_keras(
        kwargs, names=WD_NAMES, setup=lambda opt: opt.exclude_from_weight_decay(var_names=["bias"])
    )
    inits, grads = make_data(steps=10, seed=2)
    reference = NumpyAdafactor(**kwargs, exclude_from_weight_decay=["bias"])
    expected = run_numpy(reference, inits, grads, names=WD_NAMES)
    assert_histories_close(ours, expected)
    # The decay and the exclusion both change the numbers.
    assert_histories_differ(expected, run_numpy(NumpyAdafactor(learning_rate=0.1), inits, grads))
    everything_decayed = run_numpy(NumpyAdafactor(**kwargs), inits, grads, names=WD_NAMES)
    assert_histories_differ(expected, everything_decayed)


def test_weight_decay_with_options_keras_lacks_matches_numpy():
    kwargs = dict(
        learning_rate=0.1,
        weight_decay=0.2,
        relative_step=False,
        beta_1=0.9,
        min_dim_size_to_factor=3,
    )
    inits, grads = make_data(steps=8, seed=3)
    optimizer = kto.Adafactor(**kwargs)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    _, ours = run_keras(optimizer, inits, grads, names=WD_NAMES)
    reference = NumpyAdafactor(**kwargs, exclude_from_weight_decay=["bias"])
    expected = run_numpy(reference, inits, grads, names=WD_NAMES)
    assert_histories_close(ours, expected)


@pytest.mark.parametrize(
    "clip",
    [dict(clipnorm=0.5), dict(clipvalue=0.3), dict(global_clipnorm=1.0)],
    ids=lambda c: next(iter(c)),
)
def test_gradient_clipping_matches_keras(clip):
    kwargs = dict(learning_rate=0.1, **clip)
    _, (_, _, keras_history) = compare_with_keras(kwargs)
    inits, grads = make_data(steps=10, seed=2)
    _, unclipped = run_keras(keras.optimizers.Adafactor(learning_rate=0.1), inits, grads)
    assert_histories_differ(keras_history, unclipped)


def test_ema_with_overwrite_frequency_and_finalize_matches_keras():
    kwargs = dict(learning_rate=0.1, use_ema=True, ema_momentum=0.7, ema_overwrite_frequency=3)
    (ours_opt, ours_vars, _), (keras_opt, keras_vars, keras_history) = compare_with_keras(
        kwargs, steps=7
    )
    ours_opt.finalize_variable_values(ours_vars)
    keras_opt.finalize_variable_values(keras_vars)
    final_ours = [to_float64(v) for v in ours_vars]
    final_keras = [to_float64(v) for v in keras_vars]
    assert_histories_close([final_ours], [final_keras])
    # finalize swapped in the moving average, which differs from the last weights.
    assert_histories_differ([final_keras], [keras_history[-1]])


def test_gradient_accumulation_equals_one_step_on_the_mean():
    steps = 3
    inits, micro_grads = make_data(steps=2 * steps, seed=4)
    _, ours = run_keras(
        kto.Adafactor(learning_rate=0.1, gradient_accumulation_steps=steps), inits, micro_grads
    )
    mean_grads = [
        [
            np.mean([micro_grads[k][i] for k in range(s, s + steps)], axis=0)
            for i in range(len(inits))
        ]
        for s in range(0, 2 * steps, steps)
    ]
    expected = run_numpy(NumpyAdafactor(learning_rate=0.1), inits, mean_grads)
    assert_moved(expected, inits)
    # Nothing moves on the accumulating micro-batches; each k-th one is a full step.
    for micro in range(2 * steps):
        if (micro + 1) % steps:
            previous = [x.astype(np.float64) for x in inits] if micro == 0 else ours[micro - 1]
            assert_histories_close([ours[micro]], [previous], rtol=0, atol=0)
        else:
            assert_histories_close([ours[micro]], [expected[micro // steps]])


def test_loss_scale_factor_matches_keras_and_numpy():
    scale = 1024.0
    inits, grads = make_data(steps=8, seed=5)
    scaled = [[g * np.float32(scale) for g in step] for step in grads]
    compare_with_keras(
        dict(learning_rate=0.1, loss_scale_factor=scale), inits_grads=(inits, scaled)
    )
    optimizer = kto.Adafactor(learning_rate=0.1, beta_1=0.9, loss_scale_factor=scale)
    assert (
        float(ops.convert_to_numpy(optimizer.scale_loss(ops.convert_to_tensor(2.0)))) == 2.0 * scale
    )
    _, ours = run_keras(optimizer, inits, scaled)
    assert_histories_close(
        ours, run_numpy(NumpyAdafactor(learning_rate=0.1, beta_1=0.9), inits, grads)
    )


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.8, decay_steps=2, decay_rate=0.5)


def _schedule_numpy(iterations):
    return 0.8 * 0.5 ** (iterations / 2)


def test_learning_rate_schedule_matches_keras_and_numpy():
    # The schedule starts above the 1/sqrt(t) cap and falls below it.
    compare_with_keras(dict(learning_rate=_schedule()), steps=10)
    inits, grads = make_data(steps=10, seed=2)
    for relative_step in (True, False):
        _, ours = run_keras(
            kto.Adafactor(learning_rate=_schedule(), relative_step=relative_step), inits, grads
        )
        reference = NumpyAdafactor(learning_rate=_schedule_numpy, relative_step=relative_step)
        expected = run_numpy(reference, inits, grads)
        assert_histories_close(ours, expected)


# --------------------------------------------------------------------------- variable dtypes

DTYPE_TOLERANCES = {
    "float32": dict(rtol=1e-4, atol=1e-6),
    # About one unit in the last place (bf16: 2^-7, fp16: 2^-10 relative), for a
    # float32 sum that lands on the other side of a rounding boundary.
    "bfloat16": dict(rtol=1e-2, atol=1e-2),
    "float16": dict(rtol=2e-3, atol=2e-3),
}


@pytest.mark.parametrize(
    "kwargs",
    [dict(learning_rate=0.1), dict(learning_rate=0.2, beta_1=0.9, min_dim_size_to_factor=4)],
    ids=["default", "options"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_low_precision_variables_match_numpy_and_keep_float32_state(dtype, kwargs):
    inits, grads = make_data(steps=6, seed=6)
    # Zero gradients: with epsilon_1 = 1e-30 the second moment underflows in
    # bf16/fp16 (0 * rsqrt(0) = nan) unless it is kept in float32.
    for step in grads:
        step[1][:2] = 0.0
        step[4][1, :] = 0.0
        step[5][..., 0] = 0.0
    optimizer = kto.Adafactor(**kwargs)
    variables, ours = run_keras(optimizer, inits, grads, dtype=dtype)
    expected = run_numpy(NumpyAdafactor(**kwargs), inits, grads, dtype=dtype)
    assert_moved(expected, inits, rtol=0.02)
    for step in ours:
        assert all(np.all(np.isfinite(v)) for v in step)
    assert_histories_close(ours, expected, **DTYPE_TOLERANCES[dtype])
    assert all(keras.backend.standardize_dtype(v.dtype) == dtype for v in variables)
    slots = slot_variables(optimizer)
    assert slots and all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in slots)


# --------------------------------------------------------------------------- compiled


JIT_KWARGS = [
    dict(learning_rate=0.1),
    dict(learning_rate=0.3, relative_step=False, beta_1=0.9, min_dim_size_to_factor=4),
]


@pytest.mark.skipif(
    BACKEND != "jax",
    reason=f"jax.jit(optimizer.stateless_apply) needs the JAX backend; this run is {BACKEND}",
)
@pytest.mark.parametrize("kwargs", JIT_KWARGS, ids=["default", "options"])
def test_jax_jit_stateless_apply_matches_numpy(kwargs):
    import jax

    inits, grads = make_data(steps=6, seed=7)
    optimizer = kto.Adafactor(**kwargs)
    variables = make_variables(inits)
    optimizer.build(variables)
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [v.value for v in variables]
    step = jax.jit(optimizer.stateless_apply)
    ours = []
    for step_grads in grads:
        trainable_values, optimizer_values = step(
            optimizer_values, to_tensors(step_grads), trainable_values
        )
        ours.append([np.asarray(v, dtype=np.float64) for v in trainable_values])
    assert step._cache_size() == 1, "stateless_apply was retraced"
    expected = run_numpy(NumpyAdafactor(**kwargs), inits, grads)
    assert_moved(expected, inits)
    assert_histories_close(ours, expected)


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason=f"tf.function(jit_compile=True) needs the TensorFlow backend; this run is {BACKEND}",
)
@pytest.mark.parametrize("kwargs", JIT_KWARGS, ids=["default", "options"])
def test_tf_function_jit_compile_matches_numpy(kwargs):
    import tensorflow as tf

    inits, grads = make_data(steps=6, seed=7)
    optimizer = kto.Adafactor(**kwargs)
    variables = make_variables(inits)
    optimizer.build(variables)

    @tf.function(jit_compile=True)
    def train_step(step_grads):
        optimizer.apply(step_grads, variables)

    first = to_tensors(grads[0])
    hlo = train_step.experimental_get_compiler_ir(first)(stage="hlo")
    assert "HloModule" in hlo
    ours = []
    for step_grads in grads:
        train_step(to_tensors(step_grads))
        ours.append([to_float64(v) for v in variables])
    expected = run_numpy(NumpyAdafactor(**kwargs), inits, grads)
    assert_moved(expected, inits)
    assert_histories_close(ours, expected)


# --------------------------------------------------------------------------- memory


def bert_base_like_shapes():
    """The benchmark's BERT-base-like stack: a 32000x768 embedding, then 12 transformer layers."""
    shapes = [(32000, 768)]
    for _ in range(12):
        shapes += [
            (768, 2304),
            (2304,),
            (768, 768),
            (768,),
            (768, 3072),
            (3072,),
            (3072, 768),
            (768,),
        ]
        shapes += [(768,), (768,)]  # layer norm
    return shapes


def test_bert_base_optimizer_state_is_at_most_0_3_percent_of_parameters():
    shapes = bert_base_like_shapes()
    n_params = sum(math.prod(s) for s in shapes)
    assert 109e6 < n_params < 110e6
    # Real float32 variables (440 MB of zeros, freed when the test ends); build only, no step.
    variables = [
        keras.Variable(initializer="zeros", shape=s, dtype="float32", name=f"p{i}")
        for i, s in enumerate(shapes)
    ]
    optimizer = kto.Adafactor()
    optimizer.build(variables)
    state = sum(math.prod(v.shape) for v in optimizer.variables)
    assert state / n_params <= 0.003, f"state/params = {state / n_params:.5f}"
    # Exactly the factored statistics plus the few scalars (iterations, learning rate).
    factored_statistics = sum(s[0] + s[1] if len(s) == 2 else s[0] for s in shapes)
    assert factored_statistics <= state <= factored_statistics + 4
    assert max(math.prod(v.shape) for v in optimizer.variables) <= 32000


# --------------------------------------------------------------------------- serialization

SERIALIZED_KWARGS = dict(
    learning_rate=0.2,
    beta_2_decay=-0.6,
    epsilon_1=1e-25,
    epsilon_2=2e-3,
    clip_threshold=0.8,
    relative_step=False,
    beta_1=0.8,
    min_dim_size_to_factor=3,
    multiply_by_parameter_scale=False,
    decay_offset=1,
    beta_2_cap=0.9,
    weight_decay=0.05,
)


def _check_round_trip(optimizer, kwargs):
    config = optimizer.get_config()
    for key, value in kwargs.items():
        if key != "learning_rate":
            assert config[key] == value, key
    restored = kto.Adafactor.from_config(config)
    assert type(restored) is kto.Adafactor
    assert restored.get_config() == config
    deserialized = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(deserialized) is kto.Adafactor
    assert deserialized.get_config() == config
    return restored, deserialized


def test_config_round_trip_and_deserialized_numbers():
    optimizer = kto.Adafactor(name="my_adafactor", **SERIALIZED_KWARGS)
    assert optimizer.get_config()["learning_rate"] == pytest.approx(0.2)
    assert optimizer.get_config()["name"] == "my_adafactor"
    restored, deserialized = _check_round_trip(optimizer, SERIALIZED_KWARGS)
    inits, grads = make_data(steps=6, seed=8)
    expected = run_numpy(NumpyAdafactor(**SERIALIZED_KWARGS), inits, grads)
    assert_moved(expected, inits)
    for opt in (restored, deserialized):
        _, history = run_keras(opt, inits, grads)
        assert_histories_close(history, expected)


def test_config_round_trip_of_layout_and_rounding_options():
    kwargs = dict(
        factored_dims="two_largest",
        momentum_dtype="bfloat16",
        beta_1=0.9,
        stochastic_rounding=True,
        seed=7,
    )
    for opt in _check_round_trip(kto.Adafactor(**kwargs), kwargs):
        assert opt._options == kto.Adafactor(**kwargs)._options


def test_config_round_trip_with_schedule():
    kwargs = dict(SERIALIZED_KWARGS, learning_rate=_schedule())
    restored, deserialized = _check_round_trip(kto.Adafactor(**kwargs), {})
    inits, grads = make_data(steps=6, seed=8)
    expected = run_numpy(
        NumpyAdafactor(**dict(kwargs, learning_rate=_schedule_numpy)), inits, grads
    )
    for opt in (restored, deserialized):
        assert isinstance(opt._learning_rate, keras.optimizers.schedules.ExponentialDecay)
        _, history = run_keras(opt, inits, grads)
        assert_histories_close(history, expected)


def test_default_config_has_keras_keys_and_defaults():
    ours = kto.Adafactor().get_config()
    theirs = keras.optimizers.Adafactor().get_config()
    for key, value in theirs.items():
        assert key in ours
        if key != "name":  # Both auto-named from "adafactor": "adafactor", then "adafactor_1".
            assert ours[key] == value, key
    assert ours["name"] == "adafactor"
    assert ours["beta_1"] is None
    assert ours["min_dim_size_to_factor"] is None
    assert ours["multiply_by_parameter_scale"] is True
    assert ours["factored_dims"] == "last_two"
    assert ours["decay_offset"] == 0
    assert ours["beta_2_cap"] is None
    assert ours["momentum_dtype"] == "float32"
    assert ours["stochastic_rounding"] is False
    assert ours["seed"] == 0


# --------------------------------------------------------------------------- validation


INVALID_HYPERPARAMETERS = [
    ("beta_2_decay", 0.5),
    ("epsilon_1", 0.0),
    ("epsilon_1", -1e-30),
    ("epsilon_2", -1e-3),
    ("clip_threshold", 0.0),
    ("clip_threshold", -1.0),
    ("beta_1", -0.1),
    ("beta_1", 1.0),
    ("beta_1", 1.5),
    ("min_dim_size_to_factor", 0),
    ("min_dim_size_to_factor", -3),
    ("relative_step", 1),
    ("relative_step", "yes"),
    ("relative_step", None),
    ("multiply_by_parameter_scale", 0),
    ("factored_dims", "largest"),
    ("factored_dims", None),
    ("factored_dims", 2),
    ("decay_offset", -1),
    ("decay_offset", 1.5),
    ("decay_offset", None),
    ("beta_2_cap", -0.1),
    ("beta_2_cap", 1.5),
    ("beta_2_cap", "0.9"),
    ("momentum_dtype", "float16"),
    ("momentum_dtype", None),
    ("stochastic_rounding", 1),
    ("stochastic_rounding", None),
    ("seed", -1),
    ("seed", 2**31),
    ("seed", 1.0),
    ("seed", None),
]


def test_invalid_hyperparameters_raise_value_error_naming_them():
    # One test for all cases: the per-test Keras session reset costs more than the checks.
    for argument, value in INVALID_HYPERPARAMETERS:
        with pytest.raises(ValueError, match=argument):
            kto.Adafactor(**{argument: value})
            pytest.fail(f"Adafactor({argument}={value!r}) did not raise")


def test_boundary_hyperparameters_are_accepted():
    kto.Adafactor(
        beta_1=0.0, epsilon_2=0.0, min_dim_size_to_factor=1, beta_2_decay=-1.0, relative_step=False
    )
    kto.Adafactor(
        beta_2_cap=0.0, decay_offset=0, seed=0, momentum_dtype="float32", factored_dims="last_two"
    )
    kto.Adafactor(
        beta_2_cap=1.0, seed=2**31 - 1, momentum_dtype="bfloat16", stochastic_rounding=True
    )
