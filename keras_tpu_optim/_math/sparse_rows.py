"""EmbeddingAdam's sparse row update and its helpers, in `keras.ops`: one rule each, for every backend.

A sparse gradient's entries name rows, perhaps several times. They are
grouped (`grouped_rows`: by a sort, or by numbers a backend computes more
cheaply, TF's `tf.unique` outside XLA): each distinct id once, with the sum
of its rows (in float32) or its last occurrence's, so that each touched row of the
table and its slots is read and written once (`sparse_row_update`). An eager
step compiled for static shapes pads its entries to a bucket of lengths
(`bucket`, `padded`), so that one compilation serves every length in it.
"""

from __future__ import annotations

from keras import ops

# The smallest padded length of an eager sparse step: small steps share one compilation.
MIN_BUCKET = 64


def bucket(count):
    """`count` rounded up to a power of two, at least `MIN_BUCKET` (0 stays 0).

    A Python int for an int; a tensor for a tensor (a length known only when the step runs).
    """
    if isinstance(count, int):
        return 0 if count == 0 else max(MIN_BUCKET, 1 << (count - 1).bit_length())
    # The same rule on a tensor: the highest bit of `count - 1` smeared into every lower bit, plus one.
    smeared = ops.maximum(count, MIN_BUCKET) - 1
    for shift in (1, 2, 4, 8, 16):
        smeared = ops.bitwise_or(smeared, ops.right_shift(smeared, shift))
    return ops.where(ops.equal(count, 0), 0, smeared + 1)


def padded(ids, *rows):
    """`(ids, *rows)` padded to `bucket(len(ids))` entries: copies of the first id with zero rows, before them.

    The padding names a row the entries name: summed with that row's entries
    it adds nothing, and where the last occurrence wins it is never last. So it
    is a valid gradient for every path (no id past the table, which TF's own
    kernels refuse).
    """
    count = ops.shape(ids)[0]
    padding = bucket(count) - count
    if isinstance(padding, int) and padding == 0:
        return (ids, *rows)
    ids = ops.concatenate([ops.take(ids, ops.zeros((padding,), "int32")), ids], axis=0)
    rows = tuple(
        ops.concatenate([ops.zeros((padding, *r.shape[1:]), r.dtype), r], axis=0) for r in rows
    )
    return (ids, *rows)


def grouped_rows(ids, rows, accumulate_duplicates, group=None):
    """The distinct ids, each with its group's row (the sum of its duplicates, or the last occurrence's).

    `group` numbers each entry's id from 0 (as `tf.unique`'s hash does,
    outside XLA, where it is cheaper than a sort); by default the ids' rank
    among the distinct ids, by a sort. Static shapes (as many entries as
    given): the distinct ids come first, in the order of their numbers; the
    remaining entries repeat the last of them with its row, so their
    scatters agree with it, and a table row is read and written once per
    distinct id (the repeated row stays in cache).
    """
    count = ops.shape(ids)[0]
    if isinstance(count, int) and count == 0:
        return ids, rows
    if group is None:
        group = _sorted_groups(ids, count)
    # Entry i carries group min(i, groups - 1): every group once, then the last one repeated.
    slot = ops.minimum(ops.arange(count, dtype="int32"), ops.max(group))
    distinct = ops.take(ops.segment_max(ids, group, num_segments=count), slot, axis=0)
    if accumulate_duplicates:
        # Summed in float32, the row update's precision, whatever the gradient's dtype.
        sums = ops.segment_sum(ops.cast(rows, "float32"), group, num_segments=count)
        return distinct, ops.take(sums, slot, axis=0)
    last = ops.segment_max(ops.arange(count, dtype="int32"), group, num_segments=count)
    return distinct, ops.take(rows, ops.take(last, slot, axis=0), axis=0)


def _sorted_groups(ids, count):
    """Each entry's id's rank among the distinct ids (int32), by a sort."""
    order = ops.cast(ops.argsort(ids), "int32")
    sorted_ids = ops.take(ids, order, axis=0)
    starts = ops.concatenate(
        [ops.ones_like(sorted_ids[:1], "bool"), ops.not_equal(sorted_ids[1:], sorted_ids[:-1])]
    )
    ranks = ops.cumsum(ops.cast(starts, "int32")) - 1
    return ops.scatter(ops.expand_dims(order, 1), ranks, (count,))


def sparse_row_update(
    update_rows, ids, rows, tables, *, accumulate_duplicates, gather, scatter, group=None
):
    """The tables after updating only the rows `ids`, with gradient rows `rows` (one per id).

    `tables` are the table and its slots; `update_rows(grad_rows,
    weight_rows, *slot_rows)` returns their new rows. Duplicate ids are
    summed (`accumulate_duplicates`) or the last occurrence wins
    (`grouped_rows`). A backend passes how it reads and writes rows:
    `gather(table, ids)`, and `scatter(table, ids, rows) -> table` (rows cast
    to the table's dtype; TF's variables in place, JAX's arrays functionally),
    and may pass the ids' `group` numbers (`grouped_rows`).
    """
    ids, rows = grouped_rows(ids, rows, accumulate_duplicates, group)
    new_rows = update_rows(rows, *(gather(t, ids) for t in tables))
    return tuple(scatter(t, ids, new) for t, new in zip(tables, new_rows))
