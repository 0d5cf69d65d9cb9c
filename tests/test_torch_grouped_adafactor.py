"""torch's grouped Adafactor step (`_backend/torch/adafactor.py`'s `grouped_step`): variables of one shape and dtype
stepped together, in a number of ops that grows with the groups, not the variables.

References: the numpy Adafactor (`tests/reference/numpy_adafactor.py`; for
`factored_dims="two_largest"` on the transposed matrices, where it factors the same two axes)
and the contract's stochastic-rounding hash in numpy (`tests/test_stochastic_rounding.py`). The
grouped step is the one a CUDA variable takes (the platform is set to "gpu" here, as
`tests/test_backend_interface.py` does) and a small variable on CPU.
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
if BACKEND != "torch":
    _REASON = f"the grouped step is the torch backend's; this run is {BACKEND}"
    print(f"{__name__}: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

import torch  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from keras_tpu_optim._backend import neutral  # noqa: E402
from keras_tpu_optim._backend import torch as torch_backend  # noqa: E402
from keras_tpu_optim._backend.torch import adafactor as torch_kernel  # noqa: E402
from reference.numpy_adafactor import NumpyAdafactor  # noqa: E402
from test_stochastic_rounding import reference_round  # noqa: E402

# Two of a shape (one group each, twice over), a scalar, a rank-3 variable, vectors.
SHAPES = [(37, 5), (37, 5), (2, 16, 3), (), (64,), (64,), (9, 2, 4), (1, 7)]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
STEPS = 5
CASES = {
    "default": {},
    "momentum": dict(beta_1=0.9),
    "absolute_no_param_scale": dict(relative_step=False, multiply_by_parameter_scale=False),
    "offset_and_cap": dict(decay_offset=2, beta_2_cap=0.6, beta_1=0.5),
}


def _forbid_per_variable_steps(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a per-variable Adafactor step ran where the grouped step applies")

    monkeypatch.setattr(torch_kernel, "blocked_step", forbidden)
    monkeypatch.setattr(neutral, "adafactor_step", forbidden)


def _optimizer(variables, platform="gpu", **options):
    optimizer = kto.Adafactor(**{"learning_rate": 0.5, **options})
    optimizer.build(variables)
    optimizer._platforms = [platform] * len(variables)
    return optimizer


def _data(shapes, steps, seed=0):
    rng = np.random.default_rng(seed)
    inits = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [
        [(10.0 ** rng.uniform(-1.5, 1.5) * rng.normal(size=s)).astype(np.float32) for s in shapes]
        for _ in range(steps)
    ]
    return inits, grads


def _numpy(x):
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")).astype(np.float64)


@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["float32", "float32_and_bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_step_matches_numpy(case, mixed_dtypes, monkeypatch):
    options = CASES[case]
    dtypes = (
        ["float32", "bfloat16"] * (len(SHAPES) // 2) if mixed_dtypes else ["float32"] * len(SHAPES)
    )
    inits, grads = _data(SHAPES, STEPS)
    variables = [keras.Variable(x.astype(DTYPES[d]), dtype=d) for x, d in zip(inits, dtypes)]
    optimizer = _optimizer(variables, **options)
    reference = NumpyAdafactor(learning_rate=0.5, **options)
    expected = [x.astype(DTYPES[d]) for x, d in zip(inits, dtypes)]
    _forbid_per_variable_steps(monkeypatch)
    for t, step_grads in enumerate(grads):
        step_grads = [g.astype(DTYPES[d]) for g, d in zip(step_grads, dtypes)]
        expected = reference.step(expected, step_grads)
        optimizer.apply(
            [
                torch.tensor(g.astype(np.float32)).to(v.value.dtype)
                for g, v in zip(step_grads, variables)
            ],
            variables,
        )
        for i, (variable, want, dtype) in enumerate(zip(variables, expected, dtypes)):
            tolerance = (
                dict(rtol=1e-2, atol=1e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-6)
            )
            np.testing.assert_allclose(
                _numpy(variable),
                want.astype(np.float64),
                **tolerance,
                err_msg=f"step {t + 1}, variable {i} {SHAPES[i]} {dtype}",
            )
    for i, (variable, state) in enumerate(zip(variables, reference.state)):
        slots = optimizer._state_of(variable).slots
        for slot, name in zip(slots, ("row", "column") if len(slots) == 2 else ("v",)):
            assert keras.backend.standardize_dtype(slot.dtype) == "float32"
            np.testing.assert_allclose(
                _numpy(slot),
                state[name],
                rtol=1e-4 if dtypes[i] == "float32" else 5e-2,
                err_msg=f"{name} of variable {i}",
            )
    for i, (variable, init) in enumerate(zip(variables, inits)):
        assert not np.allclose(_numpy(variable), init, rtol=1e-3, atol=0), (
            f"variable {i} never moved"
        )


def test_two_largest_factors_the_two_largest_axes(monkeypatch):
    # (37, 5) factored over its two largest axes is (5, 37) factored over its last two.
    inits, grads = _data([(37, 5), (37, 5), (6, 11)], STEPS, seed=3)
    variables = [keras.Variable(x) for x in inits]
    optimizer = _optimizer(variables, factored_dims="two_largest", beta_1=0.9)
    reference = NumpyAdafactor(learning_rate=0.5, beta_1=0.9)
    expected = [x.T for x in inits]
    _forbid_per_variable_steps(monkeypatch)
    for step_grads in grads:
        expected = reference.step(expected, [g.T for g in step_grads])
        optimizer.apply([torch.tensor(g) for g in step_grads], variables)
    for variable, want in zip(variables, expected):
        np.testing.assert_allclose(_numpy(variable), want.T, rtol=1e-4, atol=1e-6)
    assert tuple(optimizer._state_of(variables[0]).slots[0].shape) == (
        5,
    )  # the row statistics: without axis 0


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_float64_variables_keep_the_per_variable_step(platform):
    """The grouped step's float32 reductions refuse float64 tensors: float64 variables beside float32 ones take
    the per-variable step (float32 arithmetic and state, as for every dtype) and the numpy reference's numbers."""
    shapes = [(6, 4), (6, 4), (5,)]
    inits, grads = _data(shapes, 3, seed=8)
    variables = [keras.Variable(x.astype(np.float64), dtype="float64") for x in inits[:2]] + [
        keras.Variable(inits[2])
    ]
    optimizer = _optimizer(variables, platform=platform)
    reference = NumpyAdafactor(learning_rate=0.5)
    expected = [x.astype(np.float64) for x in inits]
    for step_grads in grads:
        expected = reference.step(expected, [g.astype(np.float64) for g in step_grads])
        optimizer.apply(
            [torch.tensor(g).to(v.value.dtype) for g, v in zip(step_grads, variables)], variables
        )
    for variable, want in zip(variables[:2], expected[:2]):
        assert variable.value.dtype == torch.float64
        np.testing.assert_allclose(_numpy_exact(variable), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_numpy(variables[2]), expected[2], rtol=1e-4, atol=1e-6)


