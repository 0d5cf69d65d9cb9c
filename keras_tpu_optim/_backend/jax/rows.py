"""JAX: the touched rows of a table, from a dense or a BCOO gradient, under `jax.jit` (static shapes).

A BCOO gradient names its rows: they are sorted, duplicates summed (or the
last occurrence kept), gathered, updated and scattered back, at the cost of
the stored entries (`sparse_row_update`), as a `tf.IndexedSlices` on TF.

The touched rows of a dense gradient are processed in rounds of a static
capacity, inside a `lax.while_loop` that runs as many rounds as the step
needs (one, unless the step touches more rows than the capacity): each round
lists the next touched rows, gathers them, applies the row update and
scatters the results back. The table and slots are loop state, so under
`jax.jit` with donated state (as Keras's trainer runs it) they are updated in
place: besides one read of the gradient, the optimizer's work is
O(rows touched * dim + rows / 32), and every touched row is updated exactly
once whatever the capacity.

The touched rows are kept as a bitmap, 32 rows to a word: listing the next
rows of a round is a `nonzero` over the words (1/32 of the rows), then over
the bits of the words it found, instead of a `nonzero` (a cumulative sum)
over every row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import sparse as jax_sparse

from keras_tpu_optim._backend import blocks
from keras_tpu_optim._math import embedding_adam as adam_math

_BITS = 32


touched_mask = adam_math.touched_row_mask  # Rows with any non-zero (or NaN) entry.


def pack_bits(mask):
    """A boolean vector as uint32 words, row `32 * w + b` in bit `b` of word `w`."""
    padded = jnp.pad(mask, (0, -mask.shape[0] % _BITS)).reshape(-1, _BITS)
    return jnp.sum(
        padded.astype(jnp.uint32) << jnp.arange(_BITS, dtype=jnp.uint32), axis=1, dtype=jnp.uint32
    )


def first_set_bits(words, size, fill_value):
    """The positions of the first `size` set bits of `words`, in order, padded with `fill_value`.

    The same as `jnp.nonzero(unpacked, size=size, fill_value=fill_value)[0]`
    on the unpacked bits: the first `size` set bits lie in the first `size`
    non-zero words.
    """
    num_words = words.shape[0]
    word_size = min(size, num_words)
    (word_ids,) = jnp.nonzero(words != 0, size=word_size, fill_value=num_words)
    shifts = jnp.arange(_BITS, dtype=jnp.uint32)
    bits = (words.at[word_ids].get(mode="fill", fill_value=0)[:, None] >> shifts) & 1
    (picked,) = jnp.nonzero(bits.reshape(-1), size=size, fill_value=bits.size)
    positions = (word_ids[:, None] * _BITS + shifts.astype(jnp.int32)).reshape(-1)
    return positions.at[picked].get(mode="fill", fill_value=fill_value)


def clear_through(words, position):
    """`words` with every bit at or before bit number `position` cleared."""
    word_index = jnp.arange(words.shape[0], dtype=jnp.int32)
    last_word, last_bit = position // _BITS, (position % _BITS).astype(jnp.uint32)
    # Bits above `last_bit` survive in the last word: ~(2^(last_bit+1) - 1), without overflowing at 31.
    keep_high = ~((jnp.uint32(2) << last_bit) - jnp.uint32(1))
    return jnp.where(
        word_index > last_word, words, jnp.where(word_index == last_word, words & keep_high, 0)
    )


def default_capacity(num_rows: int) -> int:
    return min(num_rows, 4096)


def lazy_row_update(update_rows, gradient, tables, *, capacity):
    """The tables after updating only the rows of a dense `gradient` with a non-zero entry; untouched rows keep their bits.

    `tables` are the table's and its slots' values; `update_rows(grad_rows,
    weight_rows, *slot_rows)` returns the new `(weight_rows, *slot_rows)`;
    `capacity` (at most the table's rows) is the static size of a round.
    """
    num_rows = tables[0].shape[0]
    touched = pack_bits(touched_mask(gradient))
    count = jnp.sum(jax.lax.population_count(touched), dtype=jnp.int32)

    def update_round(state):
        done, left, tables = state
        # Padding ids point past the table: gathers clip them to the last row (cheaper
        # than a fill), scatters drop them, so their rows never land.
        ids = first_set_bits(left, capacity, num_rows)
        gather = lambda x: x.at[ids].get(mode="clip")
        new_rows = update_rows(gather(gradient), *(gather(t) for t in tables))
        tables = tuple(
            t.at[ids].set(r.astype(t.dtype), mode="drop") for t, r in zip(tables, new_rows)
        )
        return done + capacity, clear_through(left, ids[capacity - 1]), tables

    def rows_left(state):
        return state[0] < count

    _, _, new_tables = jax.lax.while_loop(
        rows_left, update_round, (jnp.int32(0), touched, tuple(tables))
    )
    return new_tables


def row_entries(gradient):
    """`(ids, rows)` of a BCOO gradient: one row id and one `[*row_shape]` row per stored entry.

    A BCOO whose sparse dimensions go beyond the first (element-sparse) gets
    its entries' rows densified, one row per entry (static shapes).
    """
    if gradient.n_batch != 0 or gradient.n_sparse != 1:
        gradient = jax_sparse.bcoo_update_layout(
            gradient, n_batch=0, n_dense=gradient.ndim - 1, on_inefficient=None
        )
    return gradient.indices[:, 0], gradient.data


def grouped_rows(ids, rows, accumulate_duplicates):
    """Ids sorted, each carrying its group's row: the sum of its duplicates, or the last occurrence's.

    Static shapes (one entry per stored entry): duplicates carry identical
    rows, so their updated rows are identical and their scatters agree.
    """
    count = ids.shape[0]
    order = jnp.argsort(ids, stable=True)
    ids, rows = ids[order], rows[order]
    starts = jnp.concatenate([jnp.ones((min(count, 1),), bool), ids[1:] != ids[:-1]])
    group = jnp.cumsum(starts) - 1
    if accumulate_duplicates:
        return ids, jax.ops.segment_sum(rows, group, num_segments=count)[group]
    # The sort is stable: the last of a group is the id's last occurrence.
    last = jax.ops.segment_max(jnp.arange(count), group, num_segments=count)
    return ids, rows[last[group]]


def padded_entries(ids, rows, num_rows):
    """`(ids, rows)` padded to a power-of-two length (at least `blocks.MIN_BUCKET`) with id `num_rows` (past the table:
    dropped) and zero rows.

    For eager steps: a computation compiled for a bucket of lengths serves
    every gradient of that bucket, instead of one compilation per length.
    """
    count = ids.shape[0]
    size = blocks.bucket(count)
    if size == count:
        return ids, rows
    ids = jnp.concatenate([ids, jnp.full((size - count,), num_rows, ids.dtype)])
    rows = jnp.concatenate([rows, jnp.zeros((size - count,) + rows.shape[1:], rows.dtype)])
    return ids, rows


def sparse_row_update(update_rows, ids, rows, tables, *, accumulate_duplicates):
    """The tables after updating only the rows `ids` (with gradient rows `rows`, from `row_entries`).

    O(entries x row size), under `jax.jit` too. `tables` are the table's and
    its slots' values; `update_rows(grad_rows, weight_rows, *slot_rows)`
    returns the new `(weight_rows, *slot_rows)`. Ids outside the table
    (BCOO's padding) are dropped. Every entry keeps its place and carries its
    id's row, so duplicates write identical values.
    """
    tables = list(tables)
    accumulator = _accumulator(tables) if accumulate_duplicates else None
    if accumulator is None:
        ids, rows = grouped_rows(ids, rows, accumulate_duplicates)
        old_rows = [t.at[ids].get(mode="clip") for t in tables]
    else:
        # Duplicates summed in the accumulator's touched rows, without sorting the ids:
        # zeroed (from the old rows, so a non-finite row does not leak in), scatter-added,
        # gathered back; the update then overwrites those rows.
        old_rows = [t.at[ids].get(mode="clip") for t in tables]
        old = old_rows[accumulator]
        zeros = jnp.where(jnp.isfinite(old), old * 0, jnp.zeros_like(old))
        summed = tables[accumulator].at[ids].set(zeros, mode="drop")
        summed = summed.at[ids].add(rows.astype(summed.dtype), mode="drop")
        tables[accumulator] = summed
        rows = summed.at[ids].get(mode="clip")
    new_rows = update_rows(rows, *old_rows)
    return tuple(
        table.at[ids].set(new.astype(table.dtype), mode="drop")
        for table, new in zip(tables, new_rows)
    )


def _accumulator(tables):
    """The index of a float32 slot table of the table's shape, to sum duplicate rows in, or None."""
    for i, table in enumerate(tables[1:], start=1):
        if table.dtype == jnp.float32 and table.shape == tables[0].shape:
            return i
    return None
