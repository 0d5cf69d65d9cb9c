"""Building and stepping both optimizers changes nothing outside their variables.

Checked against what the process itself records (the environment's reads,
JAX's monitoring listeners), not against the code under test.
"""

import os
import sys

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()


PACKAGE = os.path.dirname(kto.__file__)


class RecordingEnviron(dict):
    """`os.environ` as a dict that records every key read from the package's own code."""

    def __init__(self, data):
        super().__init__(data)
        self.read = []

    def _record(self, key):
        frame = sys._getframe(2)
        if frame.f_code is os.getenv.__code__:
            frame = frame.f_back
        if frame.f_code.co_filename.startswith(PACKAGE):
            self.read.append((key, frame.f_code.co_filename))

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def a_step_of_each_optimizer():
    table = keras.Variable(
        np.ones((200_000, 64), "float32"), name="table"
    )  # 51 MB: above any size threshold
    kernel = keras.Variable(np.ones((1024, 4096), "float32"), name="kernel")
    embedding_adam, adafactor = kto.EmbeddingAdam(0.01), kto.Adafactor(0.01)
    embedding_adam.build([table])
    adafactor.build([kernel])
    gradient = np.zeros((200_000, 64), "float32")
    gradient[3] = 1.0
    embedding_adam.apply([keras.ops.convert_to_tensor(gradient)], [table])
    adafactor.apply([keras.ops.ones((1024, 4096))], [kernel])
    return table, embedding_adam


def test_build_and_steps_read_no_environment_variable(monkeypatch):
    recording = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recording)
    a_step_of_each_optimizer()
    assert recording.read == []


@pytest.mark.skipif(BACKEND != "jax", reason=f"JAX's compilation listeners; this run is {BACKEND}")
def test_build_and_steps_register_no_listener():
    from jax._src import monitoring

    listeners = (len(monitoring._event_duration_secs_listeners), len(monitoring._event_listeners))
    a_step_of_each_optimizer()
    assert (
        len(monitoring._event_duration_secs_listeners),
        len(monitoring._event_listeners),
    ) == listeners
