"""Shared test set-up. Each backend's tests run in their own process (dev/test.sh)."""

import keras
import pytest

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    # Two logical CPU devices for the tf.distribute.MirroredStrategy tests, set before TF
    # initialises its devices (ops run on the first unless placed).
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )


# Backend-neutral tests (the import graph, numpy references, files read without the package) run
# in one pass only.
NEUTRAL_PASS = "jax"


def pytest_runtest_setup(item):
    if item.get_closest_marker("backend_neutral") and keras.backend.backend() != NEUTRAL_PASS:
        pytest.skip(f"backend-neutral: runs once, in the {NEUTRAL_PASS} pass")


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    # Not Keras's default `gc.collect()` before every test: about 0.15 s each, most of a
    # small test's time; Python collects as it goes.
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
            return sum(1 for _ in maps)
    except OSError:  # Not Linux: no such limit to watch.
        return 0


@pytest.fixture(autouse=True)
def _bounded_jax_caches():
    yield
    if keras.backend.backend() == "jax" and _memory_maps() > _MAX_MAPS_BEFORE_CLEARING:
        import jax

        jax.clear_caches()
