"""Stochastic rounding (`keras_tpu_optim/_math/stochastic_rounding.py`, `Adafactor(stochastic_rounding=True)`).

The rounding is compared bit for bit with a numpy implementation written here
from the contract (docs/algorithms.md#stochastic-rounding) in uint32/uint64
arithmetic, not from the package's int32 code: every backend matching it means
TF, JAX and torch give the same bits. Then its statistics (every result a
neighbour, unbiased over seeds), and the optimizer option: a bf16 model tracks
its float32 run closer than with round-to-nearest, and a resumed run is exact.
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_tpu_optim as kto
from keras_tpu_optim._math import stochastic_rounding

BACKEND = keras.backend.backend()

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

NUMPY_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype("float16")}
MASK = 0xFFFFFFFF

# --------------------------------------------------------------------------- numpy reference


def _fmix(h):
    h = np.asarray(h, np.uint64) & MASK
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK
    h ^= h >> 16
    return h


def reference_bits(shape, seed, step, variable_index, rows=None):
    """The contract's hash in unsigned arithmetic: fmix32 rounds keyed by seed, step, variable, then the
    element's row (its index along axis 0, or `rows`), then half a round for its place in the row."""
    key = _fmix(seed)
    key = _fmix(key ^ ((step + 0x68E31DA4) & MASK))
    key = _fmix(key ^ ((variable_index + 0x1B56C4E9) & MASK))
    shape = tuple(shape)
    full = shape or (1,)
    row = np.arange(full[0], dtype=np.uint64) if rows is None else np.asarray(rows, np.uint64)
    column = np.arange(int(np.prod(full[1:])), dtype=np.uint64)
    row_key = _fmix((row * 0x9E3779B9 + key) & MASK)
    h = (row_key[:, None] + ((column * 0x5BD1E995) & MASK)[None, :]) & MASK
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & MASK
    return (h ^ (h >> 16)).astype(np.uint32).reshape(shape)


def reference_round(x, dtype, seed, step, variable_index):
    """Round float32 `x` away from zero iff the random draw falls below the fraction cut off."""
    x = np.asarray(x, np.float32)
    bits = reference_bits(x.shape, seed, step, variable_index)
    pattern = x.view(np.uint32)
    sign = pattern & np.uint32(0x80000000)
    magnitude = pattern & np.uint32(0x7FFFFFFF)
    dropped = 16 if dtype == "bfloat16" else 13
    low = magnitude & np.uint32((1 << dropped) - 1)
    draw = bits & np.uint32((1 << dropped) - 1)
    away = (low != 0) & (draw.astype(np.uint64) + low >= (1 << dropped))
    truncated = (magnitude >> dropped) << dropped
    rounded = (
        (sign | (truncated + (away.astype(np.uint32) << dropped)))
        .astype(np.uint32)
        .view(np.float32)
    )
    if dtype == "float16":
        # Below 2^-14 the float16 grid is the multiples of 2^-24: up with probability frac(|x| * 2^24).
        scaled = np.abs(x).astype(np.float64) * 2.0**24
        uniform = (bits & 0xFFFFFF).astype(np.float64) / 2.0**24
        tiny = (np.floor(scaled) + (uniform < scaled - np.floor(scaled))) / 2.0**24
        rounded = np.where(np.abs(x) < 2.0**-14, np.copysign(tiny, x).astype(np.float32), rounded)
    rounded = np.where(np.isfinite(x), rounded, x)
    return rounded.astype(NUMPY_DTYPES[dtype])


def neighbours(x, dtype):
    """The largest `dtype` value <= x and the smallest >= x (from round-to-nearest and its two bit neighbours)."""
    x = np.asarray(x, np.float32)
    nearest = x.astype(NUMPY_DTYPES[dtype])
    codes = nearest.view(np.uint16).astype(np.int64)
    candidates = [
        np.asarray((codes + d) & 0xFFFF, np.uint16).view(NUMPY_DTYPES[dtype]).astype(np.float64)
        for d in (-1, 0, 1)
    ]
    candidates += [np.zeros_like(candidates[0])]  # across zero, -0/+0
    stack = np.stack(
        candidates
    )  # NaN candidates (bit neighbours of inf) compare False: never chosen
    below = np.where(stack <= x, stack, -np.inf).max(axis=0)
    above = np.where(stack >= x, stack, np.inf).min(axis=0)
    return below, above


