"""torch: dense gradients' non-zero rows, or sparse COO gradients, updated in place.

Keras's torch backend produces dense embedding gradients; a custom training
step may also pass a sparse COO gradient (`torch.nn.functional.embedding(...,
sparse=True)`). Either way only the touched rows are read and written.
"""

from __future__ import annotations

import torch

from keras_tpu_optim import _private
from keras_tpu_optim._math import embedding_adam as adam_math


def unique_rows(indices, values, accumulate_duplicates, scratch=None):
    """`(ids, rows)`: the distinct ids of a sparse gradient's entries and their gradient rows.

    Duplicate ids' rows are summed (`accumulate_duplicates`), or the last
    occurrence's is kept. `rows` is a fresh tensor, or a `scratch` buffer
    (`GRADIENT_SLOT`) the caller may write into.
    """
    ids, position = torch.unique(indices, return_inverse=True)
    shape = (ids.shape[0],) + tuple(values.shape[1:])
    out = None if scratch is None else scratch.empty(shape, GRADIENT_SLOT, values.dtype, values.device)
    if accumulate_duplicates:
        rows = torch.zeros(shape, dtype=values.dtype, device=values.device) if out is None else out.zero_()
        rows.index_add_(0, position, values)
    else:
        occurrence = torch.arange(indices.shape[0], device=indices.device)
        last = torch.full_like(ids, -1).scatter_reduce(0, position, occurrence, reduce="amax")
        rows = torch.index_select(values, 0, last, out=out) if out is not None else values.index_select(0, last)
    return ids, rows


# A power of two that lifts the smallest float32 magnitude (2^-149) far enough that its square does
# not underflow (2^-49 squared is 2^-98): scaled, a row's L2 norm is zero only when every entry is.
_UNDERFLOW_SCALE = 2.0**100
# Rows scaled at a time on CPU: a bounded temporary (4 MiB of float32), whatever the table's size.
_CPU_CHUNK_ELEMENTS = 1 << 20


def touched_rows(gradient, scratch=None):
    """Rows with any non-zero (or NaN) entry: `_math.embedding_adam.touched_row_mask`'s rule.

    On CPU as the L2 norm of the rows scaled by `_UNDERFLOW_SCALE`, a chunk of
    rows at a time: torch's vectorised L2 norm reads a gradient several times
    faster there than its 1-norm, and the scaling keeps rows of tiny entries
    (which square to zero unscaled) touched, NaNs and infinities too (an
    overflow to inf is non-zero). Elsewhere as the row's 1-norm, which torch
    reduces without a full-size temporary (`abs(g).sum()` would make one).
    The norms and the scaled chunk live in `scratch` where one is given.
    """
    if gradient.dim() == 1:
        return torch.nonzero(gradient).squeeze(1)
    rows = gradient.reshape(gradient.shape[0], -1)
    norms = None if scratch is None else scratch.empty((rows.shape[0],), NORMS_SLOT, torch.float32, rows.device)
    if not scaled_norms_apply(rows.device.type):
        norms = torch.linalg.vector_norm(rows, ord=1, dim=1, dtype=torch.float32, out=norms)
        return torch.nonzero(norms).squeeze(1)
    if norms is None:
        norms = torch.empty((rows.shape[0],), dtype=torch.float32, device=rows.device)
    step = max(1, _CPU_CHUNK_ELEMENTS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        scaled = torch.mul(chunk, _UNDERFLOW_SCALE) if scratch is None else torch.mul(
            chunk, _UNDERFLOW_SCALE, out=scratch.empty(tuple(chunk.shape), SCALED_SLOT, chunk.dtype, chunk.device)
        )
        torch.linalg.vector_norm(scaled, dim=1, dtype=torch.float32, out=norms[start : start + step])
    return torch.nonzero(norms).squeeze(1)


def scaled_norms_apply(device_type: str) -> bool:
    """Whether `touched_rows` reads a gradient as scaled L2 norms (measured faster on CPU) or as 1-norms."""
    return device_type == "cpu"


@torch.no_grad()
def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates, scratch=None):
    """Update only the rows present in `gradient` (sparse COO indices, or a dense gradient's non-zero rows).

    `update_rows(grad_rows, weight_rows, *slot_rows)` returns the new
    `(weight_rows, *slot_rows)` (a `neutral.RowUpdate`, whose arguments
    `update_in_place` reads to run the in-place kernel). Duplicate ids of a
    sparse gradient are summed (`accumulate_duplicates`) or the last
    occurrence wins.
    """
    if gradient.is_sparse:
        indices, values = _private.torch_sparse_entries(gradient)
        ids, grad_rows = unique_rows(indices, values, accumulate_duplicates, scratch)
    elif torch.compiler.is_compiling():
        masked_row_update(update_rows, gradient, [variable.value] + [s.value for s in slots])
        return
    else:
        ids = touched_rows(gradient, scratch)
        shape = (ids.shape[0],) + tuple(gradient.shape[1:])
        out = None if scratch is None else scratch.empty(shape, GRADIENT_SLOT, gradient.dtype, gradient.device)
        grad_rows = torch.index_select(gradient, 0, ids, out=out) if out is not None else gradient.index_select(0, ids)
    update_in_place(update_rows, ids, grad_rows, [variable.value] + [s.value for s in slots], scratch)


