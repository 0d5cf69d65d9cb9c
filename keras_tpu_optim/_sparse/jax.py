"""JAX: dense gradients under `jax.jit`, with static shapes.

The touched rows of a dense gradient are found with a static capacity
(`jnp.nonzero(..., size=capacity)`), gathered, updated and scattered back;
under `jax.jit` with donated state (as Keras's trainer runs it) the scatter is
in place, so the optimizer's work is O(capacity * dim) besides one read of the
gradient. A step that touches more rows than the capacity falls back, inside
the graph (`lax.cond`), to the masked whole-table update: same numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from keras_tpu_optim._sparse import masked_row_update


def touched_mask(gradient):
    nonzero = gradient != 0
    if gradient.ndim > 1:
        nonzero = jnp.any(nonzero.reshape(gradient.shape[0], -1), axis=1)
    return nonzero


def default_capacity(num_rows: int) -> int:
    return min(num_rows, max(4096, num_rows // 64))


def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates, max_touched_rows):
    del accumulate_duplicates  # Dense gradients carry no duplicate indices.
    weight = variable.value
    slot_values = tuple(s.value for s in slots)
    num_rows = weight.shape[0]
    capacity = min(num_rows, max_touched_rows or default_capacity(num_rows))
    touched = touched_mask(gradient)

    def gather_scatter(operands):
        gradient, weight, *slot_values = operands
        # Padding ids point past the table: gathers read zeros, scatters drop them.
        (ids,) = jnp.nonzero(touched, size=capacity, fill_value=num_rows)
        gather = lambda x: x.at[ids].get(mode="fill", fill_value=0)
        new_rows = update_rows(gather(gradient), gather(weight), *(gather(s) for s in slot_values))
        return tuple(
            full.at[ids].set(rows.astype(full.dtype), mode="drop")
            for full, rows in zip((weight, *slot_values), new_rows)
        )

    def whole_table(operands):
        gradient, weight, *slot_values = operands
        new = masked_row_update(update_rows, gradient, weight, slot_values, touched)
        return tuple(n.astype(o.dtype) for n, o in zip(new, (weight, *slot_values)))

    operands = (gradient, weight, *slot_values)
    if capacity >= num_rows:
        new_values = whole_table(operands)
    else:
        new_values = jax.lax.cond(jnp.sum(touched) <= capacity, gather_scatter, whole_table, operands)
    for target, value in zip((variable, *slots), new_values):
        target.assign(value)


def densify(gradient):
    return gradient
