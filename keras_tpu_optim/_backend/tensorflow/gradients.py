"""TF gradients, dense or `tf.IndexedSlices`: their entries, shape, scaling and dense form."""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_optim import _private
from keras_tpu_optim._math import sparse_rows


def sparse_entries(gradient):
    """`(indices, values)` of a `tf.IndexedSlices` as tensors (TF accepts Python sequences too)."""
    return tf.convert_to_tensor(gradient.indices), tf.convert_to_tensor(gradient.values)


def gradient_values(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return sparse_entries(gradient)[1]
    return gradient


def checked_gradient(gradient, variable, mismatch):
    """`gradient` with the variable's static shape (an IndexedSlices: its values' rows), checked: a static
    difference raises `ValueError(mismatch(shape))`, an unknown dimension is checked when it runs."""
    sparse = isinstance(gradient, tf.IndexedSlices)
    indices, values = sparse_entries(gradient) if sparse else (None, tf.convert_to_tensor(gradient))
    start = 1 if sparse else 0  # an IndexedSlices' values: one row per index, the rest must match
    want = tf.TensorShape(variable.shape[start:])
    have = values.shape[start:] if values.shape.rank is not None else None
    if have is not None and not have.is_compatible_with(want):
        raise ValueError(mismatch(_described(variable, have, sparse)))
    if have is not None and have.is_fully_defined():
        return gradient
    actual = tf.shape(values)[start:]
    if have is None:  # Unknown rank: compare the rank first.
        same = tf.cond(
            tf.equal(tf.size(actual), want.rank),
            lambda: tf.reduce_all(tf.equal(actual, want.as_list())),
            lambda: tf.constant(False),
        )
    else:
        same = tf.reduce_all(tf.equal(actual, want.as_list()))
    message = mismatch(_described(variable, have, sparse))
    full = tf.TensorShape([None] * start).concatenate(want)
    if _private.tf_in_xla_context():
        # XLA drops the assertion and checks the shape when it compiles.
        values = tf.ensure_shape(values, full)
    else:
        # Not `ensure_shape`: TF's shape inference would raise its own message before the assertion runs.
        with tf.control_dependencies(
            [tf.debugging.Assert(same, [message, "Its shape at run time:", tf.shape(values)])]
        ):
            values = tf.identity(values)
        values.set_shape(full)
    return tf.IndexedSlices(values, indices, gradient.dense_shape) if sparse else values


def _described(variable, have, sparse):
    """The gradient's static shape as the error shows it (None: unknown), an IndexedSlices' as its dense shape."""
    if have is None:
        return "<unknown>"
    shape = tuple(have.as_list())
    return (variable.shape[0],) + shape if sparse else shape


def unscale(gradient, scale):
    if isinstance(gradient, tf.IndexedSlices):
        indices, values = sparse_entries(gradient)
        return tf.IndexedSlices(values / scale, indices, gradient.dense_shape)
    return gradient / scale


def in_table(indices, values, num_rows):
    """The entries whose ids name rows of the table (`sparse_rows.in_table`): under XLA the others moved
    past the table, where XLA's gathers clip and its scatters drop them; elsewhere (TF's kernels refuse
    them) removed."""
    if _private.tf_in_xla_context():
        return sparse_rows.in_table(indices, tf.cast(num_rows, indices.dtype)), values
    kept = tf.where(tf.logical_and(indices >= 0, indices < tf.cast(num_rows, indices.dtype)))[:, 0]
    return tf.gather(indices, kept), tf.gather(values, kept)


def densify(gradient):
    """A dense gradient; an IndexedSlices' duplicates summed, its ids out of range dropped."""
    if isinstance(gradient, tf.IndexedSlices) and gradient.dense_shape is not None:
        shape = tf.convert_to_tensor(gradient.dense_shape)
        indices, values = in_table(*sparse_entries(gradient), shape[0])
        return tf.math.unsorted_segment_sum(values, indices, tf.cast(shape[0], indices.dtype))
    return tf.convert_to_tensor(gradient)
