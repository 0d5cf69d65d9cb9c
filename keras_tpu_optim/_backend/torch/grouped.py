"""Adafactor on torch for many variables at once: a group's step in a few dozen ops, whatever its size.

Eager torch dispatches every op as its own kernel (on a GPU a launch of 5-10
us before any work), and a variable's step is about forty ops. Here the
variables of one shape and dtype (and state: factored or not, momentum or not)
form a group: its gradients are stacked into one float32 tensor, every
reduction and elementwise step runs once on the stack (per-variable scalars as
a `[k, 1, ...]` column), and the results are written back with
`torch._foreach_*` ops, one per list. The ops of a step grow with the number
of groups, not of variables. No value is read back to the host.

The stack is the group's one full-size temporary, so a group is stacked in
chunks of at most `CHUNK_ELEMENTS` (or one variable, if bigger). The numbers
are those of `_math.adafactor.adafactor_update` to float32 rounding (sums of
squares as norms, `lerp` for the moving averages).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from keras_tpu_optim._math import stochastic_rounding

# The elements of a group's stack (64 MiB of float32): a chunk's temporaries stay within a small
# multiple of the largest variable's, as the step one variable at a time has them.
CHUNK_ELEMENTS = 1 << 24
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Member(NamedTuple):
    """One variable of a group: its value, gradient, statistics and momentum (or None)."""

    param: torch.Tensor
    grad: torch.Tensor
    slots: tuple
    momentum: Optional[torch.Tensor]


def group_key(param, slots, momentum, axes) -> tuple:
    """What variables must share to be stepped together: shape, dtype, device, the state's kind."""
    return (
        tuple(param.shape), param.dtype, param.device, axes, len(slots),
        None if momentum is None else momentum.dtype,
    )


def chunked(positions: list, numel: int) -> list:
    """`positions` (of variables of `numel` elements each) in runs of at most `CHUNK_ELEMENTS` elements, one at least."""
    size = max(1, CHUNK_ELEMENTS // max(1, numel))
    return [positions[i : i + size] for i in range(0, len(positions), size)]


def _column(x: torch.Tensor, rank: int) -> torch.Tensor:
    """A `[k]` tensor shaped `[k, 1, ..., 1]` to broadcast against a `[k, *shape]` stack of rank-`rank` variables."""
    return x.reshape((-1,) + (1,) * rank)


@torch.no_grad()
def adafactor_group_step(members, *, learning_rate, step, options, axes, indices=None) -> None:
    """One Adafactor step for variables of one shape, dtype and kind of state (`group_key`), in place.

    `learning_rate` and `step` (iterations + 1) are 0-d tensors; `options` the
    `AdafactorOptions`; `axes` the factored axes `(a, b)` of the shape, or
    None for an unfactored group; `indices` the members' positions in the
    optimizer's variables (an int32 tensor on their device), which key
    stochastic rounding's random bits.
    """
    first = members[0]
    shape = tuple(first.param.shape)
    rank, numel = len(shape), max(1, math.prod(shape))
    device = first.param.device
    params = [m.param for m in members]
    lr = learning_rate.to(device, torch.float32)
    step_count = step.to(device)
    t = step_count.to(torch.float32)
    rho = torch.minimum(lr, t.rsqrt()) if options.relative_step else lr
    if options.multiply_by_parameter_scale:
        norms = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
        alpha = torch.clamp_min(norms / math.sqrt(numel), options.epsilon_2) * rho
    else:
        alpha = rho.expand(len(members))
    decay_step = torch.clamp_min(t - float(options.decay_offset), 1.0) if options.decay_offset else t
    decay_weight = decay_step.pow(options.beta_2_decay)  # 1 - beta2_t, the weight of the new statistic
    if options.beta_2_cap is not None:
        decay_weight = torch.clamp_min(decay_weight, 1.0 - options.beta_2_cap)

    grads = torch.stack([m.grad for m in members])
    if grads.dtype != torch.float32:
        grads = grads.to(torch.float32)
    if axes is not None:
        a, b = axes
        a_in_row = a - (b < a)
        rows, columns = [m.slots[0] for m in members], [m.slots[1] for m in members]
        row = torch.stack(rows)
        column = torch.stack(columns)
        # Means of g^2 as squared norms: torch reduces without a full-size g^2.
        row_mean = torch.linalg.vector_norm(grads, dim=b + 1).square_().div_(shape[b]).add_(options.epsilon_1)
        column_mean = torch.linalg.vector_norm(grads, dim=a + 1).square_().div_(shape[a]).add_(options.epsilon_1)
        row.lerp_(row_mean, decay_weight)
        column.lerp_(column_mean, decay_weight)
        torch._foreach_copy_(rows, row.unbind(0))
        torch._foreach_copy_(columns, column.unbind(0))
        row_factor = (row / row.mean(dim=a_in_row + 1, keepdim=True)).rsqrt_().unsqueeze(b + 1)
        updates = grads.mul_(row_factor).mul_(column.rsqrt_().unsqueeze(a + 1))
    else:
        moments = [m.slots[0] for m in members]
        second_moment = torch.stack(moments)
        square = torch.mul(grads, grads).add_(options.epsilon_1)
        second_moment.lerp_(square, decay_weight)
        torch._foreach_copy_(moments, second_moment.unbind(0))
        updates = grads.mul_(torch.rsqrt(second_moment, out=square))
    dims = tuple(range(1, rank + 1))
    square_sum = torch.linalg.vector_norm(updates, dim=dims).square_() if rank else updates.square()
    scale = alpha / torch.clamp_min((square_sum / numel).sqrt_() / options.clip_threshold, 1.0)
    deltas = updates.mul_(_column(scale, rank))

    if options.beta_1 is not None:
        momenta = [m.momentum for m in members]
        if momenta[0].dtype == torch.float32:
            torch._foreach_mul_(momenta, options.beta_1)
            torch._foreach_add_(momenta, deltas.unbind(0), alpha=1.0 - options.beta_1)
            deltas = torch.stack(momenta)
        else:
            # A bfloat16 slot: the new momentum in float32, stored rounded, used unrounded.
            deltas = deltas.mul_(1.0 - options.beta_1).add_(torch.stack(momenta).to(torch.float32), alpha=options.beta_1)
            torch._foreach_copy_(momenta, deltas.unbind(0))
    if first.param.dtype == torch.float32:
        torch._foreach_sub_(params, deltas.unbind(0))
        return
    # Another dtype: subtracted in float32 and rounded once, to nearest or stochastically.
    new_values = torch.stack(params).to(torch.float32).sub_(deltas)
    if options.stochastic_rounding and first.param.dtype in _LOW_PRECISION:
        new_values = stochastic_rounding.stochastic_round(
            new_values, first.param.dtype, seed=options.seed, step=step_count,
            variable_index=_column(indices, rank), shape=shape,
        )
    torch._foreach_copy_(params, new_values.unbind(0))
