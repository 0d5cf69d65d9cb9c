"""Duplicate ids in a `tf.IndexedSlices` gradient: ours give the dense gradient's numbers, Keras's TF optimizers do not.

Keras's TF `Adafactor` and `Adam` square the IndexedSlices' values (`ops.square(gradient)`) before the
duplicate ids are summed, so their second moments hold a sum of squares where the dense gradient has
the square of the sum. The reference here is Keras's own optimizer on the densified gradient; ours
must give it from either form. Keras's optimizer on the IndexedSlices must still differ from it:
the README states this difference, and this test says when that statement stops being true.

TensorFlow only: it is the one backend where Keras hands an optimizer IndexedSlices (an Embedding's
gradient); JAX's and torch's `fit` give dense gradients.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "tf.IndexedSlices gradients are TensorFlow's: the other backends give Keras's optimizers dense gradients",
        allow_module_level=True,
    )

import tensorflow as tf  # noqa: E402 (after the skip: only the TensorFlow pass imports it)

SHAPE = (50, 8)
# Row 1 three times, row 3 twice, row 7 once.
IDS = [1, 3, 3, 7, 1, 1]
STEPS = 3
# Keras's sparse result differs from its dense one by more than this (in the largest element, relative
# to the largest change the dense steps made); rounding differences are near 1e-6.
KERAS_SPARSE_DIFFERENCE = 0.01


def _gradients():
    """Per step, the IndexedSlices gradient and the same gradient densified (duplicate rows summed)."""
    rng = np.random.default_rng(0)
    gradients = []
    for _ in range(STEPS):
        values = rng.normal(0.0, 0.5, size=(len(IDS), SHAPE[1])).astype(np.float32)
        dense = np.zeros(SHAPE, np.float32)
        np.add.at(dense, IDS, values)
        sparse = tf.IndexedSlices(
            tf.constant(values), tf.constant(IDS, tf.int32), tf.constant(SHAPE, tf.int32)
        )
        gradients.append((sparse, tf.constant(dense)))
    return gradients


def _train(make_optimizer, initial, gradients, form):
    """The variable after `STEPS` steps of `make_optimizer()` on the gradients' sparse or dense form."""
    variable = keras.Variable(initial, name="table")
    optimizer = make_optimizer()
    for sparse, dense in gradients:
        optimizer.apply([sparse if form == "sparse" else dense], [variable])
    return keras.ops.convert_to_numpy(variable)


CASES = {
    "adafactor": (
        lambda: kto.Adafactor(learning_rate=0.01),
        lambda: keras.optimizers.Adafactor(learning_rate=0.01),
    ),
    # Keras's Adam: every row updated every step (`lazy_adam=False`), epsilon outside the square root.
    "embedding_adam": (
        lambda: kto.EmbeddingAdam(
            learning_rate=0.05,
            beta_1=0.85,
            beta_2=0.97,
            epsilon=0.01,
            lazy_adam=False,
            sum_inside_sqrt=False,
        ),
        lambda: keras.optimizers.Adam(learning_rate=0.05, beta_1=0.85, beta_2=0.97, epsilon=0.01),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_ours_give_the_dense_gradients_numbers_where_keras_tf_optimizers_do_not(case):
    make_ours, make_keras = CASES[case]
    initial = np.random.default_rng(1).uniform(-1.0, 1.0, size=SHAPE).astype(np.float32)
    gradients = _gradients()

    expected = _train(make_keras, initial, gradients, "dense")
    moved = np.abs(expected - initial).max()
    assert moved > 0.01, "the reference steps barely moved the variable: nothing to compare"
    for form in ("sparse", "dense"):
        np.testing.assert_allclose(
            _train(make_ours, initial, gradients, form),
            expected,
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"ours on the {form} gradient against Keras on the dense one",
        )

    keras_sparse = _train(make_keras, initial, gradients, "sparse")
    difference = np.abs(keras_sparse - expected).max() / moved
    assert difference > KERAS_SPARSE_DIFFERENCE, (
        f"Keras's TF {type(make_keras()).__name__} on an IndexedSlices gradient with duplicate ids now gives "
        f"its dense gradient's numbers (relative difference {difference:.2g}): Keras no longer squares the "
        "values before summing duplicates. Update the README's statement of this difference ('Differences "
        "from Keras'), the demo's note (keras_tpu_optim/_demo.py) and this test."
    )