def _numpy_exact(x):
    return keras.ops.convert_to_numpy(x).astype(np.float64)


def test_skip_nonfinite_updates_skips_a_grouped_step_whole(monkeypatch):
    """A step with a NaN in one variable's gradient changes no variable, slot or step count of any group; the
    finite steps around it are the numpy reference's (which never sees the skipped step)."""
    inits, grads = _data(SHAPES, 3, seed=6)
    variables = [keras.Variable(x) for x in inits]
    optimizer = _optimizer(variables, beta_1=0.9, skip_nonfinite_updates=True)
    reference = NumpyAdafactor(learning_rate=0.5, beta_1=0.9)
    _forbid_per_variable_steps(monkeypatch)
    expected = reference.step(inits, grads[0])
    optimizer.apply([torch.tensor(g) for g in grads[0]], variables)
    before = [_numpy(v) for v in optimizer.variables]
    poisoned = [g.copy() for g in grads[1]]
    poisoned[2].flat[3] = np.nan
    optimizer.apply([torch.tensor(g) for g in poisoned], variables)
    for was, now in zip(before, optimizer.variables):
        np.testing.assert_array_equal(_numpy(now), was)
    for variable, want in zip(variables, expected):
        np.testing.assert_allclose(_numpy(variable), want, rtol=1e-4, atol=1e-6)
    expected = reference.step(expected, grads[2])
    optimizer.apply([torch.tensor(g) for g in grads[2]], variables)
    for i, (variable, want) in enumerate(zip(variables, expected)):
        np.testing.assert_allclose(
            _numpy(variable), want, rtol=1e-4, atol=1e-6, err_msg=f"variable {i}"
        )