def sample_values(n=4000, seed=0, with_specials=True):
    """float32 values across magnitudes and signs, some exactly representable, some in float16's subnormal range."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 10.0 ** rng.uniform(-9, 4, size=n)
    x[:50] = np.round(x[:50])  # small integers: exact in both dtypes
    x[50:100] = rng.uniform(-(2.0**-14), 2.0**-14, size=50)  # float16 subnormal range
    x = x.astype(np.float32)
    x = x[np.abs(x) > 2.0**-100]  # no float32 subnormals (some backends flush them)
    if with_specials:
        x = np.concatenate(
            [x, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -3.0], np.float32)]
        )
    return x


def round_on_backend(x, dtype, seed, step, variable_index):
    result = stochastic_rounding.stochastic_round(
        ops.convert_to_tensor(x), dtype, seed=seed, step=step, variable_index=variable_index
    )
    return ops.convert_to_numpy(ops.cast(result, "float32")).astype(np.float32)


# --------------------------------------------------------------------------- the function


@pytest.mark.parametrize(
    "shape, seed, step, variable_index",
    [
        ((), 0, 1, 0),
        ((7,), 1, 2, 3),
        ((3, 5, 4), 12345, 1000, 17),
        ((2, 300), 2**31 - 1, 2**31 - 1, 2**20),
    ],
)
def test_random_bits_match_the_unsigned_hash(shape, seed, step, variable_index):
    bits = stochastic_rounding.random_bits(shape, seed, ops.convert_to_tensor(step), variable_index)
    got = ops.convert_to_numpy(bits).astype(np.int64) & MASK
    np.testing.assert_array_equal(got, reference_bits(shape, seed, step, variable_index))
    if got.size > 100:  # A hash, not a counter: the bits look uniform.
        assert abs(np.mean(got / 2.0**32) - 0.5) < 0.05
        assert abs(np.mean(got & 1) - 0.5) < 0.1


def test_random_bits_of_given_rows_are_those_rows_of_the_whole():
    """A table's looked-up rows (`rows`) and a block of rows (`first_row`) draw the bits of those rows."""
    step = ops.convert_to_tensor(3)
    rows = np.array([5, 0, 2**20, 5], np.int32)
    got = stochastic_rounding.random_bits((4, 2, 3), 7, step, 2, rows=ops.convert_to_tensor(rows))
    want = reference_bits((4, 2, 3), 7, 3, 2, rows=rows)
    np.testing.assert_array_equal(ops.convert_to_numpy(got).astype(np.int64) & MASK, want)
    block = stochastic_rounding.random_bits((2, 6), 7, step, 2, first_row=4)
    want = reference_bits((2, 6), 7, 3, 2, rows=np.arange(4, 6))
    np.testing.assert_array_equal(ops.convert_to_numpy(block).astype(np.int64) & MASK, want)


