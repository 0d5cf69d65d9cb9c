"""TF gradients, dense or `tf.IndexedSlices`: their entries, shape, scaling and dense form."""

from __future__ import annotations

import tensorflow as tf


def sparse_entries(gradient):
    """`(indices, values)` of a `tf.IndexedSlices` as tensors (TF accepts Python sequences too)."""
    return tf.convert_to_tensor(gradient.indices), tf.convert_to_tensor(gradient.values)


def gradient_values(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return sparse_entries(gradient)[1]
    return gradient


def gradient_shape(gradient, variable) -> tuple:
    if isinstance(gradient, tf.IndexedSlices):
        # Rows along axis 0, the rest must match.
        return (variable.shape[0],) + tuple(sparse_entries(gradient)[1].shape[1:])
    return tuple(gradient.shape)


def unscale(gradient, scale):
    if isinstance(gradient, tf.IndexedSlices):
        indices, values = sparse_entries(gradient)
        return tf.IndexedSlices(values / scale, indices, gradient.dense_shape)
    return gradient / scale


def densify(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        indices, values = sparse_entries(gradient)
        return tf.convert_to_tensor(tf.IndexedSlices(values, indices, gradient.dense_shape))
    return gradient