def test_stochastic_rounding_keys_each_variable_of_a_group(monkeypatch):
    # Two equal bfloat16 variables with equal gradients, one group: the numpy reference's float32
    # result rounded with each variable's own bits (its index in the optimizer).
    shape = (48, 40)
    init = np.random.default_rng(5).normal(size=shape).astype(np.float32)
    grad = np.random.default_rng(6).normal(size=shape).astype(np.float32)
    low = init.astype(ml_dtypes.bfloat16)
    variables = [keras.Variable(low, dtype="bfloat16") for _ in range(2)]
    optimizer = _optimizer(variables, stochastic_rounding=True, seed=7, learning_rate=0.01)
    _forbid_per_variable_steps(monkeypatch)
    optimizer.apply([torch.tensor(grad).to(torch.bfloat16)] * 2, variables)
    reference = NumpyAdafactor(learning_rate=0.01)
    (exact,) = reference.step(
        [low.astype(np.float64)], [grad.astype(ml_dtypes.bfloat16).astype(np.float64)]
    )
    results = [_numpy(v) for v in variables]
    for index, result in enumerate(results):
        want = reference_round(exact.astype(np.float32), "bfloat16", 7, 1, index).astype(np.float64)
        # The same bits; a value the float32 step puts across a rounding threshold may differ.
        assert np.mean(result == want) > 0.99, index
    assert np.mean(results[0] != results[1]) > 0.1  # each variable its own bits


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_of_a_step(count, **options):
    shapes = [(64, 32), (32,)] * (count // 2)
    variables = [keras.Variable(np.full(s, 0.1, np.float32)) for s in shapes]
    optimizer = _optimizer(variables, **options)
    grads = [torch.randn(s) for s in shapes]
    optimizer.apply(grads, variables)  # warm: the grouping is planned once
    with _OpCounter() as counter:
        optimizer.apply(grads, variables)
    return counter.count


@pytest.mark.parametrize("options", [{}, dict(beta_1=0.9)], ids=["plain", "momentum"])
def test_ops_grow_with_groups_not_variables(options):
    few, many = _ops_of_a_step(10, **options), _ops_of_a_step(40, **options)
    assert many == few, (few, many)
    assert many <= 40 + 50 * 2  # one per variable and 50 per group at most


def test_large_cpu_variables_take_the_blocked_step_small_ones_the_groups(monkeypatch):
    calls = []
    blocked_step = torch_kernel.blocked_step
    grouped_step = torch_kernel.grouped_step
    monkeypatch.setattr(
        torch_kernel,
        "blocked_step",
        lambda grad, param, *a, **k: (
            calls.append(("kernel", param.numel())),
            blocked_step(grad, param, *a, **k),
        ),
    )
    monkeypatch.setattr(
        torch_kernel,
        "grouped_step",
        lambda members, **k: (calls.append(("group", len(members))), grouped_step(members, **k)),
    )
    big = torch_backend.CPU_GROUPED_ELEMENTS * 2
    shapes = [(big // 64, 64), (64,), (8, 8)]
    variables = [keras.Variable(np.ones(s, np.float32)) for s in shapes]
    optimizer = _optimizer(variables, platform="cpu")
    optimizer.apply([torch.ones(s) for s in shapes], variables)
    assert sorted(calls) == [("group", 1), ("group", 1), ("kernel", big)]


def test_chunks_of_a_group_give_the_same_numbers(monkeypatch):
    shapes = [(12, 10)] * 7
    inits, grads = _data(shapes, 3, seed=9)
    results = []
    for chunk_elements in (
        torch_kernel.GROUP_ELEMENTS,
        250,
    ):  # 7 variables in one stack; in 4 stacks of 2, 2, 2, 1
        monkeypatch.setattr(torch_kernel, "GROUP_ELEMENTS", chunk_elements)
        variables = [keras.Variable(x) for x in inits]
        optimizer = _optimizer(variables, beta_1=0.9)
        for step_grads in grads:
            optimizer.apply([torch.tensor(g) for g in step_grads], variables)
        results.append([_numpy(v) for v in variables])
        _, plan = next(iter(optimizer._backend_cache["plans"].values()))  # (alone, chunks)
        assert [len(positions) for positions, _, _ in plan] == (
            [7] if chunk_elements > 1000 else [2, 2, 2, 1]
        )
    for one, chunked in zip(*results):
        np.testing.assert_array_equal(one, chunked)


def test_no_host_device_synchronisation(monkeypatch):
    methods = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu")
    counts = dict.fromkeys(methods, 0)
    inits, grads = _data(SHAPES, 2)
    variables = [keras.Variable(x) for x in inits]
    optimizer = _optimizer(
        variables, beta_1=0.9, stochastic_rounding=True, decay_offset=1, beta_2_cap=0.9
    )
    optimizer.apply(
        [torch.tensor(g) for g in grads[0]], variables
    )  # planned (its index tensors made) once

    def counting(name, method):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return wrapper

    for name in methods:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    steps = [torch.tensor(g) for g in grads[1]]
    with monkeypatch.context() as patch:
        patch.setattr(neutral, "adafactor_step", None)  # the grouped step alone
        optimizer._backend_update_step(steps, variables, optimizer.learning_rate)
    assert sum(counts.values()) == 0, {k: v for k, v in counts.items() if v}


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["gpu", "cpu"], ids=["grouped", "cpu_kernels"])
def test_compiles_whole_with_the_eager_numbers(platform):
    # Traced and functionalized as inductor would take it (`aot_eager`); inductor's code generation is
    # torch's, C++ on a CPU where users' accelerators get Triton, and tested once in test_torch_rows.py.
    shapes = [(300, 200), (64, 32), (32,), (32, 16), (64, 32), ()]
    inits, grads = _data(shapes, 3, seed=4)

    def run(compiled):
        variables = [keras.Variable(x) for x in inits]
        optimizer = _optimizer(variables, platform=platform, beta_1=0.9, learning_rate=0.05)

        def step(step_grads):
            optimizer.apply(step_grads, variables)

        if compiled:
            explained = torch._dynamo.explain(step)([torch.tensor(g) for g in grads[0]])
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), (
                explained.break_reasons
            )
            torch._dynamo.reset()
            variables = [keras.Variable(x) for x in inits]
            optimizer = _optimizer(variables, platform=platform, beta_1=0.9, learning_rate=0.05)
            counter = CompileCounterWithBackend("aot_eager")
            step = torch.compile(step, fullgraph=True, backend=counter)
        for step_grads in grads:
            step([torch.tensor(g) for g in step_grads])
        if compiled:  # compiled once: the steps after the first read no cache that the first filled
            assert counter.frame_count == 1
        return [_numpy(v) for v in variables]

    for eager, compiled in zip(run(False), run(True)):
        np.testing.assert_allclose(compiled, eager, rtol=1e-5, atol=1e-6)
