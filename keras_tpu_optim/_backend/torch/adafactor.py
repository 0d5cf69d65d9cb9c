"""Adafactor on eager torch: `blocked_step` (a variable in blocks of its leading axis) and `grouped_step`
(variables of one shape stacked), neither reading a value back to the host (docs/algorithms.md)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from keras_tpu_optim._math import blocks
from keras_tpu_optim._math import adafactor as adafactor_math


class TorchEvaluation(adafactor_math.Evaluation):
    """Sums and means of squares from one square written into its own buffer, the means' kept for the
    weighted sum of the same array that follows (a step's evaluation is its own); a whole contiguous
    tensor's root mean square as a norm, a group's as one norm a member; constant bounds as scalars."""

    def __init__(self, batch_dims: int = 0):
        self.batch_dims = batch_dims
        self._square = None  # (x, x^2) of the last `square_means`

    def root_mean_square(self, x, numel):
        if isinstance(x, list):  # a group's parameters, not stacked
            return torch.stack(torch._foreach_norm(x, 2, dtype=torch.float32)).mul_(numel**-0.5)
        if not self.batch_dims and x.is_contiguous():
            return torch.linalg.vector_norm(x).mul_(numel**-0.5)
        return super().root_mean_square(x, numel)

    def square_sums(self, x, axes):
        if tuple(axes) == (None,) and not self.batch_dims and x.is_contiguous():
            return (torch.linalg.vector_norm(x).square_(),)
        square = torch.mul(x, x)
        return tuple(self.sum(square, axis) for axis in axes)

    def square_means(self, x, axes):
        square = torch.mul(x, x)
        self._square = (x, square)
        return tuple(square.mean(axis) for axis in axes)

    # A constant bound taken as a scalar: no tensor made of it (on a GPU, a copy from the host).
    def at_least(self, x, low):
        return torch.clamp_min(x, low)

    def at_most(self, x, high):
        return torch.clamp_max(x, high)

    def weighted_square_sum(self, x, weights, axis):
        kept, self._square = self._square, None
        square = kept[1] if kept is not None and kept[0] is x else torch.mul(x, x)
        return self.sum(square.mul_(weights), axis)


class _Float32Blocks(blocks.Blocked):
    """`blocks.Blocked`, each block read in float32 (a bfloat16 variable is not copied whole)."""

    def _blocks(self, sums, axes, *operands):
        return super()._blocks(lambda *parts: sums(*(p.float() for p in parts)), axes, *operands)


# Elements of a block (4 MiB of float32): small enough that the allocator reuses a block's few
# temporaries for the next block, large enough that a variable's blocks are few (ops are dispatched
# one by one).
BLOCK_ELEMENTS = 1 << 20


@torch.no_grad()
def blocked_step(
    grad,
    param,
    slots,
    momentum,
    *,
    learning_rate,
    step,
    options,
    variable_index=0,
    chunk_elements=BLOCK_ELEMENTS,
) -> None:
    """One step of one variable, in place: the sums in blocks of the leading axis, then the update block by
    block (`learning_rate`, `step`: 0-d tensors; a non-float32 variable rounded once, keyed by `variable_index`)."""
    shape = tuple(param.shape)
    evaluation = _Float32Blocks(shape, TorchEvaluation(), chunk_elements=chunk_elements)
    if len(slots) == 1:  # the unfactored statistics are elementwise, and as big as the variable
        grad = grad.float()
    step = step.to(param.device)
    result = adafactor_math.preconditioned(
        grad,
        param,
        slots,
        learning_rate=learning_rate.to(param.device, torch.float32),
        step=step.to(torch.float32),
        options=options,
        factored_axes=options.factored_axes(shape),
        evaluation=evaluation,
    )
    for slot, value in zip(slots, result.slots):
        slot.copy_(value)
    rows = evaluation.rows
    for span in evaluation.spans:
        part = [blocks.part(x, span, rows) for x in (grad, param, momentum)]
        factors = [blocks.part(factor, span, rows) for factor in result.factors]
        delta, new_momentum = adafactor_math.elementwise_update(
            part[0].float(), factors, part[2], options
        )
        adafactor_math.write_back(
            part[1],
            delta,
            part[2],
            new_momentum,
            rounding=adafactor_math.rounding(
                options, step, variable_index, None, 0 if span is None else span[0]
            ),
            assign=torch.Tensor.copy_,
            assign_sub=torch.Tensor.sub_,
        )


class Member(NamedTuple):
    """One variable of a group: its value, gradient, statistics and momentum (or None)."""

    param: torch.Tensor
    grad: torch.Tensor
    slots: tuple
    momentum: Optional[torch.Tensor]


def group_key(param, slots, momentum, axes) -> tuple:
    """What variables must share to be stepped together: shape, dtype, device, the state's kind."""
    return (
        tuple(param.shape),
        param.dtype,
        param.device,
        axes,
        len(slots),
        None if momentum is None else momentum.dtype,
    )


# The elements of a group's stack (64 MiB of float32): a chunk's temporaries stay within a small
# multiple of the largest variable's, as the step one variable at a time has them.
GROUP_ELEMENTS = 1 << 24


def chunked(positions: list, numel: int) -> list:
    """`positions` (of variables of `numel` elements each) in runs of at most `GROUP_ELEMENTS` elements, one at least."""
    size = max(1, GROUP_ELEMENTS // max(1, numel))
    return [positions[i : i + size] for i in range(0, len(positions), size)]


@torch.no_grad()
def grouped_step(members, *, step, scalars, options, axes, indices=None) -> None:
    """One step of variables of one shape, dtype and kind of state (`group_key`), in place: `step` and
    `scalars` on their device, `indices` their int32 positions in the optimizer (stochastic rounding's keys)."""
    first = members[0]
    params = [m.param for m in members]
    grads = torch.stack([m.grad for m in members]).float()
    slots = [[m.slots[i] for m in members] for i in range(len(first.slots))]
    result = adafactor_math.preconditioned(
        grads,
        params,
        tuple(torch.stack(s) for s in slots),
        options=options,
        factored_axes=axes,
        evaluation=TorchEvaluation(batch_dims=1),
        scalars=scalars,
    )
    for targets, value in zip(slots, result.slots):
        torch._foreach_copy_(targets, value.unbind(0))
    momenta = None if first.momentum is None else [m.momentum for m in members]
    deltas, new_momenta = adafactor_math.elementwise_update(
        grads, result.factors, None if momenta is None else torch.stack(momenta), options
    )
    # Stochastic rounding's keys: each member's index.
    column = (
        indices.reshape((-1,) + (1,) * first.param.dim()) if options.stochastic_rounding else None
    )
    adafactor_math.write_back(
        params,
        deltas,
        momenta,
        new_momenta,
        rounding=adafactor_math.rounding(options, step, column, tuple(first.param.shape)),
        assign=lambda targets, stacked: torch._foreach_copy_(targets, stacked.unbind(0)),
        assign_sub=lambda targets, stacked: torch._foreach_sub_(targets, stacked.unbind(0)),
        value=lambda: torch.stack(params),
    )
