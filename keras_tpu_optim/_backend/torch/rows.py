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


def touched_rows(gradient):
    """Rows with any non-zero (or NaN) entry: `_math.embedding_adam.touched_row_mask`'s `sum(|g|) != 0`.

    As the row's 1-norm, which torch reduces without a full-size temporary
    (`abs(g).sum()` would make one).
    """
    if gradient.dim() == 1:
        return torch.nonzero(gradient != 0).squeeze(1)
    magnitudes = torch.linalg.vector_norm(gradient.reshape(gradient.shape[0], -1), ord=1, dim=1)
    return torch.nonzero(magnitudes != 0).squeeze(1)


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

