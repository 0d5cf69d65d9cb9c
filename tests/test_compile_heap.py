"""JAX on CPU: XLA's freed compile heap is returned to the OS once one of our optimizers is built.

Each case runs in a fresh process (`_compile_heap_worker.py`) and reads the
RSS a large compilation leaves behind from the kernel (`/proc/self/statm`).
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()
WORKER = pathlib.Path(__file__).with_name("_compile_heap_worker.py")

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(BACKEND != "jax", reason="only XLA compilations under JAX are followed by the release: TF "
                                                "keeps its compiled clusters, torch runs eagerly"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)"),
]


def kept_mb(mode, **env):
    result = subprocess.run(
        [sys.executable, str(WORKER), mode], capture_output=True, text=True, timeout=300,
        env={**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("KEPT_MB")]
    return float(line.split()[1])


def test_compile_heap_released_after_build_and_not_when_turned_off():
    plain = kept_mb("plain")
    built = kept_mb("built")
    turned_off = kept_mb("built", KERAS_TPU_OPTIM_TRIM_AFTER_COMPILE="0")
    print(f"RSS kept by the compilation: {plain:.0f} MB plain, {built:.0f} MB after build, {turned_off:.0f} MB off")
    assert plain > 60, "the compilation should leave a heap behind for this test to mean anything"
    assert built < 0.6 * plain
    assert turned_off > 0.7 * plain


def test_registered_once_by_a_cpu_build():
    import numpy as np

    import keras_tpu_optim as kto
    from keras_tpu_optim._backend.jax import compile_heap

    kto.EmbeddingAdam().build([keras.Variable(np.zeros((8, 4), "float32"))])
    assert compile_heap.registered()
    assert compile_heap.release_after_compilations()  # again: no second listener
