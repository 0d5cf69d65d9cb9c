"""Writes the `.keras` files saved by keras_tpu_optim 0.1.0 that `tests/test_saved_0_1_0.py` loads.

THIS MUST BE RUN WITH THE 0.1.0 PACKAGE, not the current one: the point of the
files is that they were written by the released code. From a separate checkout
of the 0.1.0 release (the files were made from commit
e3e809989b1c3c59c258e43ca9368f8c51217e71):

    git worktree add /tmp/kto-0.1.0 e3e809989b1c3c59c258e43ca9368f8c51217e71
    PYTHONPATH=/tmp/kto-0.1.0 KERAS_BACKEND=jax python tests/data/make_0_1_0_files.py

The script refuses to run unless `keras_tpu_optim.__version__ == "0.1.0"` and
the package comes from another checkout than the one holding this script (the
development tree may still say 0.1.0 before a release), and writes next to
itself:

- `adafactor_0_1_0.keras`: Dense(8 -> 6) (a factored 2-D kernel and an
  unfactored bias) trained 3 steps with
  `Adafactor(learning_rate=0.01, beta_1=0.9)`: row and column statistics of the
  kernel, the bias's full second moment, and momenta of both.
- `embedding_adam_0_1_0.keras`: Embedding(50, 4) -> mean over 3 ids ->
  Dense(4 -> 1) trained 3 steps with
  `EmbeddingAdam(0.01, clipvalue=1.0, weight_decay=1e-3, use_ema=True)`:
  momenta and velocities of every variable, and the EMA averages.

The files were written with keras 3.15.1 on the JAX backend. They are the test
data; do not regenerate them with a later version of the package (that would
test nothing). The tests read the expected optimizer values from the files
themselves, so the script need not be rerun to update any expectation.
"""

import os
import sys

import numpy as np

import keras

import keras_tpu_optim as kto

HERE = os.path.dirname(os.path.abspath(__file__))
_THIS_CHECKOUT = os.path.dirname(os.path.dirname(HERE))
_PACKAGE_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(kto.__file__)))
if kto.__version__ != "0.1.0" or os.path.realpath(_PACKAGE_CHECKOUT) == os.path.realpath(
    _THIS_CHECKOUT
):
    sys.exit(
        "make_0_1_0_files.py must be run with the released keras_tpu_optim 0.1.0 from a separate "
        f"checkout (PYTHONPATH=<0.1.0 checkout>); this is {kto.__version__} from {kto.__file__}."
    )
STEPS, BATCH = 3, 8


def adafactor_model():
    inputs = keras.Input((8,), name="features")
    outputs = keras.layers.Dense(6, name="dense")(inputs)
    return keras.Model(inputs, outputs, name="adafactor_0_1_0")


def adafactor_data(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 6)) / 3.0).astype("float32")
    return x, y


def embedding_adam_model():
    ids = keras.Input((3,), dtype="int32", name="ids")
    rows = keras.layers.Embedding(50, 4, name="table")(ids)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(rows)
    score = keras.layers.Dense(1, name="score")(pooled)
    return keras.Model(ids, score, name="embedding_adam_0_1_0")


def embedding_adam_data(n):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, size=(n, 3)).astype("int32")  # touches some rows, not all
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def train_and_save(model, optimizer, data, filename):
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data(STEPS * BATCH)
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        model.train_on_batch(x[batch], y[batch])
    path = os.path.join(HERE, filename)
    model.save(path)
    print(
        f"{path}: {os.path.getsize(path)} bytes, {len(model.optimizer.variables)} optimizer variables"
    )


def main():
    keras.utils.set_random_seed(0)
    train_and_save(
        adafactor_model(),
        kto.Adafactor(learning_rate=0.01, beta_1=0.9),
        adafactor_data,
        "adafactor_0_1_0.keras",
    )
    keras.utils.set_random_seed(0)
    train_and_save(
        embedding_adam_model(),
        kto.EmbeddingAdam(0.01, clipvalue=1.0, weight_decay=1e-3, use_ema=True),
        embedding_adam_data,
        "embedding_adam_0_1_0.keras",
    )


if __name__ == "__main__":
    main()
