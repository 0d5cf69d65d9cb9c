"""Shared test set-up. Each backend's tests run in their own process (dev/test.sh)."""

import importlib.metadata
import os

import pytest


def _runs_tests(config) -> bool:
    """False in pytest-xdist's controller, which only hands tests to its workers (and need not import Keras)."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def pytest_configure(config):
    if not _runs_tests(config):
        return
    if _backend() == "tensorflow":
        import tensorflow as tf

        # Two logical CPU devices for the tf.distribute.MirroredStrategy tests, set before TF
        # initialises its devices (ops run on the first unless placed).
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )


# Backend-neutral tests (the import graph, numpy references, files read without the package) run
# in one pass only.
NEUTRAL_PASS = "jax"


def _backend() -> str:
    import keras  # Here, not at the top: pytest-xdist's controller never needs it (`_runs_tests`).

    return keras.backend.backend()


def pytest_runtest_setup(item):
    if item.get_closest_marker("backend_neutral") and _backend() != NEUTRAL_PASS:
        pytest.skip(f"backend-neutral: runs once, in the {NEUTRAL_PASS} pass")


def pytest_addoption(parser):
    parser.addoption(
        "--each-value-once",
        action="store_true",
        help="of each parametrized test, run only the cases it takes for every parameter value to run "
        "at least once (dev/test.sh --quick); without it, every combination runs",
    )


def _parameter_values(item) -> set:
    """The (argument, value) pairs of a test case; a case without parameters is one value of its own."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return {None}
    values = set()
    for name, value in callspec.params.items():
        try:
            values.add((name, type(value), value))
        except (
            TypeError
        ):  # A list or dict: parametrize passes the same object to every case it is in.
            values.add((name, id(value)))
    return values


def pytest_collection_modifyitems(config, items):
    # The tests that start other processes (the longest) first: pytest-xdist's workers then end a
    # pass on short tests together, not one on a long test while the other has nothing left.
    items.sort(key=lambda item: item.get_closest_marker("processes") is None)
    if not config.getoption("--each-value-once"):
        return
    # Cases in collection order; a case is kept if it runs a value no kept case of its test has run.
    covered: dict = {}
    kept, left_out = [], []
    for item in items:
        test = (item.path, item.cls, getattr(item, "originalname", item.name))
        values = _parameter_values(item)
        seen = covered.setdefault(test, set())
        if values - seen:
            seen |= values
            kept.append(item)
        else:
            left_out.append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=left_out)


def _keras_distribution() -> str:
    """The installed distribution `import keras` finds first on sys.path: `keras`, or `keras-nightly` put
    ahead of it (`dev/check_install.sh --keras-nightly`). Read without importing Keras."""
    return importlib.metadata.packages_distributions().get("keras", ["keras"])[0]


def pytest_report_header(config):
    # pytest-xdist's controller does not import Keras: the backend its workers will read.
    backend = (
        _backend()
        if _runs_tests(config)
        else f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND', '(unset)')}"
    )
    distribution = _keras_distribution()
    return f"{distribution} {importlib.metadata.version(distribution)}, backend: {backend}"


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    # Not Keras's default `gc.collect()` before every test: about 0.15 s each, most of a
    # small test's time; Python collects as it goes.
    import keras

    keras.backend.clear_session(free_memory=False)
    yield


# Eager JAX compiles a fresh executable for each `jax.lax.cond` built from new lambdas (Keras's
# JAX optimizers do this at every eager `apply` with `gradient_accumulation_steps`), and keeps
# every one in its caches: about 6 memory maps each. Hundreds of tests reach the kernel's
# `vm.max_map_count` (65530), where XLA's compiler crashes the process. Clearing the caches
# when the maps pass this bound frees them (a test after it recompiles what it needs).
_MAX_MAPS_BEFORE_CLEARING = 20000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # Not Linux: no such limit to watch.
        return 0


@pytest.fixture(autouse=True)
def _bounded_jax_caches():
    yield
    if _backend() == "jax" and _memory_maps() > _MAX_MAPS_BEFORE_CLEARING:
        import jax

        jax.clear_caches()
