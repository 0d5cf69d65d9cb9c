"""TensorFlow: the touched rows of a table, from `tf.IndexedSlices` or a dense gradient, updated in place."""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_function,
    compiling_helps,
    native_variable,
)
from keras_tpu_optim._backend.tensorflow.gradients import in_table, sparse_entries
from keras_tpu_optim._math import embedding_adam as adam_math


def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates):
    """Update only the rows present in `gradient` by `update_rows` (an `adam_math.RowUpdate`); duplicate ids
    summed (`accumulate_duplicates`) or the last occurrence kept. Untouched rows keep their bits."""
    targets = [native_variable(variable)] + [native_variable(s) for s in slots]
    if isinstance(gradient, tf.IndexedSlices):
        entries = in_table(*sparse_entries(gradient), tf.shape(targets[0])[0])
        sparse_row_update(update_rows, *entries, targets, accumulate_duplicates)
        return
    ids = tf.cast(tf.where(adam_math.touched_row_mask(gradient))[:, 0], tf.int32)
    new_rows = update_rows(tf.gather(gradient, ids), *(tf.gather(t, ids) for t in targets), ids=ids)
    for target, new in zip(targets, new_rows):
        _scatter(target, ids, new)


def sparse_row_update(update_rows, indices, values, targets, accumulate_duplicates, group=None):
    """`sparse_rows.sparse_row_update` in place, the ids ranked by an argsort (`id_ranks`) under XLA."""
    options = dict(gather=tf.gather, scatter=_scatter, group=group, search=False)
    sparse_rows.sparse_row_update(
        update_rows,
        indices,
        values,
        targets,
        accumulate_duplicates=accumulate_duplicates,
        **options,
    )


def _scatter(target, ids, rows):
    target.scatter_update(tf.IndexedSlices(tf.cast(rows, target.dtype), ids))
    return target


def compiled_update_applies(gradient) -> bool:
    """Whether `compiled_lazy_row_update` takes this gradient: an IndexedSlices outside XLA and tf.distribute."""
    return isinstance(gradient, tf.IndexedSlices) and compiling_helps()


def scatters_by_kernels(variable, platform) -> bool:
    """Whether `compiled_lazy_row_update` leaves the gathers and scatters to TF's kernels: a
    bfloat16/float16 table on CPU, whose scatter XLA's CPU backend evaluates in float32 through a copy
    of the whole table (TF's kernels scatter its rows in place)."""
    half = tf.as_dtype(native_variable(variable).dtype) in (tf.bfloat16, tf.float16)
    return half and platform == "cpu"


def compiled_lazy_row_update(
    cache, update_rows, gradient, variable, slots, *, accumulate_duplicates, by_kernels=False
):
    """`sparse_row_update` of an IndexedSlices gradient outside XLA, as one XLA computation (eagerly its
    entries padded to a bucket, the options' numbers arguments); with `by_kernels` TF's kernels group,
    gather and scatter the rows and the computation computes the new rows alone."""
    structure, arguments = update_rows.split()
    targets = [native_variable(variable)] + [native_variable(s) for s in slots]
    indices, values = in_table(*sparse_entries(gradient), tf.shape(targets[0])[0])
    if tf.executing_eagerly():
        indices, values = sparse_rows.padded(indices, values)
    # The ids numbered by TF's hash, outside XLA: a fraction of the cost of XLA's sort.
    _, group = tf.unique(indices)
    if by_kernels:
        compute = compiled_function(
            cache, ("row_values", structure), lambda: _compilable_rows(structure)
        )
        update_rows = lambda grad_rows, *rows, ids: compute(grad_rows, rows, ids, arguments)
        sparse_row_update(update_rows, indices, values, targets, accumulate_duplicates, group)
        return
    update = compiled_function(
        cache,
        ("lazy_row_update", structure, accumulate_duplicates),
        lambda: _compilable_update(structure, accumulate_duplicates),
    )
    update(indices, group, values, targets, arguments)


def _compilable_update(structure, accumulate_duplicates):
    def row_step(indices, group, values, targets, arguments):
        update_rows = adam_math.RowUpdate.joined(structure, arguments)
        sparse_row_update(update_rows, indices, values, targets, accumulate_duplicates, group)

    return row_step


def _compilable_rows(structure):
    def row_values(grad_rows, rows, ids, arguments):
        return adam_math.RowUpdate.joined(structure, arguments)(grad_rows, *rows, ids=ids)

    return row_values
