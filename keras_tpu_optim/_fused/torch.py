"""Adafactor on eager torch: in place, in one reused scratch buffer.

`keras.ops` on torch materialises every intermediate (g^2, the factored
second moment, the update, its square...) in freshly allocated memory; on
CPU a fresh 100 MB tensor costs as much as several passes over it (page
faults). Here every full-size intermediate lives in one scratch buffer, kept
between steps and sized for the largest variable, and scalars are Python
floats.
"""

from __future__ import annotations

import math

import torch


_scratch: dict = {}


def _scratch_like(x):
    """A float32 buffer of x's shape, reused across variables and steps."""
    key = x.device
    buffer = _scratch.get(key)
    if buffer is None or buffer.numel() < x.numel():
        buffer = _scratch[key] = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    return buffer[: x.numel()].view(x.shape)


@torch.no_grad()
def adafactor_step(
    grad,
    param,
    second_moment_slots,
    momentum,
    *,
    learning_rate: float,
    step: float,
    beta_2_decay: float,
    epsilon_1: float,
    epsilon_2: float,
    clip_threshold: float,
    relative_step: bool,
    multiply_by_parameter_scale: bool,
    beta_1: float | None,
):
    """One Adafactor step for one variable, updating `param` and the slots in place.

    Same arguments as `_math.adafactor.adafactor_update`, with torch tensors for
    the arrays (slots float32) and Python floats for the scalars.
    """
    grad = grad.to(torch.float32)
    param32 = param if param.dtype == torch.float32 else param.to(torch.float32)
    size = grad.numel()
    rho = min(learning_rate, 1.0 / math.sqrt(step)) if relative_step else learning_rate
    alpha = rho
    if multiply_by_parameter_scale:
        param_rms = torch.linalg.vector_norm(param32).item() / math.sqrt(size)
        alpha = max(epsilon_2, param_rms) * rho
    decay_weight = step**beta_2_decay  # 1 - beta2_t: the weight of the new statistic.
    if len(second_moment_slots) == 2:
        row, column = second_moment_slots
        grad_sq = torch.mul(grad, grad, out=_scratch_like(grad))
        row.lerp_(grad_sq.mean(dim=-1).add_(epsilon_1), decay_weight)
        column.lerp_(grad_sq.mean(dim=-2).add_(epsilon_1), decay_weight)
        row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_()
        update = torch.mul(grad, row_factor.unsqueeze(-1), out=grad_sq)
        update.mul_(column.rsqrt().unsqueeze(-2))
    else:
        (second_moment,) = second_moment_slots
        grad_sq = torch.mul(grad, grad, out=_scratch_like(grad)).add_(epsilon_1)
        second_moment.lerp_(grad_sq, decay_weight)
        update = torch.rsqrt(second_moment, out=grad_sq).mul_(grad)
    update_rms = torch.linalg.vector_norm(update).item() / math.sqrt(size)
    scale = alpha / max(1.0, update_rms / clip_threshold)
    if beta_1 is not None:
        momentum.mul_(beta_1).add_(update, alpha=(1.0 - beta_1) * scale)
        param32.sub_(momentum)
    else:
        param32.add_(update, alpha=-scale)
    if param32 is not param:
        param.copy_(param32)
