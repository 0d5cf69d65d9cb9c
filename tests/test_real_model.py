"""A real transformer from a Keras model library, trained with `fit`: keras-hub's GPT-2.

A tiny `keras_hub.models.GPT2CausalLM` (random weights, nothing downloaded)
trains with our Adafactor and, from the same weights, with
`keras.optimizers.Adafactor`: with default arguments the two give the same
numbers, so the losses of every step and the final weights agree to float32
round-off. On TensorFlow the feed-forward kernels' gradients inside Keras's
traced train step have a partly unknown static shape (`(None, 64)` for a
`(16, 64)` kernel), which this model exercises in the CPU step in blocks.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

VOCABULARY, SEQUENCE, BATCH, STEPS = 64, 12, 4, 4


def _model():
    # Imported here, not at collection: keras-hub imports TensorFlow, whatever the backend.
    keras_hub = pytest.importorskip(
        "keras_hub", reason="keras-hub is a test requirement (requirements-nodeps.txt)"
    )
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=SEQUENCE,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCABULARY, (BATCH * STEPS, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH * STEPS, SEQUENCE), bool)}
    return x, tokens[:, 1:]


def _fit(optimizer, initial_weights=None):
    model = _model()
    if initial_weights is not None:
        model.set_weights(initial_weights)
    weights = model.get_weights()
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = _data()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=STEPS, steps_per_epoch=1, shuffle=False, verbose=0
    )
    return (
        weights,
        history.history["loss"],
        {v.path: keras.ops.convert_to_numpy(v) for v in model.weights},
    )


@pytest.mark.slow
def test_gpt2_fit_matches_keras_adafactor():
    learning_rate = 0.01
    initial, ours, our_weights = _fit(kto.Adafactor(learning_rate=learning_rate))
    _, theirs, their_weights = _fit(
        keras.optimizers.Adafactor(learning_rate=learning_rate), initial
    )
    assert len(ours) == STEPS and np.all(np.isfinite(ours))
    assert ours[-1] < ours[0], ours  # it trains
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert our_weights.keys() == their_weights.keys()
    for path, got in our_weights.items():
        if path.endswith("key/bias"):
            # The loss does not depend on the attention keys' bias (softmax ignores a constant shift):
            # its gradient is float32 round-off, whose sign an Adafactor update of a zero variable
            # follows. A step's update has an RMS of at most epsilon_2 * learning_rate there.
            assert np.sqrt(np.mean(np.square(got))) <= STEPS * 1e-3 * learning_rate * 1.01, path
            continue
        np.testing.assert_allclose(got, their_weights[path], rtol=1e-4, atol=1e-6, err_msg=path)