def masked_row_update(update_rows, gradient, targets):
    """A dense gradient's lazy step with static shapes, as `torch.compile` traces it.

    The touched rows' list has a data-dependent length (`nonzero`), which
    `torch.compile` cannot trace without breaking its graph; here every row's
    update is computed and only the touched rows (`touched_row_mask`) take
    theirs: the same numbers, untouched rows bit for bit, in one pass over the
    table that the compiler fuses (the cost of `lazy_adam=False`, not of the
    rows touched).
    """
    touched = adam_math.touched_row_mask(gradient)
    for target, rows in zip(targets, update_rows(gradient, *targets)):
        keep = touched.reshape((-1,) + (1,) * (target.dim() - 1))
        target.copy_(torch.where(keep, rows.to(target.dtype), target))


# The scratch slots of a row step: the gradient rows, the gathered rows of each target (in its
# dtype, then in float32 where that differs), the row update's temporary, and a dense gradient's
# row norms and scaled chunk.
GRADIENT_SLOT, GRADIENT_FLOAT32_SLOT, TEMPORARY_SLOT, NORMS_SLOT, SCALED_SLOT = 0, 1, 2, 3, 4
GATHER_SLOTS, FLOAT32_SLOTS = 10, 20


def update_in_place(update_rows, ids, grad_rows, targets, scratch=None):
    """Gather the rows `ids` (unique) of the tensors `targets`, update them, copy them back.

    With a `neutral.RowUpdate` for the Adam rows alone (no lazy EMA's rows)
    the update runs in place on the gathered rows (`adam_rows_in_place`), in
    `scratch`'s buffers where one is given: a step then allocates nothing
    row-sized. `grad_rows` may be written to. Otherwise `update_rows` computes
    new rows (the neutral math).
    """
    options = getattr(update_rows, "options", None)
    if options is None or options.ema_momentum is not None:
        new_rows = update_rows(grad_rows, *(t.index_select(0, ids) for t in targets))
        for target, rows in zip(targets, new_rows):
            target.index_copy_(0, ids, rows.to(target.dtype))
        return
    gathered = [_gather(t, ids, scratch, GATHER_SLOTS + i) for i, t in enumerate(targets)]
    # The Adam rows in float32 (the per-row counts as they are: only counted up).
    rows = [_in_float32(r, scratch, FLOAT32_SLOTS + i) for i, r in enumerate(gathered[:3])] + gathered[3:]
    grad = _in_float32(grad_rows, scratch, GRADIENT_FLOAT32_SLOT)
    temporary = None if scratch is None else scratch.like(rows[0], TEMPORARY_SLOT)
    adam_rows_in_place(grad, *rows, learning_rate=update_rows.learning_rate, options=options, temporary=temporary)
    for target, before, after in zip(targets, gathered, rows):
        if after is not before:
            before.copy_(after)  # rounded back to the target's dtype once
        target.index_copy_(0, ids, before)


def _gather(target, ids, scratch, slot):
    shape = (ids.shape[0],) + tuple(target.shape[1:])
    if scratch is None:
        return target.index_select(0, ids)
    return torch.index_select(target, 0, ids, out=scratch.empty(shape, slot, target.dtype, target.device))


def _in_float32(rows, scratch, slot):
    if rows.dtype == torch.float32:
        return rows
    return rows.to(torch.float32) if scratch is None else scratch.like(rows, slot).copy_(rows)


def adam_rows_in_place(grad, weight, momenta, velocities, row_steps=None, *, learning_rate, options, temporary=None):
    """`_math.embedding_adam.row_update` in place on float32 rows (`row_steps` counted up in place).

    The same formulas, each written into its operand (`grad` is clipped in
    place); `temporary`, a float32 buffer of the rows' shape (allocated if
    None), holds the step `m / denominator`. The numbers equal `row_update`'s
    to float32 rounding (products and quotients grouped otherwise).
    """
    o = options
    rank = weight.dim()
    learning_rate = torch.as_tensor(learning_rate, dtype=torch.float32, device=weight.device)
    if o.bias_correction == "per_row":
        row_steps.add_(1)
        corrected = adam_math.bias_corrected_learning_rate(
            learning_rate, row_steps.to(torch.float32), o.beta_1, o.beta_2
        )
        learning_rate = corrected.reshape((-1,) + (1,) * (rank - 1))
    if o.gradient_clip_min is not None or o.gradient_clip_max is not None:
        grad.clamp_(min=o.gradient_clip_min, max=o.gradient_clip_max)
    if o.weight_decay_factor is not None:
        if o.multiply_weight_decay_factor_by_learning_rate:
            weight.addcmul_(weight, learning_rate * o.weight_decay_factor, value=-1.0)
        else:
            weight.sub_(weight, alpha=o.weight_decay_factor)
    momenta.mul_(o.beta_1).add_(grad, alpha=1.0 - o.beta_1)
    step = temporary if temporary is not None else torch.empty_like(weight)
    if o.second_moment == "rowwise" and rank > 1:
        square = torch.mul(grad, grad, out=step).mean(dim=tuple(range(1, rank)))
        velocities.mul_(o.beta_2).add_(square, alpha=1.0 - o.beta_2)
        denominator = torch.empty_like(velocities)
    else:
        velocities.mul_(o.beta_2).addcmul_(grad, grad, value=1.0 - o.beta_2)
        denominator = step
    if o.sum_inside_sqrt:
        torch.add(velocities, o.epsilon**2, out=denominator).sqrt_()
    else:
        torch.sqrt(velocities, out=denominator).add_(o.epsilon)
    if denominator.dim() < rank:
        denominator = denominator.reshape((-1,) + (1,) * (rank - 1))
    torch.div(momenta, denominator, out=step)
    weight.addcmul_(step, learning_rate, value=-1.0)
    if o.clip_weight_min is not None or o.clip_weight_max is not None:
        weight.clamp_(min=o.clip_weight_min, max=o.clip_weight_max)
