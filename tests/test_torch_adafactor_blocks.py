"""Eager torch's blocked Adafactor step (`_backend/torch/adafactor.py`'s `blocked_step`) on its own.

Checked against the independent numpy reference (`tests/reference/numpy_adafactor.py`),
for host-device synchronisations (none allowed) and for its temporaries (none of the variable's size).
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest

BACKEND = keras.backend.backend()
if BACKEND != "torch":
    # Never import torch next to another backend (TensorFlow and torch must not share a process).
    _REASON = (
        f"the eager-torch blocked Adafactor step needs KERAS_BACKEND=torch; this run is {BACKEND}"
    )
    print(f"{__name__}: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

torch = pytest.importorskip("torch")

from keras_tpu_optim._math import blocks  # noqa: E402
from keras_tpu_optim._backend.torch import adafactor  # noqa: E402
from keras_tpu_optim._math.adafactor import AdafactorOptions  # noqa: E402
from _adafactor_options import make_options  # noqa: E402  (tests/ is on pythonpath)
from reference.numpy_adafactor import NumpyAdafactor  # noqa: E402
from test_adafactor import make_data  # noqa: E402

SHAPES = [(3,), (37, 5), (2, 16, 3), (1, 7)]
STEPS = 5
# As tests/test_adafactor.py: bf16 is about one unit in the last place (2^-7 relative).
TOLERANCES = {
    "float32": dict(rtol=1e-4, atol=1e-6),
    "bfloat16": dict(rtol=1e-2, atol=1e-2),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.dtype("float32"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
SYNC_METHODS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu")


def make_state(shape, beta_1, options=None):
    """Zero slots, as the optimizer builds them: factored for rank >= 2 (over `options.factored_axes`)."""
    axes = (len(shape) - 2, len(shape) - 1) if options is None else options.factored_axes(shape)
    if len(shape) >= 2:
        a, b = axes
        slots = (
            torch.zeros([d for i, d in enumerate(shape) if i != b]),
            torch.zeros([d for i, d in enumerate(shape) if i != a]),
        )
    else:
        slots = (torch.zeros(shape),)
    return slots, None if beta_1 is None else torch.zeros(shape)


def to_torch(x, dtype):
    return torch.tensor(
        np.asarray(x, dtype=np.float32), dtype=TORCH_DTYPES[dtype]
    )  # a copy: kernels write in place


def to_float64(t):
    return t.to(torch.float32).numpy().astype(np.float64)


@pytest.mark.parametrize(
    "chunk_elements", [blocks.CHUNK_ELEMENTS, 4], ids=["one_block", "blocks_of_4"]
)
@pytest.mark.parametrize(
    "schedule", [{}, dict(decay_offset=2, beta_2_cap=0.6)], ids=["keras_decay", "offset_and_cap"]
)
@pytest.mark.parametrize(
    "multiply_by_parameter_scale", [True, False], ids=["param_scale", "no_param_scale"]
)
@pytest.mark.parametrize("relative_step", [True, False], ids=["relative", "absolute"])
@pytest.mark.parametrize("beta_1", [None, 0.9], ids=["no_momentum", "momentum"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_numpy_reference(
    dtype, beta_1, relative_step, multiply_by_parameter_scale, schedule, chunk_elements
):
    # lr 0.5 is above the relative-step cap 1/sqrt(t) from t = 5.
    reference = NumpyAdafactor(
        learning_rate=0.5,
        relative_step=relative_step,
        beta_1=beta_1,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        **schedule,
    )
    options = make_options(reference)
    inits, grads = make_data(SHAPES, STEPS)
    np_dtype = NUMPY_DTYPES[dtype]
    expected = [x.astype(np_dtype) for x in inits]
    params = [to_torch(x, dtype) for x in inits]
    states = [make_state(s, beta_1) for s in SHAPES]
    for t, step_grads in enumerate(grads):
        expected = reference.step(expected, [g.astype(np_dtype) for g in step_grads])
        # Other scalar dtypes than the kernel's float32, to exercise the casts.
        learning_rate = torch.tensor(0.5, dtype=torch.float64)
        step = torch.tensor(t + 1, dtype=torch.int64)
        for param, grad, (slots, momentum) in zip(params, step_grads, states):
            adafactor.blocked_step(
                to_torch(grad, dtype),
                param,
                slots,
                momentum,
                learning_rate=learning_rate,
                step=step,
                options=options,
                chunk_elements=chunk_elements,
            )
        for i, (param, want) in enumerate(zip(params, expected)):
            assert param.dtype == TORCH_DTYPES[dtype]
            np.testing.assert_allclose(
                to_float64(param),
                want.astype(np.float64),
                **TOLERANCES[dtype],
                err_msg=f"step {t + 1}, variable {i} of shape {SHAPES[i]}",
            )
    # The float32 statistics, too (they see the same, rounded, gradients as the reference).
    for i, ((slots, momentum), state) in enumerate(zip(states, reference.state)):
        names = ("row", "column") if len(slots) == 2 else ("v",)
        for slot, name in zip(slots, names):
            assert slot.dtype == torch.float32
            np.testing.assert_allclose(
                to_float64(slot), state[name], rtol=1e-4, err_msg=f"{name} of variable {i}"
            )
        if beta_1 is not None:
            np.testing.assert_allclose(
                to_float64(momentum), state["m"], **TOLERANCES[dtype], err_msg=f"m {i}"
            )
    # Guard against a vacuous comparison: every variable moved.
    for i, (final, init) in enumerate(zip(expected, inits)):
        assert not np.allclose(final.astype(np.float64), init, rtol=1e-3, atol=0), (
            f"variable {i} never moved"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("beta_1", [None, 0.9], ids=["no_momentum", "momentum"])
@pytest.mark.parametrize("shape", [(64, 96), (2000,)], ids=["factored", "unfactored"])
def test_low_precision_param_is_updated_in_float32_and_rounded_once(shape, beta_1, dtype):
    # Exact: the same step on the param's values held in float32, rounded afterwards, is
    # bit-identical; rounding twice (delta, then the difference) is not, on this many elements.
    options = make_options(NumpyAdafactor(beta_1=beta_1))
    generator = torch.Generator().manual_seed(3)
    low = torch.randn(shape, generator=generator).to(dtype)
    high = low.to(torch.float32)
    grad = torch.randn(shape, generator=generator)
    states = [make_state(shape, beta_1) for _ in range(2)]
    for param, (slots, momentum) in zip((low, high), states):
        if momentum is not None:
            momentum.copy_(0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(4)))
        adafactor.blocked_step(
            grad,
            param,
            slots,
            momentum,
            learning_rate=torch.tensor(0.01),
            step=torch.tensor(2),
            options=options,
        )
    assert low.dtype == dtype
    assert torch.equal(low, high.to(dtype))
    for a, b in zip(states[0][0] + (states[0][1],), states[1][0] + (states[1][1],)):
        assert a is None and b is None or torch.equal(a, b)


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts calls of the tensor methods that read a value back to the host (still delegating)."""
    counts = dict.fromkeys(SYNC_METHODS, 0)

    def counting(name, method):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    # Guard: the patches do see Python-level reads.
    float(torch.tensor(1.0))
    assert counts["__float__"] == 1
    counts["__float__"] = 0
    return counts


