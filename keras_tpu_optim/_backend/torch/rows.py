"""torch: dense gradients' non-zero rows, or sparse COO gradients, updated in place.

Keras's torch backend produces dense embedding gradients; a custom training
step may also pass a sparse COO gradient (`torch.nn.functional.embedding(...,
sparse=True)`). Either way only the touched rows are read and written.
"""

from __future__ import annotations

import torch

from keras_tpu_optim import _private


def unique_rows(indices, values, accumulate_duplicates):
    ids, position = torch.unique(indices, return_inverse=True)
    if accumulate_duplicates:
        rows = torch.zeros((ids.shape[0],) + values.shape[1:], dtype=values.dtype, device=values.device)
        rows.index_add_(0, position, values)
    else:
        occurrence = torch.arange(indices.shape[0], device=indices.device)
        last = torch.full_like(ids, -1).scatter_reduce(0, position, occurrence, reduce="amax")
        rows = values.index_select(0, last)
    return ids, rows


# A power of two that lifts the smallest float32 magnitude (2^-149) far enough that its square does
# not underflow (2^-49 squared is 2^-98): scaled, a row's L2 norm is zero only when every entry is.
_UNDERFLOW_SCALE = 2.0**100
# Rows scaled at a time on CPU: a bounded temporary (4 MiB of float32), whatever the table's size.
_CPU_CHUNK_ELEMENTS = 1 << 20


def touched_rows(gradient):
    """Rows with any non-zero (or NaN) entry: `_math.embedding_adam.touched_row_mask`'s rule.

    On CPU as the L2 norm of the rows scaled by `_UNDERFLOW_SCALE`, a chunk of
    rows at a time: torch's vectorised L2 norm reads a gradient several times
    faster there than its 1-norm, and the scaling keeps rows of tiny entries
    (which square to zero unscaled) touched, NaNs and infinities too (an
    overflow to inf is non-zero). Elsewhere as the row's 1-norm, which torch
    reduces without a full-size temporary (`abs(g).sum()` would make one).
    """
    if gradient.dim() == 1:
        return torch.nonzero(gradient != 0).squeeze(1)
    rows = gradient.reshape(gradient.shape[0], -1)
    if rows.device.type != "cpu":
        return torch.nonzero(torch.linalg.vector_norm(rows, ord=1, dim=1) != 0).squeeze(1)
    step = max(1, _CPU_CHUNK_ELEMENTS // max(1, rows.shape[1]))
    norms = [torch.linalg.vector_norm(rows[i : i + step] * _UNDERFLOW_SCALE, dim=1) for i in range(0, rows.shape[0], step)]
    return torch.nonzero(torch.cat(norms) != 0).squeeze(1)


@torch.no_grad()
def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates):
    """Update only the rows present in `gradient` (sparse COO indices, or a dense gradient's non-zero rows).

    `update_rows(grad_rows, weight_rows, *slot_rows)` returns the new
    `(weight_rows, *slot_rows)`. Duplicate ids of a sparse gradient are summed
    (`accumulate_duplicates`) or the last occurrence wins.
    """
    if gradient.is_sparse:
        indices, values = _private.torch_sparse_entries(gradient)
        ids, grad_rows = unique_rows(indices, values, accumulate_duplicates)
    else:
        ids = touched_rows(gradient)
        grad_rows = gradient.index_select(0, ids)
    update_in_place(update_rows, ids, grad_rows, [variable.value] + [s.value for s in slots])


def update_in_place(update_rows, ids, grad_rows, targets):
    """Gather the rows `ids` (unique) of the tensors `targets`, update them, copy them back."""
    new_rows = update_rows(grad_rows, *(t.index_select(0, ids) for t in targets))
    for target, rows in zip(targets, new_rows):
        target.index_copy_(0, ids, rows.to(target.dtype))

