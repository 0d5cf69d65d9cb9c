"""TensorFlow: the touched rows of a table, from `tf.IndexedSlices` or a dense gradient, updated in place.

Two row paths. An `IndexedSlices` takes `sparse_row_update`: duplicates
summed in the touched rows of a table-shaped target (`_accumulate_and_update`:
no sort), or, when the last occurrence wins, grouped by a stable sort with
static shapes (`grouped_rows`). It runs inlined where it is traced into XLA
(`jit_compile=True`) or inside a `tf.distribute` replica update, and as one
XLA computation of its own everywhere else (`compiled_lazy_row_update`: what
`fit` runs on a machine without an accelerator, and eager code), so that it
is never a chain of single TF kernels. A dense gradient takes its touched
rows (`touched_rows`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_optim._backend import blocks
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_function,
    compiling_helps,
    native_variable,
)
from keras_tpu_optim._backend.tensorflow.gradients import sparse_entries
from keras_tpu_optim._math import embedding_adam as adam_math


def grouped_rows(indices, values, accumulate_duplicates):
    """Duplicates summed, or the last occurrence kept, with static shapes: every id keeps its place, carrying its group's row.

    Duplicate ids get identical rows, hence identical updated rows: their
    scatters write the same values, in whatever order.
    """
    n = tf.shape(indices)[0]
    order = tf.argsort(indices, stable=True)
    ids = tf.gather(indices, order)
    starts = tf.concat([[True], tf.not_equal(ids[1:], ids[:-1])], 0)[:n]
    group = tf.cumsum(tf.cast(starts, tf.int32)) - 1
    # The sort is stable: the last of a group is the id's last occurrence.
    return ids, group_rows(tf.gather(values, order), group, accumulate_duplicates)


def group_rows(values, group, accumulate_duplicates):
    """Each row replaced by its group's: the group's sum, or its last row.

    `group[i]` in `[0, len(values))` names row i's group; the shape stays static.
    """
    n = tf.shape(values)[0]
    if accumulate_duplicates:
        return tf.gather(tf.math.unsorted_segment_sum(values, group, n), group)
    last = tf.math.unsorted_segment_max(tf.range(n), group, n)
    return tf.gather(values, tf.gather(last, group))


def touched_rows(gradient):
    """Indices of the rows of a dense gradient with any non-zero (or NaN) entry (`touched_row_mask`)."""
    return tf.cast(tf.where(adam_math.touched_row_mask(gradient))[:, 0], tf.int32)


def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates):
    """Update only the rows present in `gradient`; untouched rows keep their bits.

    `update_rows(grad_rows, weight_rows, *slot_rows)` returns the new
    `(weight_rows, *slot_rows)`. Duplicate ids of an IndexedSlices are summed
    (`accumulate_duplicates`) or the last occurrence wins.
    """
    targets = [native_variable(variable)] + [native_variable(s) for s in slots]
    if isinstance(gradient, tf.IndexedSlices):
        sparse_row_update(update_rows, *sparse_entries(gradient), targets, accumulate_duplicates)
        return
    ids = touched_rows(gradient)
    _update_in_place(update_rows, ids, tf.gather(gradient, ids), targets)


def sparse_row_update(update_rows, indices, values, targets, accumulate_duplicates):
    """The rows `indices` of `targets` updated with `values`, duplicates summed or the last occurrence kept."""
    accumulator = _accumulator(targets, values.dtype) if accumulate_duplicates else None
    if accumulator is not None:
        _accumulate_and_update(update_rows, indices, values, targets, accumulator)
        return
    ids, grad_rows = grouped_rows(indices, values, accumulate_duplicates)
    _update_in_place(update_rows, ids, grad_rows, targets)


def _update_in_place(update_rows, ids, grad_rows, targets):
    """Gather the rows `ids` of `targets`, update them, scatter them back.

    Duplicate ids must carry identical gradient rows: their scatters then
    write identical values, in whatever order.
    """
    new_rows = update_rows(grad_rows, *(tf.gather(t, ids) for t in targets))
    _scatter(targets, new_rows, ids)


def _scatter(targets, new_rows, ids):
    for target, rows in zip(targets, new_rows):
        target.scatter_update(tf.IndexedSlices(tf.cast(rows, target.dtype), ids))


def _accumulator(targets, grad_dtype):
    """The index of a target that can sum the gradient rows in place: float32 first, else the gradient's dtype.

    Only targets of the table's shape qualify (a rowwise second moment or a
    row step counter has one entry per row).
    """
    for dtype in (tf.float32, grad_dtype):
        for i, target in enumerate(targets):
            if target.dtype == dtype and target.shape == targets[0].shape:
                return i
    return None


def _accumulate_and_update(update_rows, indices, values, targets, i):
    """The lazy update under XLA, duplicates summed in the touched rows of `targets[i]`.

    No sort, no table-sized temporary: the old rows of every target are
    gathered; the accumulator's touched rows are zeroed and the gradient rows
    scatter-added into them (XLA's scatter adds duplicates); gathering them
    back gives every id its group's sum; the update then overwrites those
    rows with their new values. Duplicates carry identical rows, so their
    scatters write identical values.
    """
    old_rows = [tf.gather(t, indices) for t in targets]
    accumulator, old = targets[i], old_rows[i]
    # Zeros computed from the old rows and from the gradient rows (0 for non-finite ones too): with
    # a constant, XLA cannot see that the reads of the table come first (this gather, and a lookup
    # whose backward pass this is: `layers.Embedding`) and copies the whole table to keep them.
    zeros = _zeros_after(old) + tf.cast(_zeros_after(values), old.dtype)
    accumulator.scatter_update(tf.IndexedSlices(zeros, indices))
    accumulator.scatter_add(tf.IndexedSlices(tf.cast(values, accumulator.dtype), indices))
    grad_rows = tf.gather(accumulator, indices)
    _scatter(targets, update_rows(grad_rows, *old_rows), indices)


def _zeros_after(x):
    """Zeros of `x`'s shape that XLA computes from `x` (so after it): 0 where `x` is finite, 0 elsewhere."""
    return tf.where(tf.math.is_finite(x), x * 0, tf.zeros_like(x))


def compiled_update_applies(gradient) -> bool:
    """Whether `compiled_lazy_row_update` takes this gradient: an IndexedSlices outside XLA and tf.distribute."""
    return isinstance(gradient, tf.IndexedSlices) and compiling_helps()


def compiled_lazy_row_update(
    owner,
    row_function,
    options,
    learning_rate,
    gradient,
    variable,
    slots,
    *,
    accumulate_duplicates,
    ema_step=None,
):
    """`sparse_row_update` of an IndexedSlices gradient outside XLA, as one XLA computation.

    Without XLA every op of the row update is its own kernel. The shapes are
    those of the gradient (one compilation per batch size); eagerly, where
    sizes vary from call to call, the entries are padded to a power-of-two
    count of at least `blocks.MIN_BUCKET` (padding names row `rows`, past the
    end: XLA drops its scatters, and its clipped gathers feed only those), so
    that a compilation serves a bucket of sizes. The ids are checked first:
    XLA would clip an out-of-range id silently.

    `row_function(grad, weight, *slots, *, learning_rate, options,
    ema_step)` is the row update; the options' numbers are arguments of the
    compiled function (`adam_math.split_options`), so one compilation
    serves every value of them. `ema_step` (an integer scalar, or None) is
    passed through to it.
    """
    structure, option_values = adam_math.split_options(options)
    update = compiled_function(
        owner,
        ("lazy_row_update", row_function, structure, accumulate_duplicates),
        lambda: _compilable_update(row_function, structure, accumulate_duplicates),
    )
    targets = [native_variable(variable)] + [native_variable(s) for s in slots]
    indices, values = sparse_entries(gradient)
    indices = _checked_indices(indices, tf.shape(targets[0], out_type=indices.dtype)[0], variable)
    if tf.executing_eagerly():
        indices, values = _padded(indices, values, tf.shape(targets[0], out_type=indices.dtype)[0])
    ema_step = None if ema_step is None else tf.convert_to_tensor(ema_step)
    option_values = {name: tf.constant(value, tf.float32) for name, value in option_values.items()}
    update(indices, values, tf.convert_to_tensor(learning_rate), targets, ema_step, option_values)


def _padded(indices, values, num_rows):
    """The entries padded to a power-of-two count (at least `blocks.MIN_BUCKET`): id `num_rows`, zero values."""
    count = int(indices.shape[0])
    padding = blocks.bucket(count) - count
    if not padding:
        return indices, values
    indices = tf.concat([indices, tf.fill([padding], num_rows)], 0)
    values = tf.concat([values, tf.zeros([padding] + values.shape[1:].as_list(), values.dtype)], 0)
    return indices, values


def _checked_indices(indices, num_rows, variable):
    """`indices`, after checking they name rows of the table.

    XLA clips out-of-range gathers and drops out-of-range scatters; TF's own
    kernels raise. An index out of range is a bug upstream: say so rather than
    update nothing for it.
    """
    name = getattr(variable, "path", None) or getattr(variable, "name", "the table")
    message = f"EmbeddingAdam: the gradient of {name} has row indices outside [0, number of rows)"
    with tf.control_dependencies(
        [
            tf.debugging.assert_non_negative(indices, message=message),
            tf.debugging.assert_less(indices, num_rows, message=message),
        ]
    ):
        return tf.identity(indices)


def _compilable_update(row_function, structure, accumulate_duplicates):
    def update(indices, values, learning_rate, targets, ema_step, option_values):
        options = adam_math.joined_options(structure, option_values)

        def update_rows(*rows):
            return row_function(
                *rows, learning_rate=learning_rate, options=options, ema_step=ema_step
            )

        sparse_row_update(update_rows, indices, values, targets, accumulate_duplicates)

    return update
