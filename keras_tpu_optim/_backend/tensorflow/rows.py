"""TensorFlow: the touched rows of a table, from `tf.IndexedSlices` or a dense gradient, updated in place."""

from __future__ import annotations

import functools

import tensorflow as tf

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_function,
    compiling_helps,
    native_variable,
    platform_of,
)
from keras_tpu_optim._backend.tensorflow.gradients import in_table
from keras_tpu_optim._math import embedding_adam as adam_math


def sparse_step(targets, ids, values, update_rows, *, lazy, accumulate_duplicates, cache):
    """EmbeddingAdam's step of `targets` (the table, then its slots) with the sparse gradient `(ids, values)`,
    in place: duplicate ids summed (`accumulate_duplicates`) or the last occurrence kept, ids outside the
    table dropped, untouched rows keeping their bits. Outside XLA and `tf.distribute`, one XLA computation
    (eagerly its entries padded to a bucket, the options' numbers its arguments), the ids numbered by TF's
    hash before it; a half-width table on CPU is grouped, gathered and scattered by TF's kernels around
    it (`scatters_by_kernels`). Without `lazy`, every row steps."""
    targets = [native_variable(t) for t in targets]
    num_rows = tf.shape(targets[0], out_type=ids.dtype)[0]
    ids, values = in_table(ids, values, num_rows)
    if not lazy:
        dense = tf.math.unsorted_segment_sum(values, ids, num_rows)
        neutral.dense_row_update(update_rows, dense, targets[0], targets[1:])
        return
    if _private.in_stateless_scope() or not compiling_helps():
        _sparse_row_update(
            update_rows, ids, values, targets, accumulate_duplicates=accumulate_duplicates
        )
        return
    structure, arguments = update_rows.split()
    if tf.executing_eagerly():
        ids, values = sparse_rows.padded(ids, values)
    # The ids numbered by TF's hash, outside XLA: a fraction of the cost of XLA's sort.
    group = tf.unique(ids).idx
    if scatters_by_kernels(targets[0]):
        compute = compiled_function(
            cache, ("row_values", structure), lambda: functools.partial(_row_values, structure)
        )
        _sparse_row_update(
            lambda grad_rows, *rows, ids: compute(grad_rows, rows, ids, arguments),
            ids,
            values,
            targets,
            accumulate_duplicates=accumulate_duplicates,
            group=group,
        )
        return
    update = compiled_function(
        cache,
        ("lazy_row_update", structure, accumulate_duplicates),
        lambda: functools.partial(_row_step, structure, accumulate_duplicates),
    )
    update(ids, group, values, targets, arguments)


def dense_row_update(update_rows, gradient, variable, slots):
    """The lazy step of a dense gradient: its touched rows (`touched_row_mask`) updated in place."""
    targets = [native_variable(variable)] + [native_variable(s) for s in slots]
    ids = tf.cast(tf.where(adam_math.touched_row_mask(gradient))[:, 0], tf.int32)
    new_rows = update_rows(tf.gather(gradient, ids), *(tf.gather(t, ids) for t in targets), ids=ids)
    for target, new in zip(targets, new_rows):
        _scatter(target, ids, new)


def _scatter(target, ids, rows):
    target.scatter_update(tf.IndexedSlices(rows, ids))
    return target


# `sparse_rows.sparse_row_update` in place, the ids ranked by an argsort (`id_ranks`) under XLA.
_sparse_row_update = functools.partial(
    sparse_rows.sparse_row_update, gather=tf.gather, scatter=_scatter, search=False
)


def scatters_by_kernels(table) -> bool:
    """Whether `sparse_step` leaves the gathers and scatters to TF's kernels: a bfloat16/float16 table on CPU,
    whose scatter XLA's CPU backend evaluates in float32 through a copy of the whole table (TF's kernels
    scatter its rows in place)."""
    return tf.as_dtype(table.dtype) in (tf.bfloat16, tf.float16) and platform_of(table) == "cpu"


def _row_step(structure, accumulate_duplicates, indices, group, values, targets, arguments):
    # No strategy here (`compiling_helps`): the tf.Variables' own scatter.
    _sparse_row_update(
        adam_math.RowUpdate.joined(structure, arguments),
        indices,
        values,
        targets,
        accumulate_duplicates=accumulate_duplicates,
        group=group,
        scatter=tf.compat.v1.scatter_update,
    )


def _row_values(structure, grad_rows, rows, ids, arguments):
    return adam_math.RowUpdate.joined(structure, arguments)(grad_rows, *rows, ids=ids)