def test_every_element_draws_afresh_under_every_key():
    """No element index whose bits ignore the key (a cancellation in the hash would do that)."""
    draws = np.stack(
        [
            np.concatenate(
                [reference_bits((64,), seed, 1, 0), reference_bits((8, 8), seed, 1, 1).ravel()]
            )
            for seed in range(64)
        ]
    )
    assert len(np.unique(draws)) == draws.size
    low = (draws & 0xFFFF) / 2.0**16
    assert np.all(np.abs(low.mean(axis=0) - 0.5) < 0.25)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rounding_is_bitwise_the_numpy_reference(dtype):
    """Identical bits to numpy on this backend; so TF, JAX and torch give identical bits."""
    x = sample_values()
    if dtype == "float16":
        x = x[~(np.abs(x) > 65504)]  # beyond float16's range both may round to inf
    for seed, step, variable_index in [(0, 1, 0), (7, 3, 2), (123456789, 100001, 41)]:
        got = round_on_backend(x, dtype, seed, step, variable_index)
        want = reference_round(x, dtype, seed, step, variable_index).astype(np.float32)
        # NaN stays NaN (its sign and payload are the framework's cast's); every other value bit for bit.
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        number = ~np.isnan(want)
        np.testing.assert_array_equal(
            got[number].view(np.uint32), want[number].view(np.uint32), err_msg=f"{seed}"
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_result_is_one_of_the_two_neighbours(dtype):
    x = sample_values(seed=1, with_specials=False)
    x = x[np.abs(x) < 60000]
    below, above = neighbours(x, dtype)
    assert np.all(below <= x) and np.all(x <= above)
    for seed in range(3):
        got = round_on_backend(x, dtype, seed, 5, 1).astype(np.float64)
        assert np.all((got == below) | (got == above)), x[(got != below) & (got != above)][:5]
        exact = below == above
        np.testing.assert_array_equal(got[exact], x[exact])
    # Both neighbours do occur (not round-to-nearest in disguise).
    inexact = below != above
    assert np.any(got[inexact] == below[inexact]) and np.any(got[inexact] == above[inexact])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mean_over_seeds_is_the_float32_value(dtype):
    """Each rounding is a Bernoulli draw between the neighbours: the mean of n draws is within
    6 standard errors, `6 * (above - below) / (2 sqrt(n))`, of x; round-to-nearest is not.
    The n draws of a value: 20 seeds times 20 copies of it at other element indices."""
    rng = np.random.default_rng(3)
    base = rng.uniform(1.0, 2.0, size=32).astype(np.float32)
    x = np.concatenate([base, -base / 3, base * 2.0**-20]).astype(
        np.float32
    )  # the last in fp16's subnormals
    below, above = neighbours(x, dtype)
    seeds, copies = 20, 20
    n = seeds * copies
    total = np.zeros(x.shape, np.float64)
    for seed in range(seeds):
        total += round_on_backend(np.tile(x, (copies, 1)), dtype, seed, 1, 0).sum(axis=0)
    mean = total / n
    bound = 6 * (above - below) / (2 * np.sqrt(n))
    assert np.all(np.abs(mean - x) <= bound + 1e-12), np.max(np.abs(mean - x) / (above - below))
    nearest = x.astype(NUMPY_DTYPES[dtype]).astype(np.float64)
    assert np.mean(np.abs(nearest - x) > bound) > 0.5  # the bound does tell the two apart


# --------------------------------------------------------------------------- the option


def _regression_problem(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(64, 16)).astype(np.float32)
    true_weights = rng.normal(size=(16, 8)).astype(np.float32)
    targets = inputs @ true_weights
    start = (true_weights + rng.normal(size=(16, 8)) * 0.5).astype(np.float32)
    return inputs, targets, start


def _train(dtype, steps, optimizer, weight=None):
    """Least squares on a (16, 8) weight of `dtype` (new, or `weight`), gradients in float32; returns the variable."""
    inputs, targets, init = _regression_problem()
    weight = keras.Variable(init, dtype=dtype, name="w") if weight is None else weight
    x, y = ops.convert_to_tensor(inputs), ops.convert_to_tensor(targets)
    for _ in range(steps):
        w = ops.cast(weight, "float32")
        grad = ops.matmul(ops.transpose(x), ops.matmul(x, w) - y) / 64.0
        optimizer.apply([ops.cast(grad, dtype)], [weight])
    return weight


def _values(variable):
    return ops.convert_to_numpy(ops.cast(variable, "float32")).astype(np.float64)


def test_bf16_training_tracks_float32_closer_than_round_to_nearest():
    """Measured (TF, JAX and torch alike; 150 steps, lr 1e-3, the float32 weights move by RMS 0.158): the
    bf16 weights' RMS distance from the float32 run is 0.131 rounding to nearest (updates below half
    a bf16 unit are lost) and 0.020 rounding stochastically."""
    steps = 150
    kwargs = dict(learning_rate=1e-3, relative_step=False)
    reference = _values(_train("float32", steps, kto.Adafactor(**kwargs)))
    nearest = _values(_train("bfloat16", steps, kto.Adafactor(**kwargs)))
    stochastic = _values(
        _train("bfloat16", steps, kto.Adafactor(stochastic_rounding=True, seed=1, **kwargs))
    )
    start = _regression_problem()[2]
    moved = np.sqrt(np.mean((reference - start) ** 2))
    gap_nearest = np.sqrt(np.mean((nearest - reference) ** 2))
    gap_stochastic = np.sqrt(np.mean((stochastic - reference) ** 2))
    print(
        f"moved {moved:.4f}, round-to-nearest gap {gap_nearest:.4f}, stochastic gap {gap_stochastic:.4f}"
    )
    assert gap_stochastic < 0.5 * gap_nearest
    assert gap_stochastic < 0.2 * moved


def test_float32_variables_are_unaffected():
    kwargs = dict(learning_rate=1e-2)
    plain = _values(_train("float32", 5, kto.Adafactor(**kwargs)))
    rounded = _values(_train("float32", 5, kto.Adafactor(stochastic_rounding=True, **kwargs)))
    np.testing.assert_array_equal(plain, rounded)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_seed_changes_the_rounding_and_the_same_seed_repeats_it(dtype):
    kwargs = dict(learning_rate=1e-3, relative_step=False, stochastic_rounding=True)
    a = _values(_train(dtype, 4, kto.Adafactor(seed=5, **kwargs)))
    b = _values(_train(dtype, 4, kto.Adafactor(seed=5, **kwargs)))
    c = _values(_train(dtype, 4, kto.Adafactor(seed=6, **kwargs)))
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)


