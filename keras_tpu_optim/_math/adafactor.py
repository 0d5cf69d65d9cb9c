"""Adafactor's update rule as small pure functions of arrays (SPEC.md §2).

Everything here is `keras.ops` on float32 arrays, so it runs on every backend
and compiles under XLA. The `Adafactor` class only moves variables in and out.

Names follow Shazeer & Stern (2018): `rho` the relative step size, `alpha` the
absolute step size, `R`/`C` the row/column second-moment statistics.
"""

from __future__ import annotations

from keras import ops


def rms(x):
    """Root mean square over all elements."""
    return ops.sqrt(ops.mean(ops.square(x)))


def relative_step_size(learning_rate, step, relative_step: bool):
    """`rho_t`: the learning rate, capped at `1/sqrt(t)` when `relative_step`."""
    if relative_step:
        return ops.minimum(learning_rate, ops.rsqrt(step))
    return learning_rate


def absolute_step_size(rho, param, epsilon_2, multiply_by_parameter_scale: bool):
    """`alpha_t`: `rho_t` scaled by the parameter's RMS (floored at epsilon_2)."""
    if multiply_by_parameter_scale:
        return ops.maximum(epsilon_2, rms(param)) * rho
    return rho


def second_moment_decay(step, beta_2_decay):
    """`beta2_t = 1 - t^beta_2_decay`."""
    return 1.0 - ops.power(step, beta_2_decay)


def factored_second_moment(grad_sq, row, column, beta2_t):
    """New row (`mean(G2, -1)`) and column (`mean(G2, -2)`) statistics."""
    row = beta2_t * row + (1.0 - beta2_t) * ops.mean(grad_sq, axis=-1)
    column = beta2_t * column + (1.0 - beta2_t) * ops.mean(grad_sq, axis=-2)
    return row, column


def factored_preconditioned_gradient(grad, row, column):
    """`g / sqrt(V)` with `V = (R / mean(R)) outer C`, never materialising V."""
    row_factor = ops.rsqrt(row / ops.mean(row, axis=-1, keepdims=True))
    column_factor = ops.rsqrt(column)
    return grad * ops.expand_dims(row_factor, -1) * ops.expand_dims(column_factor, -2)


def unfactored_second_moment(grad_sq, second_moment, beta2_t):
    return beta2_t * second_moment + (1.0 - beta2_t) * grad_sq


def clip_by_rms(update, clip_threshold):
    """`u / max(1, RMS(u) / d)`: the update clipping of the paper (§6)."""
    return update / ops.maximum(1.0, rms(update) / clip_threshold)


def adafactor_update(
    grad,
    param,
    second_moment_slots,
    momentum,
    *,
    learning_rate,
    step,
    beta_2_decay: float,
    epsilon_1: float,
    epsilon_2: float,
    clip_threshold: float,
    relative_step: bool,
    multiply_by_parameter_scale: bool,
    beta_1: float | None,
):
    """One Adafactor step for one variable, all arrays float32.

    Args:
        grad: the gradient.
        param: the parameter value (read for its RMS only).
        second_moment_slots: `(row, column)` for a factored variable, `(v,)`
            otherwise.
        momentum: the first-moment slot, or None when `beta_1` is None.
        learning_rate, step: scalars; `step` is `iterations + 1`.

    Returns:
        `(delta, second_moment_slots, momentum)`: `param - delta` is the new
        parameter; the slots are the new statistics.
    """
    rho = relative_step_size(learning_rate, step, relative_step)
    alpha = absolute_step_size(rho, param, epsilon_2, multiply_by_parameter_scale)
    grad_sq = ops.square(grad) + epsilon_1
    beta2_t = second_moment_decay(step, beta_2_decay)
    if len(second_moment_slots) == 2:
        row, column = factored_second_moment(grad_sq, *second_moment_slots, beta2_t)
        second_moment_slots = (row, column)
        update = factored_preconditioned_gradient(grad, row, column)
    else:
        (v,) = second_moment_slots
        v = unfactored_second_moment(grad_sq, v, beta2_t)
        second_moment_slots = (v,)
        update = grad * ops.rsqrt(v)
    delta = alpha * clip_by_rms(update, clip_threshold)
    if beta_1 is not None:
        # Momentum of the scaled update, as optax/t5x: no bias correction.
        momentum = beta_1 * momentum + (1.0 - beta_1) * delta
        delta = momentum
    return delta, second_moment_slots, momentum