@pytest.mark.parametrize(
    "extra",
    [
        {},
        dict(factored_dims="two_largest", decay_offset=1, beta_2_cap=0.9, stochastic_rounding=True),
    ],
    ids=["default", "options"],
)
def test_no_host_device_synchronisation(sync_counter, extra):
    shapes = [
        (3,),
        (37, 5),
        (2, 16, 3),
        (1, 7),
        (),
        (64,),
        (8, 8),
        (128, 16),
        (3, 4, 5),
        (16, 1),
    ] * 2
    rng = np.random.default_rng(1)
    options = make_options(NumpyAdafactor(beta_1=0.9), **extra)
    # Half bf16: the low-precision path (blocks read in float32, one rounding) syncs no more.
    dtypes = ["float32", "bfloat16"] * 10
    params = [to_torch(rng.normal(size=s), d) for s, d in zip(shapes, dtypes)]
    grads = [to_torch(rng.normal(size=s), d) for s, d in zip(shapes, dtypes)]
    states = [make_state(s, 0.9, options) for s in shapes]
    learning_rate = torch.tensor(0.01)
    for t in range(3):
        step = torch.tensor(t + 1.0)
        for param, grad, (slots, momentum) in zip(params, grads, states):
            adafactor.blocked_step(
                grad,
                param,
                slots,
                momentum,
                learning_rate=learning_rate,
                step=step,
                options=options,
            )
    assert sum(sync_counter.values()) == 0, {k: v for k, v in sync_counter.items() if v}
    assert all(bool(torch.isfinite(p).all()) for p in params)


