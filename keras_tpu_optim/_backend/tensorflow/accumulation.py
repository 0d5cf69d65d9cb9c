"""TensorFlow: the rows of `tf.IndexedSlices` gradients accumulated in place (`keras_tpu_optim._accumulation`)."""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_optim import _private
from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._backend.tensorflow._compile import compiled_where_it_helps, native_variable
from keras_tpu_optim._backend.tensorflow.gradients import sparse_entries as _entries


def sparse_entries(gradient):
    """`(ids, values)` of an IndexedSlices; None for a dense gradient."""
    if not isinstance(gradient, tf.IndexedSlices):
        return None
    indices, values = _entries(gradient)
    return tf.cast(indices, tf.int32), values


def add_to_window(accumulator, window, ids, values, number, *, cache):
    """Add the rows `values` into `accumulator` at `ids` and mark them `number` in `window`; outside XLA
    compiled with XLA (TF's scatter kernels are slow on a large table)."""
    targets = [native_variable(accumulator), native_variable(window)]
    add = compiled_where_it_helps(cache, "add_to_window", _add_to_window)
    add(ids, values, tf.cast(number, tf.int32), targets)


def _add_to_window(ids, values, number, targets):
    accumulator, window = targets
    accumulator.scatter_add(tf.IndexedSlices(tf.cast(values, accumulator.dtype), ids))
    window.scatter_update(
        tf.IndexedSlices(tf.fill(tf.shape(ids), tf.cast(number, window.dtype)), ids)
    )


def window_sizes(like, window, steps):
    """The lengths of a window's row list to try, smallest first: dynamic outside XLA; under XLA `steps` times
    this gradient's ids (enough when every micro-batch has as many) if fewer than the rows, then the rows."""
    if not _private.tf_in_xla_context():
        return (None,)
    num_rows, ids = int(window.shape[0]), like.indices.shape[0]
    if ids is None or steps * ids >= num_rows:
        return (num_rows,)
    return (steps * ids, num_rows)


def window_count(window, number):
    """How many rows the window has (one scan of `window`)."""
    return tf.reduce_sum(tf.cast(tf.equal(native_variable(window), number), tf.int32))


def window_gradient(accumulator, window, number, steps, like, size, *, cache):
    """The window's rows (`window == number`) of `accumulator / steps`, as an IndexedSlices; those rows zeroed.
    Listed padded to a bucket outside XLA (`size` None), under XLA in `size` entries padded past the table."""
    targets = [native_variable(accumulator), native_variable(window)]
    if size is None:
        ids, real = _bucketed_window_rows(targets[1], number)
        window_mean = compiled_where_it_helps(cache, "window_mean", _window_mean)
        mean = window_mean(ids, real, float(steps), targets)
    else:
        ids, real = _static_window_rows(targets[1], number, size)
        mean = _window_mean(ids, real, float(steps), targets)
    return tf.IndexedSlices(tf.cast(mean, like.values.dtype), ids, like.dense_shape)


def _window_mean(ids, real, steps, targets):
    """The rows `ids` of the accumulator over `steps` (0 where not `real`); those rows then zeroed."""
    table = targets[0]
    summed = tf.gather(table, ids)
    # Zeros derived from the rows read (0 for non-finite ones too): the zeroing is then
    # ordered after the read without a copy of the accumulator.
    table.scatter_update(
        tf.IndexedSlices(
            tf.where(tf.math.is_finite(summed), summed * 0, tf.zeros_like(summed)), ids
        )
    )
    real = tf.reshape(
        real, tf.concat([tf.shape(real), tf.ones([tf.rank(summed) - 1], tf.int32)], 0)
    )
    return tf.where(real, summed / steps, tf.zeros_like(summed))


def _bucketed_window_rows(window, number):
    """`(ids, real)`: the window's rows, increasing, padded to a bucket of lengths (`sparse_rows.padded`)."""
    listed = tf.cast(tf.where(tf.equal(window, number))[:, 0], tf.int32)
    (ids,) = sparse_rows.padded(listed)
    return ids, tf.range(tf.shape(ids)[0]) >= tf.shape(ids)[0] - tf.shape(listed)[0]


def _static_window_rows(window, number, size):
    """`(ids, real)` of static length `size`: the window's rows, increasing, then `rows` (past the end)."""
    num_rows = window.shape[0]
    mask = tf.equal(window, number)
    position = tf.cumsum(tf.cast(mask, tf.int32)) - 1
    target = tf.where(mask & (position < size), position, size)
    ids = tf.scatter_nd(target[:, None], tf.range(num_rows), [size + 1])[:size]
    real = tf.range(size) < tf.reduce_sum(tf.cast(mask, tf.int32))
    return tf.where(real, ids, num_rows), real
