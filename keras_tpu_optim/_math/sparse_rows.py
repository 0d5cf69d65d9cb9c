"""EmbeddingAdam's sparse row update and its helpers (grouping, padding to buckets), for every backend."""

from __future__ import annotations

from keras import ops

# The smallest padded length of an eager sparse step: small steps share one compilation.
MIN_BUCKET = 64


def bucket(count):
    """`count` (an int, or a tensor) rounded up to a power of two, at least `MIN_BUCKET` (0 stays 0)."""
    if isinstance(count, int):
        return 0 if count == 0 else max(MIN_BUCKET, 1 << (count - 1).bit_length())
    # The same rule on a tensor: the highest bit of `count - 1` smeared into every lower bit, plus one.
    smeared = ops.maximum(count, MIN_BUCKET) - 1
    for shift in (1, 2, 4, 8, 16):
        smeared = ops.bitwise_or(smeared, ops.right_shift(smeared, shift))
    return ops.where(ops.equal(count, 0), 0, smeared + 1)


def padded(ids, *rows):
    """`(ids, *rows)` padded to `bucket(len(ids))` entries with copies of the first id and zero rows, before
    them: they change nothing, are never an id's last occurrence, and name no row past the table."""
    count = ops.shape(ids)[0]
    padding = bucket(count) - count
    if isinstance(padding, int) and padding == 0:
        return (ids, *rows)
    ids = ops.concatenate([ops.take(ids, ops.zeros((padding,), "int32")), ids], axis=0)
    rows = tuple(
        ops.concatenate([ops.zeros((padding, *r.shape[1:]), r.dtype), r], axis=0) for r in rows
    )
    return (ids, *rows)


def out_of_range(ids, num_rows):
    """Where `ids` are outside `[0, num_rows)`."""
    return ops.logical_or(ids < 0, ids >= num_rows)


def clipped(ids, num_rows):
    """`ids` past the table read as its last row (the caller masks them). A typed bound: Keras promotes an
    int32 tensor and a Python int to `floatx` on JAX when that is a half dtype."""
    return ops.minimum(ids, ops.convert_to_tensor(num_rows - 1, ids.dtype))


def in_table(ids, num_rows, outside=None):
    """`ids` with every id outside `[0, num_rows)` (`outside`, where known) moved past the table, to `num_rows`:
    such an id trains nothing (docs/algorithms.md#ids-out-of-range)."""
    outside = out_of_range(ids, num_rows) if outside is None else outside
    return ops.where(outside, num_rows, ids)


def id_ranks(ids, search=True):
    """Each id's rank among the distinct ids (int32): by a sort of the ids and a binary search (`search`;
    XLA's CPU sort of (id, position) pairs, an argsort, takes 3-5x longer), or by an argsort (TF's XLA
    compares every pair in a binary search)."""
    if search:
        sorted_ids = ops.sort(ids)
    else:
        order = ops.cast(ops.argsort(ids), "int32")
        sorted_ids = ops.take(ids, order, axis=0)
    starts = ops.not_equal(sorted_ids[1:], sorted_ids[:-1])
    starts = ops.concatenate([ops.ones_like(sorted_ids[:1], "bool"), starts])
    ranks = ops.cumsum(ops.cast(starts, "int32")) - 1
    if search:
        return ops.take(ranks, ops.searchsorted(sorted_ids, ids, side="left"), axis=0)
    return ops.scatter(ops.expand_dims(order, 1), ranks, (ops.shape(ids)[0],))


def distinct_ids(ids, group):
    """`(distinct, slot)` of ids numbered by `group` from 0 (static shapes): entry i of `distinct` is the id of
    group `slot[i] = min(i, groups - 1)`, every group once, then the last one repeated."""
    count = ops.shape(ids)[0]
    slot = ops.minimum(ops.arange(count, dtype="int32"), ops.max(group))
    return ops.take(ops.segment_max(ids, group, num_segments=count), slot, axis=0), slot


def grouped_rows(ids, rows, accumulate_duplicates, group=None, search=True):
    """The distinct ids, each with the sum of its duplicates' rows or its last occurrence's, static shapes:
    distinct ids first, then the last repeated (`group`: each entry's id numbered from 0, or `id_ranks`)."""
    count = ops.shape(ids)[0]
    if isinstance(count, int) and count == 0:
        return ids, rows
    if group is None:
        group = id_ranks(ids, search)
    distinct, slot = distinct_ids(ids, group)
    if accumulate_duplicates:
        # Summed in float32, the row update's precision, whatever the gradient's dtype.
        sums = ops.segment_sum(ops.cast(rows, "float32"), group, num_segments=count)
        return distinct, ops.take(sums, slot, axis=0)
    last = ops.segment_max(ops.arange(count, dtype="int32"), group, num_segments=count)
    return distinct, ops.take(rows, ops.take(last, slot, axis=0), axis=0)


def sparse_row_update(
    update_rows,
    ids,
    rows,
    tables,
    *,
    accumulate_duplicates,
    gather,
    scatter,
    group=None,
    search=True,
):
    """`tables` (the table and its slots) after `update_rows(grad_rows, weight_rows, *slot_rows)` on the rows
    `ids` only, ids outside the table dropped (`in_table`); a backend passes `gather(table, ids)` and
    `scatter(table, ids, rows) -> table`, which drops ids past the table (the rows are in its dtype)."""
    ids = in_table(ids, tables[0].shape[0])
    ids, rows = grouped_rows(ids, rows, accumulate_duplicates, group, search)
    new_rows = update_rows(rows, *[gather(t, ids) for t in tables], ids=ids)
    return [scatter(t, ids, ops.cast(new, t.dtype)) for t, new in zip(tables, new_rows)]
