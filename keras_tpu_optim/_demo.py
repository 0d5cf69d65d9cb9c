"""The demo: train a small model with keras_tpu_optim.Adafactor and compare optimizer state."""

from __future__ import annotations

import argparse
import os


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m keras_tpu_optim", description=__doc__)
    parser.add_argument("--backend", choices=["tensorflow", "jax", "torch"], default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (used by the tests)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    import keras
    import numpy as np

    import keras_tpu_optim as kto

    steps = 4 if args.quick else args.steps
    width, vocab, seq = (32, 256, 16) if args.quick else (256, 4000, 64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(steps * 16, seq))
    targets = np.roll(tokens, -1, axis=1)

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((seq,), dtype="int32")
        x = keras.layers.Embedding(vocab, width)(inputs)
        x = keras.layers.Dense(4 * width, activation="gelu")(x)
        x = keras.layers.Dense(width)(x)
        outputs = keras.layers.Dense(vocab)(x)
        return keras.Model(inputs, outputs)

    rows = []
    for label, optimizer in [
        ("keras_tpu_optim.Adafactor", kto.Adafactor()),
        ("keras.optimizers.Adafactor", keras.optimizers.Adafactor()),
    ]:
        print(f"\n{label} on {keras.backend.backend()}:")
        m = model()
        m.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = m.fit(tokens, targets, batch_size=16, epochs=1, verbose=1)
        params = sum(int(np.prod(v.shape)) for v in m.trainable_variables)
        state = sum(
            int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in optimizer.variables
        )
        rows.append((label, history.history["loss"][-1], state, state / (4 * params)))
    print(f"\n{'optimizer':<28} {'final loss':>10} {'state bytes':>12} {'state/params':>13}")
    for label, loss, state, ratio in rows:
        print(f"{label:<28} {loss:>10.4f} {state:>12,} {ratio:>13.4f}")
    return 0
