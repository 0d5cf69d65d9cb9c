"""Nothing process-wide by default; `keras_tpu_optim.tuning`'s opt-in CPU memory tunings when asked for.

The default is checked against what the process itself records (JAX's
monitoring listeners, the kernel's VmFlags in `/proc/self/smaps`, the
environment's reads), not against the code under test.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
jax_only = pytest.mark.skipif(BACKEND != "jax", reason=f"the tunings are JAX's CPU memory; this run is {BACKEND}")


class RecordingEnviron(dict):
    """`os.environ` as a dict that records every key read."""

    def __init__(self, data):
        super().__init__(data)
        self.read = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.append(key)
        return super().__contains__(key)


def a_step_of_each_optimizer():
    table = keras.Variable(np.ones((200_000, 64), "float32"), name="table")  # 51 MB: above any size threshold
    kernel = keras.Variable(np.ones((1024, 4096), "float32"), name="kernel")
    embedding_adam, adafactor = kto.EmbeddingAdam(0.01), kto.Adafactor(0.01)
    embedding_adam.build([table])
    adafactor.build([kernel])
    gradient = np.zeros((200_000, 64), "float32")
    gradient[3] = 1.0
    embedding_adam.apply([keras.ops.convert_to_tensor(gradient)], [table])
    adafactor.apply([keras.ops.ones((1024, 4096))], [kernel])
    return table, embedding_adam


def test_build_and_steps_read_no_environment_variable_of_ours(monkeypatch):
    recording = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recording)
    a_step_of_each_optimizer()
    assert [key for key in recording.read if "TPU_OPTIM" in key.upper()] == []


@jax_only
def test_build_and_steps_register_no_listener_and_advise_no_memory(monkeypatch):
    from jax._src import monitoring

    from keras_tpu_optim._backend.jax import compile_heap, huge_pages

    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(("madvise", args)) or 0)
    monkeypatch.setattr(compile_heap, "malloc_trim", lambda: calls.append("malloc_trim"))
    listeners = len(monitoring._event_duration_secs_listeners)
    a_step_of_each_optimizer()
    assert len(monitoring._event_duration_secs_listeners) == listeners
    assert calls == []


FRESH_PROCESS = textwrap.dedent("""
    import os
    import jax
    from jax._src import monitoring
    before = len(monitoring._event_duration_secs_listeners)
    import test_tuning, test_huge_pages
    os.environ = recording = test_tuning.RecordingEnviron(os.environ)
    table, optimizer = test_tuning.a_step_of_each_optimizer()
    assert not [key for key in recording.read if "TPU_OPTIM" in key.upper()], recording.read
    keras_step = jax.jit(lambda x: x * 2.0)(jax.numpy.ones((1000, 1000)))  # a compilation after ours
    assert len(monitoring._event_duration_secs_listeners) == before, "a listener was registered"
    tables, slots = optimizer._row_tables()
    assert len(slots) == 2
    flags = [test_huge_pages.advised(v) for v in [table, *slots]]
    assert not any(flags), f"advised for huge pages: {flags}"
    print("UNTOUCHED")
""")


@jax_only
@pytest.mark.processes
def test_a_fresh_process_keeps_no_listener_and_no_advised_memory():
    """In a new process (no earlier test advised or listened): the kernel's own record of the table's memory."""
    tests = pathlib.Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=240, cwd=tests,
        env={**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
             "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])},
    )
    assert result.returncode == 0 and "UNTOUCHED" in result.stdout, result.stderr[-3000:]


@jax_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")
def test_release_compile_heap_trims_after_jax_compilations_once_asked_until_turned_off(monkeypatch):
    import jax
    from jax._src import monitoring

    from keras_tpu_optim._backend.jax import compile_heap

    trims = []
    monkeypatch.setattr(compile_heap, "malloc_trim", lambda: trims.append)
    stop = kto.tuning.release_compile_heap(min_seconds=0.0)
    try:
        listeners = len(monitoring._event_duration_secs_listeners)
        jax.jit(lambda x: x * 3.0 + 1.0).lower(np.ones(7, "float32")).compile()  # JAX's own compile event
        assert trims and set(trims) == {0}
        assert kto.tuning.release_compile_heap(min_seconds=3600.0) is stop
        assert len(monitoring._event_duration_secs_listeners) == listeners  # asked again: the same listener
        trims.clear()
        jax.jit(lambda x: x * 5.0 - 1.0).lower(np.ones(7, "float32")).compile()
        assert trims == []  # shorter than min_seconds
        kto.tuning.release_compile_heap(min_seconds=0.0)
    finally:
        stop()
    trims.clear()
    jax.jit(lambda x: x * 7.0 - 2.0).lower(np.ones(7, "float32")).compile()
    assert trims == []
    with pytest.raises(ValueError, match="min_seconds"):
        kto.tuning.release_compile_heap(min_seconds=-1)


@pytest.mark.skipif(BACKEND == "jax", reason="the refusal is for the other backends; this run is jax")
def test_tunings_refuse_other_backends_by_name():
    with pytest.raises(RuntimeError, match=f"release_compile_heap.*{BACKEND}"):
        kto.tuning.release_compile_heap()
    with pytest.raises(RuntimeError, match=f"advise_huge_pages.*{BACKEND}"):
        kto.tuning.advise_huge_pages(kto.EmbeddingAdam())
