"""The backend interface: resolved once, kernels chosen by platform, neutral math free of backends, no import cycles.

The platform is injected (an optimizer's per-variable platform is set by
hand), so the rule is tested without an accelerator: on "gpu" and "tpu" the
CPU-measured forms must not run, and both forms give the same numbers.
"""

import ast
import pathlib
import re

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from keras_tpu_optim import _backend
from keras_tpu_optim._math import adafactor as adafactor_math

BACKEND = keras.backend.backend()
PACKAGE = pathlib.Path(kto.__file__).parent
BACKEND_FRAMEWORKS = ("tensorflow", "jax", "jaxlib", "torch")


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path) for path in PACKAGE.rglob("*.py")}


def _imports(path):
    """The modules `path` imports; `from package import module` counts as the module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in MODULES else node.module


def _called_names():
    """The names the package calls on its backend (`backend.<name>`), outside `_backend`."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "_backend" not in path.parts:
            names |= set(re.findall(r"(?<![.\w])backend\.([a-z_]+)\(", path.read_text()))
    return names


def test_backend_resolved_once_and_complete():
    assert _backend.get() is _backend.get(BACKEND)
    names = _called_names()
    assert {"adafactor_step", "embedding_adam_step", "trained_lookup"} <= names
    for name in names:
        assert callable(getattr(_backend.get(), name)), name
    with pytest.raises(NotImplementedError, match="numpy"):
        _backend.get("numpy")


@pytest.mark.parametrize(
    "path",
    sorted((PACKAGE / "_math").glob("*.py")) + [PACKAGE / "_backend" / "neutral.py"],
    ids=lambda p: p.name,
)
@pytest.mark.backend_neutral
def test_neutral_math_imports_no_backend_and_asks_for_none(path):
    imported = set(_imports(path))
    assert not {name for name in imported if name.split(".")[0] in BACKEND_FRAMEWORKS}
    assert not {name for name in imported if name.startswith("keras_tpu_optim._backend.")}
    assert "backend()" not in path.read_text()


@pytest.mark.backend_neutral
def test_dependencies_point_down():
    """No module imports one above it: optimizers -> _backend -> neutral -> _math; no cycles."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = {m for m in _imports(path) if m.startswith("keras_tpu_optim")}
    for name, imported in graph.items():
        if name.startswith("keras_tpu_optim._backend") or name.startswith("keras_tpu_optim._math"):
            assert not imported & {
                "keras_tpu_optim",
                "keras_tpu_optim.adafactor",
                "keras_tpu_optim.embedding_adam",
                "keras_tpu_optim._base",
            }, name
    visiting, done = set(), set()

    def visit(name, trail):
        if name in done or name not in graph:
            return
        assert name not in visiting, f"import cycle: {' -> '.join(trail + [name])}"
        visiting.add(name)
        for child in graph[name]:
            visit(child, trail + [name])
        visiting.discard(name)
        done.add(name)

    for name in graph:
        visit(name, [])


def test_platform_of_a_variable_here_is_cpu():
    variable = keras.Variable(np.ones((3, 2), np.float32))
    assert _backend.get().platform_of(variable) == "cpu"
    optimizer = kto.Adafactor()
    optimizer.build([variable])
    assert optimizer._platforms == ["cpu"]


def _cpu_evaluation(platform):
    """The backend's Adafactor evaluation on `platform` (torch has none of its own: its CPU step is blocked)."""
    if BACKEND == "tensorflow":
        from keras_tpu_optim._backend.tensorflow.adafactor import adafactor_evaluation
    elif BACKEND == "jax":
        from keras_tpu_optim._backend.jax import adafactor_evaluation
    else:
        return adafactor_math.NEUTRAL
    return adafactor_evaluation(platform)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_adafactor_evaluation_by_platform(platform):
    evaluation = _cpu_evaluation(platform)
    if platform == "cpu" and BACKEND in ("tensorflow", "jax"):
        assert type(evaluation) is not adafactor_math.Evaluation
        assert type(evaluation).__module__.startswith(f"keras_tpu_optim._backend.{BACKEND}")
    else:
        assert evaluation is adafactor_math.NEUTRAL


@pytest.mark.skipif(BACKEND != "torch", reason="the blocked CPU step is the torch backend's")
@pytest.mark.parametrize("platform,expected", [("cpu", True), ("gpu", False), ("mps", False)])
def test_torch_blocked_step_only_on_cpu(platform, expected):
    assert _backend.get().blocked_adafactor_applies(platform) is expected


def _run(platform, monkeypatch=None):
    rng = np.random.default_rng(0)
    shapes = [(40, 24), (24,), (2, 17, 5)]
    variables = [
        keras.Variable(rng.normal(size=s).astype(np.float32), name=f"v{i}")
        for i, s in enumerate(shapes)
    ]
    optimizer = kto.Adafactor(learning_rate=0.05, beta_1=0.5)
    optimizer.build(variables)
    optimizer._platforms = [platform] * len(variables)
    for step in range(3):
        grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
        optimizer.apply(grads, variables)
    return [keras.ops.convert_to_numpy(v) for v in variables]


def test_injected_platform_picks_neutral_kernels_with_the_same_numbers(monkeypatch):
    cpu = _run("cpu")
    if BACKEND in ("tensorflow", "jax"):
        cpu_class = type(_cpu_evaluation("cpu"))
        for method in ("square_sums", "weighted_square_sum", "sum", "separately"):
            if method in vars(cpu_class):
                monkeypatch.setattr(cpu_class, method, _forbidden(method))
    else:
        from keras_tpu_optim._backend.torch import adafactor as torch_adafactor

        monkeypatch.setattr(torch_adafactor, "blocked_step", _forbidden("the blocked step"))
    for platform in ("gpu", "tpu"):
        keras.backend.clear_session(free_memory=False)
        for ours, theirs in zip(_run(platform), cpu):
            np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-7)


def _forbidden(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran for a variable that is not on a CPU")

    return fail


def test_unstacked_parts_and_their_gradient_match_numpy():
    """`unstacked` splits along the first axis; on JAX its gradient (a custom VJP) is each part's gradient
    stacked, an unused part's zero. Checked through each backend's own autodiff."""
    rows = np.arange(3 * 2 * 4 * 5, dtype=np.float32).reshape(3, 2, 4, 5)
    weights = np.array([2.0, 0.0, -3.0], np.float32)  # part 1 unused

    def loss(x):
        parts = _backend.backend.unstacked(x)
        return sum(w * keras.ops.sum(p * p) for w, p in zip(weights, parts) if w)

    if BACKEND == "jax":
        import jax

        gradient = np.asarray(jax.grad(loss)(keras.ops.convert_to_tensor(rows)))
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.constant(rows)
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = loss(x)
        gradient = tape.gradient(value, x).numpy()
    else:
        import torch

        x = torch.tensor(rows, requires_grad=True)
        loss(x).backward()
        gradient = x.grad.numpy()
    parts = _backend.backend.unstacked(keras.ops.convert_to_tensor(rows))
    parts = [keras.ops.convert_to_numpy(p) for p in parts]
    np.testing.assert_array_equal(np.stack(parts), rows)
    np.testing.assert_allclose(gradient, 2 * weights[:, None, None, None] * rows)