# float32 only: on CPU, torch materialises a float32 copy of a bf16 operand in mixed-dtype
# ops (CUDA casts on the fly), so a bf16 variable costs temporaries here that it does not on GPU.
# Factored only: an unfactored variable's statistics are as big as itself, and updated whole.
@pytest.mark.parametrize("beta_1", [None, 0.9], ids=["no_momentum", "momentum"])
@pytest.mark.parametrize("shape", [(256, 512), (16, 64, 128)], ids=["matrix", "rank_3"])
def test_no_full_size_allocation(shape, beta_1):
    from torch.profiler import ProfilerActivity, profile

    options = make_options(NumpyAdafactor(beta_1=beta_1))
    rng = np.random.default_rng(2)
    param, grad = (to_torch(rng.normal(size=shape), "float32") for _ in range(2))
    slots, momentum = make_state(shape, beta_1)
    chunk = param.numel() // 16
    kwargs = dict(learning_rate=torch.tensor(0.01), step=torch.tensor(1.0), options=options)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        adafactor.blocked_step(grad, param, slots, momentum, chunk_elements=chunk, **kwargs)
    # Row/column-sized temporaries are at most 512 floats, a block 32 KiB; a copy of the variable is 512 KiB.
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < param.numel() * 4 // 8, f"an op allocated {largest} bytes"


@pytest.mark.parametrize("factored_dims", ["last_two", "two_largest"])
@pytest.mark.parametrize("beta_1", [None, 0.9], ids=["no_momentum", "momentum"])
def test_blocks_round_stochastically_as_one_block(beta_1, factored_dims):
    """A variable updated in blocks gets the same result, stochastic rounding's bits included (their `offset`)."""
    options = AdafactorOptions(
        beta_1=beta_1, factored_dims=factored_dims, stochastic_rounding=True, seed=3
    )
    rng = np.random.default_rng(4)
    results = []
    for chunk in (blocks.CHUNK_ELEMENTS, 50, 7):
        params = []
        for shape in [(40, 30), (9, 20, 6), (300,)]:
            param = to_torch(
                rng.normal(size=shape)
                if chunk == blocks.CHUNK_ELEMENTS
                else results[0][len(params)][1],
                "bfloat16",
            )
            init = param.clone()
            grad = to_torch(np.random.default_rng(5).normal(size=shape), "bfloat16")
            slots, momentum = make_state(shape, beta_1, options)
            for t in range(3):
                adafactor.blocked_step(
                    grad,
                    param,
                    slots,
                    momentum,
                    learning_rate=torch.tensor(0.01),
                    step=torch.tensor(t + 1),
                    options=options,
                    variable_index=len(params),
                    chunk_elements=chunk,
                )
            params.append((param, to_float64(init)))
        results.append(params)
    for in_blocks in results[1:]:
        for (whole, _), (blocked, init) in zip(results[0], in_blocks):
            assert not np.array_equal(to_float64(whole), init)
            # The same bits but where float32 sums in another order moved a value across a rounding threshold.
            assert np.mean(to_float64(whole) == to_float64(blocked)) > 0.99


def test_random_bits_first_row_is_a_block_of_the_whole():
    from keras_tpu_optim._math import stochastic_rounding

    whole = keras.ops.convert_to_numpy(stochastic_rounding.random_bits((10, 6), 1, 2, 3))
    block = keras.ops.convert_to_numpy(
        stochastic_rounding.random_bits((4, 6), 1, 2, 3, first_row=3)
    )
    np.testing.assert_array_equal(block, whole[3:7])
