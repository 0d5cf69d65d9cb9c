"""Adafactor on eager torch: in place, block by block in a small reused scratch, with no host syncs.

`keras.ops` on torch materialises every intermediate (g^2, the update, ...) in
fresh memory; here a variable is processed in blocks of its leading axis and
every intermediate lives in a block-sized float32 buffer owned by the
optimizer (a variable-sized one would cost the largest variable's size for
the whole of training). Every scalar (learning rate, step, norms) stays a 0-d
tensor on the variable's device: reading one back (`.item()`, `float()`)
would stall the host until the device queue drains, once per variable.
"""

from __future__ import annotations

import torch

from keras_tpu_optim._backend import blocks
from keras_tpu_optim._math import stochastic_rounding

_LOW_PRECISION = (torch.bfloat16, torch.float16)


CHUNK_ELEMENTS = blocks.CHUNK_ELEMENTS


def _part(x: torch.Tensor, span, full_rows: int) -> torch.Tensor:
    """Block `span` of x's leading axis; x itself if it has no such axis of `full_rows` (broadcast)."""
    if span is None or x.dim() == 0 or x.shape[0] != full_rows:
        return x
    return x.narrow(0, *span)


def _square_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x).square()


@torch.no_grad()
def adafactor_step(
    grad,
    param,
    second_moment_slots,
    momentum,
    *,
    learning_rate,
    step,
    options,
    scratch,
    variable_index=0,
    chunk_elements=CHUNK_ELEMENTS,
) -> None:
    """One Adafactor step for one variable, in place, with no host-device synchronisation.

    `second_moment_slots` is `(row, column)` for a factored variable, else `(v,)`,
    all float32; `momentum` (or None) is float32 or bfloat16 (`momentum_dtype`:
    computed in float32, stored rounded). `learning_rate` and `step`
    (iterations + 1) are 0-d tensors; `options` holds the static hyperparameters;
    `variable_index` keys stochastic rounding's random bits. A non-float32
    `param` is updated in float32 and rounded once (to nearest, or
    stochastically with `options.stochastic_rounding`).

    The variable is processed in blocks of its leading axis (`chunk_elements`
    each): the statistics, then RMS(update), then the update, each a pass over
    the blocks, so that no intermediate is bigger than a block and the blocks
    stay in cache. The update is recomputed in the last pass rather than kept
    (a variable-sized buffer); a variable of one block keeps it.
    """
    lr = learning_rate.to(param.device, torch.float32, non_blocking=True)
    step_count = step.to(param.device, non_blocking=True)
    step = step_count.to(torch.float32)
    rho = torch.minimum(lr, step.rsqrt()) if options.relative_step else lr
    shape = tuple(param.shape)
    rows = shape[0] if shape else 1
    spans = blocks.spans(shape, chunk_elements)
    numel = max(1, param.numel())
    low_precision_param = param.dtype != torch.float32

    def as_float32(x, span, slot):
        """Block `span` of x in float32: a view if x is float32, else a copy into the scratch (a casting copy_ allocates nothing)."""
        block = _part(x, span, rows)
        return block if block.dtype == torch.float32 else scratch.like(block, slot).copy_(block)

    alpha = rho
    if options.multiply_by_parameter_scale:
        if not low_precision_param:
            square_sum = _square_norm(param)
        else:  # Not vector_norm(param, dtype=float32): it would allocate a float32 copy.
            square_sum = sum(_square_norm(as_float32(param, span, 0)) for span in spans)
        alpha = torch.clamp_min((square_sum / numel).sqrt(), options.epsilon_2) * rho
    decay_step = torch.clamp_min(step - float(options.decay_offset), 1.0) if options.decay_offset else step
    decay_weight = decay_step.pow(options.beta_2_decay)  # 1 - beta2_t: the weight of the new statistic.
    if options.beta_2_cap is not None:
        decay_weight = torch.clamp_min(decay_weight, 1.0 - options.beta_2_cap)  # beta2_t <= beta_2_cap.

    if len(second_moment_slots) == 2:
        row, column = second_moment_slots
        # Row statistics: means over axis b; column statistics: over axis a (the last two, or the two largest).
        a, b = options.factored_axes(shape)
        a_in_row = a - (b < a)
        # A mean over the leading axis (the blocks' axis) is summed block by block; any other is per block.
        row_mean = torch.zeros_like(row) if b == 0 else torch.empty_like(row)
        column_mean = torch.zeros_like(column) if a == 0 else torch.empty_like(column)
        for span in spans:
            g = as_float32(grad, span, 0)
            grad_sq = torch.mul(g, g, out=scratch.like(g, 1))
            for mean, axis in ((row_mean, b), (column_mean, a)):
                if axis == 0:
                    mean.add_(grad_sq.sum(dim=0))
                else:
                    torch.mean(grad_sq, dim=axis, out=_part(mean, span, rows))
        for mean, axis in ((row_mean, b), (column_mean, a)):
            if axis == 0:
                mean.div_(rows)
        row.lerp_(row_mean.add_(options.epsilon_1), decay_weight)
        column.lerp_(column_mean.add_(options.epsilon_1), decay_weight)
        row_factor = (row / row.mean(dim=a_in_row, keepdim=True)).rsqrt_().unsqueeze(b)
        column_factor = column.rsqrt().unsqueeze(a)

        def update_of(span):
            g = as_float32(grad, span, 0)
            update = torch.mul(g, _part(row_factor, span, rows), out=scratch.like(g, 1))
            return update.mul_(_part(column_factor, span, rows))

    else:
        (second_moment,) = second_moment_slots
        for span in spans:
            g = as_float32(grad, span, 0)
            grad_sq = torch.mul(g, g, out=scratch.like(g, 1))
            _part(second_moment, span, rows).lerp_(grad_sq.add_(options.epsilon_1), decay_weight)

        def update_of(span):
            g = as_float32(grad, span, 0)
            return torch.rsqrt(_part(second_moment, span, rows), out=scratch.like(g, 1)).mul_(g)

    updates = [update_of(span) for span in spans[:1]]
    square_sum = _square_norm(updates[0])
    for span in spans[1:]:
        square_sum = square_sum + _square_norm(update_of(span))
    scale = alpha / torch.clamp_min((square_sum / numel).sqrt() / options.clip_threshold, 1.0)
    stochastic = options.stochastic_rounding and param.dtype in _LOW_PRECISION
    per_row = numel // rows
    for k, span in enumerate(spans):
        # The one block's update is still in the scratch; several blocks' are recomputed.
        update = updates[0] if len(spans) == 1 else update_of(span)
        p = _part(param, span, rows)
        # addcmul_ multiplies by the 0-d tensor in the same pass (add_'s alpha takes only numbers).
        # Type promotion updates a bf16/fp16 param in float32 and rounds it once.
        if options.beta_1 is not None:
            m = _part(momentum, span, rows)
            if m.dtype == torch.float32:
                m.mul_(options.beta_1).addcmul_(update, (1.0 - options.beta_1) * scale)
                delta = m
            else:
                # A bfloat16 slot: the new momentum in float32 (in the scratch), stored rounded, used unrounded.
                delta = update.mul_((1.0 - options.beta_1) * scale).add_(m, alpha=options.beta_1)
                m.copy_(delta)
            if not stochastic:
                p.sub_(delta)
                continue
            new_value = delta.neg_().add_(p) if delta is update else torch.sub(p, delta, out=update)
        else:
            if not stochastic:
                p.addcmul_(update, scale, value=-1.0)
                continue
            new_value = update.mul_(-scale).add_(p)
        p.copy_(
            stochastic_rounding.stochastic_round(
                new_value, param.dtype, seed=options.seed, step=step_count, variable_index=variable_index,
                offset=0 if span is None else span[0] * per_row,
            )
        )
