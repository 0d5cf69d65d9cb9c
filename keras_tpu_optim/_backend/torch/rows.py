"""torch: the touched rows of a table updated in place, and accumulated in place under
`gradient_accumulation_steps`, in buffers kept across steps (`Scratch`)."""

from __future__ import annotations

import math

import torch

from keras_tpu_optim import _private
from keras_tpu_optim._math import embedding_adam as adam_math


class Scratch:
    """One cache's buffers (an optimizer's, a layer's), one per `(slot, dtype)`, grown as needed and reused."""

    def __init__(self):
        self._buffers = {}

    def empty(self, shape, slot: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A `dtype` view of `shape` on `device` (contents undefined)."""
        numel = math.prod(shape)
        buffer = self._buffers.get((slot, dtype))
        if buffer is None or buffer.device != torch.device(device) or buffer.numel() < numel:
            self._buffers[(slot, dtype)] = buffer = None  # the old one freed before its successor
            buffer = self._buffers[(slot, dtype)] = torch.empty(
                max(numel, 1), dtype=dtype, device=device
            )
        return buffer[:numel].view(shape)


def in_table(indices, values, num_rows):
    """The entries whose ids name rows of the table (`sparse_rows.in_table`); the others removed, which
    torch's index ops would refuse."""
    if indices.numel() == 0:
        return indices, values
    low, high = indices.aminmax()
    if bool((low >= 0) & (high < num_rows)):
        return indices, values
    kept = (indices >= 0) & (indices < num_rows)
    return indices[kept], values[kept]


def unique_rows(indices, values, accumulate_duplicates, scratch):
    """`(ids, rows)`: the distinct ids of a sparse gradient's entries and their rows, duplicates summed
    (`accumulate_duplicates`) or the last occurrence's kept; `rows` may be a `scratch` buffer."""
    ids, position = torch.unique(indices, return_inverse=True)
    shape = (ids.shape[0],) + tuple(values.shape[1:])
    # Duplicates summed in float32, the row update's precision, whatever the gradient's dtype (as
    # `sparse_rows.grouped_rows` sums them).
    dtype = torch.float32 if accumulate_duplicates else values.dtype
    out = scratch.empty(shape, GRADIENT_SLOT, dtype, values.device)
    if accumulate_duplicates:
        rows = out.zero_().index_add_(0, position, values.to(dtype))
    else:
        occurrence = torch.arange(indices.shape[0], device=indices.device)
        last = torch.full_like(ids, -1).scatter_reduce(0, position, occurrence, reduce="amax")
        rows = torch.index_select(values, 0, last, out=out)
    return ids, rows


# A power of two that lifts the smallest float32 magnitude (2^-149) far enough that its square does
# not underflow (2^-49 squared is 2^-98): scaled, a row's L2 norm is zero only when every entry is.
_UNDERFLOW_SCALE = 2.0**100
# Rows scaled at a time on CPU: a bounded temporary (4 MiB of float32), whatever the table's size.
_CPU_CHUNK_ELEMENTS = 1 << 20


def touched_rows(gradient, scratch):
    """Rows with any non-zero (or NaN) entry (`touched_row_mask`'s rule): on CPU a non-zero L2 norm of the
    rows scaled by `_UNDERFLOW_SCALE`, a chunk at a time; elsewhere the 1-norm."""
    if gradient.dim() == 1:
        return torch.nonzero(gradient).squeeze(1)
    rows = gradient.reshape(gradient.shape[0], -1)
    norms = scratch.empty((rows.shape[0],), NORMS_SLOT, torch.float32, rows.device)
    if not scaled_norms_apply(rows.device.type):
        norms = torch.linalg.vector_norm(rows, ord=1, dim=1, dtype=torch.float32, out=norms)
        return torch.nonzero(norms).squeeze(1)
    step = max(1, _CPU_CHUNK_ELEMENTS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        scaled = scratch.empty(tuple(chunk.shape), SCALED_SLOT, chunk.dtype, chunk.device)
        torch.mul(chunk, _UNDERFLOW_SCALE, out=scaled)
        torch.linalg.vector_norm(
            scaled, dim=1, dtype=torch.float32, out=norms[start : start + step]
        )
    return torch.nonzero(norms).squeeze(1)


def scaled_norms_apply(device_type: str) -> bool:
    """Whether `touched_rows` reads a gradient as scaled L2 norms (measured faster on CPU) or as 1-norms."""
    return device_type == "cpu"


@torch.no_grad()
def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates, scratch):
    """Update only the rows present in `gradient` (sparse COO indices, or a dense gradient's non-zero rows) by
    `update_rows` (an `adam_math.RowUpdate`); duplicate ids summed (`accumulate_duplicates`) or the last kept."""
    targets = [variable.value] + [s.value for s in slots]
    if gradient.is_sparse:
        sparse_row_update(
            update_rows,
            *_private.torch_sparse_entries(gradient),
            targets,
            accumulate_duplicates=accumulate_duplicates,
            scratch=scratch,
        )
        return
    if torch.compiler.is_compiling():
        masked_row_update(update_rows, gradient, targets)
        return
    ids = touched_rows(gradient, scratch)
    grad_rows = gathered_rows(gradient, ids, scratch, GRADIENT_SLOT)
    update_in_place(update_rows, ids, grad_rows, targets, scratch)


def sparse_row_update(update_rows, indices, values, targets, *, accumulate_duplicates, scratch):
    """Update the rows of the tensors `targets` named by the sparse entries `(indices, values)`, those past the
    table dropped; duplicate ids summed (`accumulate_duplicates`) or the last kept."""
    entries = in_table(indices, values, targets[0].shape[0])
    ids, grad_rows = unique_rows(*entries, accumulate_duplicates, scratch)
    update_in_place(update_rows, ids, grad_rows, targets, scratch)


def masked_row_update(update_rows, gradient, targets):
    """A dense gradient's lazy step with static shapes, for `torch.compile` (a `nonzero` would break its graph):
    every row's update computed, only the touched rows' kept. The same numbers, at `lazy_adam=False`'s cost."""
    touched = adam_math.touched_row_mask(gradient)
    for target, rows in zip(targets, update_rows(gradient, *targets)):
        keep = touched.reshape((-1,) + (1,) * (target.dim() - 1))
        target.copy_(torch.where(keep, rows.to(target.dtype), target))


# The scratch slots of a row step: the gradient rows, the gathered rows of each target, and a dense
# gradient's row norms and scaled chunk; of a trained lookup (`_Lookup`): the rows of each table, the sums
# of their gradients, and the reads before the writes.
GRADIENT_SLOT, NORMS_SLOT, SCALED_SLOT = 0, 3, 4
GATHER_SLOTS = 10
LOOKUP_SLOTS, SUMS_SLOT, READ_SLOT = 20, 30, 31


def update_in_place(update_rows, ids, grad_rows, targets, scratch):
    """Gather the rows `ids` (unique) of `targets` into `scratch`, update them, copy them back."""
    gathered = [gathered_rows(t, ids, scratch, GATHER_SLOTS + i) for i, t in enumerate(targets)]
    for target, rows in zip(targets, update_rows(grad_rows, *gathered, ids=ids)):
        target.index_copy_(0, ids, rows)


def gathered_rows(target, ids, scratch, slot):
    """The rows `ids` (int64) of `target`, in `scratch`'s buffer `slot`."""
    shape = (ids.shape[0],) + tuple(target.shape[1:])
    return torch.index_select(
        target, 0, ids, out=scratch.empty(shape, slot, target.dtype, target.device)
    )


# ---------------------------------------------------------------- gradient accumulation of rows


def sparse_entries(gradient):
    """`(ids, values)` of a sparse COO gradient (duplicates kept); None for a dense one."""
    if not gradient.is_sparse:
        return None
    return _private.torch_sparse_entries(gradient)


@torch.no_grad()
def add_to_window(accumulator, window, ids, values, number, *, cache=None):
    """Add the rows `values` into `accumulator` at `ids` (duplicates add up) and mark them `number` in `window`."""
    accumulator.value.index_add_(0, ids, values.to(accumulator.value.dtype))
    window.value.index_fill_(0, ids, number)


def window_sizes(like, window, steps):
    """Eager: the list of a window's rows has its own length."""
    return (None,)


@torch.no_grad()
def window_gradient(accumulator, window, number, steps, like, size=None, *, cache=None):
    """The rows of the window (`window == number`) of `accumulator / steps`, a coalesced sparse COO; those rows zeroed.

    One scan of `window` lists the rows (increasing, unique).
    """
    ids = torch.nonzero(window.value == number).squeeze(1)
    summed = accumulator.value.index_select(0, ids)
    accumulator.value.index_fill_(0, ids, 0)
    mean = (summed / steps).to(like.dtype)
    return torch.sparse_coo_tensor(
        ids[None], mean, size=like.shape, is_coalesced=True, check_invariants=False
    )
