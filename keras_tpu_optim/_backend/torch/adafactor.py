"""Adafactor on eager torch: in place, in one reused scratch buffer, with no host syncs.

`keras.ops` on torch materialises every intermediate (g^2, the update, ...) in
fresh memory; here every full-size intermediate lives in one float32 buffer
owned by the optimizer. Every scalar (learning rate, step, norms) stays a 0-d
tensor on the variable's device: reading one back (`.item()`, `float()`)
would stall the host until the device queue drains, once per variable.
"""

from __future__ import annotations

import math

import torch

from keras_tpu_optim._math import stochastic_rounding

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Scratch:
    """Full-size float32 scratch for one optimizer's eager steps: grown to the largest variable, reused, released with its owner."""

    def __init__(self):
        self._buffer = None

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """A float32 view of x's shape on x's device (contents undefined)."""
        if self._buffer is None or self._buffer.device != x.device or self._buffer.numel() < x.numel():
            self._buffer = None  # Free the old buffer before allocating its successor.
            self._buffer = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        return self._buffer[: x.numel()].view(x.shape)

    def release(self) -> None:
        self._buffer = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x) / math.sqrt(x.numel())


def _as_float32(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x if float32, else x copied into `out` (a casting copy_ allocates nothing)."""
    return x if x.dtype == torch.float32 else out.copy_(x)


@torch.no_grad()
def adafactor_step(
    grad, param, second_moment_slots, momentum, *, learning_rate, step, options, scratch, variable_index=0
) -> None:
    """One Adafactor step for one variable, in place, with no host-device synchronisation.

    `second_moment_slots` is `(row, column)` for a factored variable, else `(v,)`,
    all float32; `momentum` (or None) is float32 or bfloat16 (`momentum_dtype`:
    computed in float32, stored rounded). `learning_rate` and `step`
    (iterations + 1) are 0-d tensors; `options` holds the static hyperparameters;
    `variable_index` keys stochastic rounding's random bits. A non-float32
    `param` is updated in float32 and rounded once (to nearest, or
    stochastically with `options.stochastic_rounding`).
    """
    lr = learning_rate.to(param.device, torch.float32, non_blocking=True)
    step_count = step.to(param.device, non_blocking=True)
    step = step_count.to(torch.float32)
    buffer = scratch.like(param)
    rho = torch.minimum(lr, step.rsqrt()) if options.relative_step else lr
    alpha = rho
    if options.multiply_by_parameter_scale:
        # Not vector_norm(param, dtype=float32): it would allocate a float32 copy.
        alpha = torch.clamp_min(_rms(_as_float32(param, buffer)), options.epsilon_2) * rho
    decay_step = torch.clamp_min(step - float(options.decay_offset), 1.0) if options.decay_offset else step
    decay_weight = decay_step.pow(options.beta_2_decay)  # 1 - beta2_t: the weight of the new statistic.
    if options.beta_2_cap is not None:
        decay_weight = torch.clamp_min(decay_weight, 1.0 - options.beta_2_cap)  # beta2_t <= beta_2_cap.
    grad32 = _as_float32(grad, buffer)
    grad_sq = torch.mul(grad32, grad32, out=buffer)
    if len(second_moment_slots) == 2:
        row, column = second_moment_slots
        # Row statistics: means over axis b; column statistics: over axis a (the last two, or the two largest).
        a, b = options.factored_axes(param.shape)
        a_in_row = a - (b < a)
        row.lerp_(grad_sq.mean(dim=b).add_(options.epsilon_1), decay_weight)
        column.lerp_(grad_sq.mean(dim=a).add_(options.epsilon_1), decay_weight)
        row_factor = (row / row.mean(dim=a_in_row, keepdim=True)).rsqrt_()
        update = torch.mul(_as_float32(grad, buffer), row_factor.unsqueeze(b), out=buffer)
        update.mul_(column.rsqrt().unsqueeze(a))
    else:
        (second_moment,) = second_moment_slots
        second_moment.lerp_(grad_sq.add_(options.epsilon_1), decay_weight)
        # A low-precision grad is cast on the fly (CUDA) or into a temporary (CPU).
        update = torch.rsqrt(second_moment, out=buffer).mul_(grad)
    scale = alpha / torch.clamp_min(_rms(update) / options.clip_threshold, 1.0)
    # addcmul_ multiplies by the 0-d tensor in the same pass (add_'s alpha takes only numbers).
    # Type promotion updates a bf16/fp16 param in float32 and rounds it once.
    if options.beta_1 is not None:
        if momentum.dtype == torch.float32:
            momentum.mul_(options.beta_1).addcmul_(update, (1.0 - options.beta_1) * scale)
            delta = momentum
        else:
            # A bfloat16 slot: the new momentum in float32 (in the scratch), stored rounded, used unrounded.
            delta = update.mul_((1.0 - options.beta_1) * scale).add_(momentum, alpha=options.beta_1)
            momentum.copy_(delta)
        if not (options.stochastic_rounding and param.dtype in _LOW_PRECISION):
            param.sub_(delta)
            return
        new_value = delta.neg_().add_(param) if delta is buffer else torch.sub(param, delta, out=buffer)
    else:
        if not (options.stochastic_rounding and param.dtype in _LOW_PRECISION):
            param.addcmul_(update, scale, value=-1.0)
            return
        new_value = update.mul_(-scale).add_(param)
    param.copy_(
        stochastic_rounding.stochastic_round(
            new_value, param.dtype, seed=options.seed, step=step_count, variable_index=variable_index
        )
    )
