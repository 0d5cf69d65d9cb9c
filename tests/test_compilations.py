"""Eager steps compile once per structure: changing an option's number (or the learning rate) compiles nothing.

Counted from the frameworks' own records: JAX's compile events, TF's tracing
counts of the functions our eager steps call.
"""

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND == "torch", reason="eager torch compiles nothing; this run is torch"
)


class Compilations:
    """Compilations (JAX) or traces (TF) since the last `take()`."""

    def __init__(self):
        self.count = 0
        if BACKEND == "jax":
            import jax

            def listen(event, duration_secs, **kwargs):
                if event == "/jax/core/compile/backend_compile_duration":
                    self.count += 1

            jax.monitoring.register_event_duration_secs_listener(listen)
            self._stop = lambda: jax._src.monitoring.unregister_event_duration_listener(listen)
        else:
            self._stop = lambda: None

    def take(self):
        if BACKEND == "tensorflow":
            from keras_tpu_optim._backend.tensorflow import _compile

            total = sum(f.experimental_get_tracing_count() for f in _compile._eager.values())
            new, self.count = total - self.count, total
            return new
        new, self.count = self.count, 0
        return new


@pytest.fixture
def compilations():
    counter = Compilations()
    counter.take()
    yield counter
    counter._stop()


def steps(optimizer, variable, gradients, rows=False):
    for gradient in gradients:
        if (
            rows and BACKEND == "tensorflow"
        ):  # TF's compiled row path takes IndexedSlices (dense: plain TF ops)
            import tensorflow as tf

            ids = np.flatnonzero(np.abs(gradient).sum(axis=1))
            gradient = tf.IndexedSlices(
                tf.constant(gradient[ids]), tf.constant(ids), tf.constant(gradient.shape)
            )
        else:
            gradient = keras.ops.convert_to_tensor(gradient)
        optimizer.apply([gradient], [variable])


def test_embedding_adam_numbers_share_one_compilation(compilations):
    rng = np.random.default_rng(0)
    table = keras.Variable(rng.normal(size=(300, 8)).astype("float32"))
    gradients = [
        rng.normal(size=(300, 8)).astype("float32") * (rng.random((300, 1)) < 0.1) for _ in range(3)
    ]
    optimizer = kto.EmbeddingAdam(0.01, clip_weight_max=5.0, weight_decay_factor=0.1, clipvalue=2.0)
    optimizer.build([table])
    steps(optimizer, table, gradients[:1], rows=True)
    assert compilations.take() > 0  # the counter sees the first step's compilation
    optimizer.epsilon, optimizer.clip_weight_max, optimizer.weight_decay_factor = 1e-3, 4.0, 0.2
    optimizer.clipvalue = 1.5
    optimizer.learning_rate = 0.02
    steps(optimizer, table, gradients[1:], rows=True)
    assert compilations.take() == 0


def test_adafactor_numbers_share_one_compilation(compilations):
    rng = np.random.default_rng(1)
    kernel = keras.Variable(rng.normal(size=(24, 16)).astype("float32"))
    gradients = [rng.normal(size=(24, 16)).astype("float32") for _ in range(3)]
    optimizer = kto.Adafactor(0.01, beta_1=0.9, beta_2_cap=0.99)
    optimizer.build([kernel])
    steps(optimizer, kernel, gradients[:1])
    assert compilations.take() > 0
    optimizer.clip_threshold, optimizer.epsilon_1, optimizer.epsilon_2 = 0.5, 1e-20, 1e-2
    optimizer.beta_2_decay, optimizer.beta_1, optimizer.beta_2_cap = -0.6, 0.8, 0.95
    optimizer.learning_rate = 0.02
    steps(optimizer, kernel, gradients[1:])
    assert compilations.take() == 0