def test_resumed_run_is_bit_exact():
    """Three steps, the optimizer saved (config and variables) and restored into a new one, three more
    steps: the same bits as six uninterrupted steps (the step and seed key the random bits)."""
    kwargs = dict(
        learning_rate=1e-3,
        relative_step=False,
        stochastic_rounding=True,
        seed=11,
        beta_1=0.9,
        momentum_dtype="bfloat16",
    )
    straight = _values(_train("bfloat16", 6, kto.Adafactor(**kwargs)))
    first = kto.Adafactor(**kwargs)
    weight = _train("bfloat16", 3, first)
    store = {}
    first.save_own_variables(store)
    second = kto.Adafactor.from_config(first.get_config())
    second.build([weight])
    second.load_own_variables(store)
    resumed = _values(_train("bfloat16", 3, second, weight=weight))
    np.testing.assert_array_equal(resumed, straight)


# --------------------------------------------------------------------------- compiled and sharded

SR_KWARGS = dict(learning_rate=1e-3, relative_step=False, stochastic_rounding=True, seed=3)


@pytest.mark.skipif(
    BACKEND != "jax", reason=f"jax.jit needs the JAX backend; this run is {BACKEND}"
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_jit_stateless_apply_gives_the_eager_bits(dtype):
    import jax

    eager = _values(_train(dtype, 4, kto.Adafactor(**SR_KWARGS)))
    inputs, targets, init = _regression_problem()
    optimizer = kto.Adafactor(**SR_KWARGS)
    weight = keras.Variable(init, dtype=dtype, name="w")
    optimizer.build([weight])
    optimizer_values = [v.value for v in optimizer.variables]
    (w,) = [weight.value]
    step = jax.jit(optimizer.stateless_apply)
    for _ in range(4):
        grad = inputs.T @ (inputs @ np.asarray(w, np.float32) - targets) / 64.0
        (w,), optimizer_values = step(optimizer_values, [ops.cast(grad, dtype)], [w])
    assert step._cache_size() == 1, "retraced: the step must be a traced value"
    np.testing.assert_array_equal(np.asarray(w, np.float64), eager)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason=f"jit_compile needs the TF backend; this run is {BACKEND}"
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tf_jit_compile_gives_the_eager_bits(dtype):
    import tensorflow as tf

    eager = _values(_train(dtype, 4, kto.Adafactor(**SR_KWARGS)))
    inputs, targets, init = _regression_problem()
    optimizer = kto.Adafactor(**SR_KWARGS)
    weight = keras.Variable(init, dtype=dtype, name="w")
    optimizer.build([weight])

    @tf.function(jit_compile=True)
    def train_step():
        w = tf.cast(weight.value, tf.float32)
        grad = tf.matmul(inputs, tf.matmul(inputs, w) - targets, transpose_a=True) / 64.0
        optimizer.apply([tf.cast(grad, dtype)], [weight])

    for _ in range(4):
        train_step()
    np.testing.assert_array_equal(_values(weight), eager)


def test_jax_sharded_variable_gives_the_single_device_bits():
    """Under `keras.distribution.ModelParallel` (8 virtual CPU devices) the element index is the
    global one: the same bits as on one device."""
    if BACKEND != "jax":
        pytest.skip(f"keras.distribution runs on the JAX backend; this run is {BACKEND}")
    if len(keras.distribution.list_devices()) < 8:
        pytest.skip("needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    single = _values(_train("bfloat16", 3, kto.Adafactor(**SR_KWARGS)))
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["w"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        weight = _train("bfloat16", 3, kto.Adafactor(**SR_KWARGS))
        assert tuple(weight.value.sharding.spec) == (None, "model")
        np.testing.assert_array_equal(_values(weight), single)
    finally:
        keras.distribution.set_distribution(None)


# --------------------------------------------------------------------------- EmbeddingAdam


def _embedding_adam_gradient(rows, dim, touched, seed, sparse):
    values = np.random.default_rng(seed).normal(size=(len(touched), dim)).astype(np.float32)
    if not sparse:
        dense = np.zeros((rows, dim), np.float32)
        np.add.at(dense, touched, values)
        return ops.convert_to_tensor(dense)
    from test_bad_input import _sparse_gradient

    return _sparse_gradient(touched, values, (rows, dim))


EMBEDDING_ADAM_CASES = {
    "lazy_dense": dict(options={}, sparse=False),
    "lazy_sparse": dict(options={}, sparse=True),
    "not_lazy_rowwise": dict(options=dict(lazy_adam=False, second_moment="rowwise"), sparse=True),
}


@pytest.mark.parametrize("case", list(EMBEDDING_ADAM_CASES))
def test_embedding_adam_stores_its_float32_step_rounded_as_the_reference(case):
    """A bf16 table with bf16 `momenta` and `velocities`, stepped with `stochastic_rounding=True`: each of them
    holds the float32 result of the same step (a float32 twin started from the same values) rounded by the
    numpy reference, keyed by the step, `3 * table index + (0, 1, 2)` and each element's index in its variable
    (rows not touched keep their bits). Two tables, two steps; the same on every backend's gradient kind."""
    options, sparse = EMBEDDING_ADAM_CASES[case]["options"], EMBEDDING_ADAM_CASES[case]["sparse"]
    rows, dim, seed = 40, 6, 11
    rng = np.random.default_rng(0)
    tables = [rng.normal(size=(rows, dim)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    half = [keras.Variable(t, dtype="bfloat16", name=f"t{i}") for i, t in enumerate(tables)]
    full = [keras.Variable(t.astype(np.float32), name=f"t{i}") for i, t in enumerate(tables)]
    kwargs = dict(learning_rate=0.01, **options)
    rounded = kto.EmbeddingAdam(
        momentum_dtype="bfloat16",
        velocity_dtype="bfloat16",
        stochastic_rounding=True,
        seed=seed,
        **kwargs,
    )
    twin = kto.EmbeddingAdam(**kwargs)
    rounded.build(half)
    twin.build(full)
    touched = [[3, 7, 7, 20], [0, 39, 5]]
    for step in range(2):
        for source, target in zip(rounded.variables, twin.variables):  # the twin starts where it is
            target.assign(ops.cast(source, target.dtype))
        for variable, twin_variable in zip(half, full):
            twin_variable.assign(ops.cast(variable, "float32"))
        grads = [
            _embedding_adam_gradient(rows, dim, ids, 10 * step + i, sparse)
            for i, ids in enumerate(touched)
        ]
        rounded.apply(grads, half)
        twin.apply(grads, full)
        for index, (variable, twin_variable) in enumerate(zip(half, full)):
            stored = [variable] + list(rounded._state_of(variable).slots[:2])
            exact = [twin_variable] + list(twin._state_of(twin_variable).slots[:2])
            for stream, (got, want) in enumerate(zip(stored, exact)):
                want = reference_round(
                    ops.convert_to_numpy(want), "bfloat16", seed, step, 3 * index + stream
                )
                np.testing.assert_array_equal(
                    ops.convert_to_numpy(ops.cast(got, "float32")),
                    want.astype(np.float32),
                    err_msg=f"step {step}, table {index}, stream {stream}",
                )
