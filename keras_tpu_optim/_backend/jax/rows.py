"""JAX: the touched rows of a table, from a BCOO gradient or from a dense one (a bitmap, updated in rounds of
a static capacity in a `lax.while_loop`), with static shapes (docs/algorithms.md#row-update-paths)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import sparse as jax_sparse

from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._math import embedding_adam as adam_math

_BITS = 32


def pack_bits(mask):
    """A boolean vector as uint32 words, row `32 * w + b` in bit `b` of word `w`."""
    padded = jnp.pad(mask, (0, -mask.shape[0] % _BITS)).reshape(-1, _BITS)
    return jnp.sum(
        padded.astype(jnp.uint32) << jnp.arange(_BITS, dtype=jnp.uint32), axis=1, dtype=jnp.uint32
    )


def first_set_bits(words, size, fill_value):
    """The positions of the first `size` set bits of `words`, in order, padded with `fill_value`."""
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


def lazy_row_update(update_rows, gradient, tables, *, capacity):
    """The tables (the table's and its slots' values) after updating the rows of a dense `gradient` with a
    non-zero entry by `update_rows`, `capacity` rows a round; untouched rows keep their bits."""
    num_rows = tables[0].shape[0]
    touched = pack_bits(adam_math.touched_row_mask(gradient))
    count = jnp.sum(jax.lax.population_count(touched), dtype=jnp.int32)

    def update_round(state):
        done, left, tables = state
        ids = first_set_bits(left, capacity, num_rows)  # padded with ids past the table
        new_rows = update_rows(gather(gradient, ids), *(gather(t, ids) for t in tables), ids=ids)
        tables = tuple(scatter(t, ids, r) for t, r in zip(tables, new_rows))
        return done + capacity, clear_through(left, ids[capacity - 1]), tables

    _, _, new_tables = jax.lax.while_loop(
        lambda state: state[0] < count, update_round, (jnp.int32(0), touched, tuple(tables))
    )
    return new_tables


def row_entries(gradient):
    """`(ids, rows)` of a BCOO gradient, one row per stored entry (element-sparse ones densified per row)."""
    if gradient.n_batch != 0 or gradient.n_sparse != 1:
        gradient = jax_sparse.bcoo_update_layout(
            gradient, n_batch=0, n_dense=gradient.ndim - 1, on_inefficient=None
        )
    return gradient.indices[:, 0], gradient.data


def gather(table, ids):
    # Ids past the end (padding) clip to the last row (cheaper than a fill); scatters drop them.
    return table.at[ids].get(mode="clip")


def scatter(table, ids, rows):
    return table.at[ids].set(rows, mode="drop")


# `sparse_rows.sparse_row_update` of JAX arrays: the new tables.
sparse_row_update = functools.partial(sparse_rows.sparse_row_update, gather=gather, scatter=scatter)
