"""Adafactor's update rule as small pure functions of arrays (SPEC.md §2).

Everything here is `keras.ops` on float32 arrays, so it runs on every backend
and compiles under XLA. The `Adafactor` class only moves variables in and out.

Names follow Shazeer & Stern (2018): `rho` the relative step size, `alpha` the
absolute step size, `R`/`C` the row/column second-moment statistics.
"""

from __future__ import annotations

import keras
from keras import ops


def mean_square(x):
    """Mean of `x^2` over all elements.

    Reduced in two stages (rows, then their means) for rank >= 2: XLA's CPU
    backend in TF runs a reduction to a scalar on one thread. On TF the row
    means are a matrix-vector product (see `_weighted_row_mean`): TF's XLA
    writes `x^2` to memory before reducing it, but fuses it into a product
    (a 768x3072 Adafactor step: 3.4 -> 2.6 ms).
    """
    if len(x.shape) >= 2:
        if keras.backend.backend() == "tensorflow":
            # Ones that XLA cannot fold into a constant: exactly 1 unless x
            # holds a NaN in its first row, when the mean is NaN anyway.
            ones = ops.sign(ops.abs(x[..., 0, :]) + 1.0)
            return ops.mean(_weighted_row_mean(ops.square(x), ones))
        return ops.mean(ops.mean(ops.square(x), axis=-1))
    return ops.mean(ops.square(x))


def rms(x):
    """Root mean square over all elements."""
    return ops.sqrt(mean_square(x))


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


def _separately(x):
    """`x` (an array or a tuple) behind an optimisation barrier on JAX.

    XLA's CPU backend in JAX otherwise fuses the reductions of a factored
    update into loops that run ~4x slower than separate passes (sibling row
    and column reductions in one loop; the statistics recomputed inside the
    update's reduction): a 32000x768 step takes 40 ms without, 12 ms with.
    TF's XLA schedules them differently; there barriers cost ~7% on the
    BERT-base stack's 768-wide matrices, so they are JAX-only.
    """
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.optimization_barrier(x)
    return x


def _weighted_row_mean(x, weights):
    """`mean(x * weights, axis=-1)` for `x` `[..., n, m]` and `weights` `[..., m]`.

    On TensorFlow a matrix-vector product: TF's XLA CPU backend runs dots
    multithreaded but reductions on one thread (BERT-base stack under
    `jit_compile=True`: ~15% of the step), and without XLA the product needs
    no `[n, m]` temporary. JAX's XLA is the other way round (its matvec on a
    `[32000, 768]` matrix is slower than the fused reduction).
    """
    if keras.backend.backend() == "tensorflow":
        product = ops.matmul(x, ops.expand_dims(weights, -1))
        # The static width may be unknown (tf.distribute replica updates).
        return ops.squeeze(product, -1) / ops.cast(ops.shape(x)[-1], x.dtype)
    return ops.mean(x * ops.expand_dims(weights, -2), axis=-1)


_FOLDS = 8


def _column_mean(x):
    """`mean(x, axis=-2)`.

    On TensorFlow the rows are first folded onto an eighth of them by adding
    eight row blocks: TF's XLA CPU backend writes `x` (here `g^2`) to memory
    before a column reduction, but fuses it into those additions, and the
    reduction that is left reads an eighth of the data (768x3072: 0.97 ->
    0.33 ms; 32000x768: 8.1 -> 3.5 ms). More blocks, or a second fold, were
    slower.
    """
    rows = x.shape[-2]
    if keras.backend.backend() != "tensorflow" or rows is None or rows < 2 * _FOLDS:
        return ops.mean(x, axis=-2)
    height = rows // _FOLDS
    folded = x[..., :height, :]
    for block in range(1, _FOLDS):
        folded = folded + x[..., block * height : (block + 1) * height, :]
    total = ops.sum(folded, axis=-2)
    if rows % _FOLDS:
        total = total + ops.sum(x[..., _FOLDS * height :, :], axis=-2)
    return total / rows


def factored_second_moment(grad, row, column, beta2_t, epsilon_1):
    """New row (`mean(G2, -1)`) and column (`mean(G2, -2)`) statistics, `G2 = g^2 + epsilon_1`."""
    if keras.backend.backend() == "tensorflow":
        # The row means as a product with a vector of ones that XLA cannot
        # fold back into a reduction (a constant would be): the column
        # statistics are >= 0, so sign(column + 1) is exactly 1 (NaN only if
        # they already are, when the whole update is NaN anyway).
        # TF-XLA, BERT-base stack: ~15% of the step (see _weighted_row_mean).
        row_mean = _weighted_row_mean(ops.square(grad), ops.sign(column + 1.0)) + epsilon_1
    else:
        row_mean = ops.mean(ops.square(grad), axis=-1) + epsilon_1
    column_mean = _column_mean(ops.square(_separately(grad))) + epsilon_1
    row = beta2_t * row + (1.0 - beta2_t) * row_mean
    column = beta2_t * column + (1.0 - beta2_t) * column_mean
    return row, column


def factored_preconditioner(grad, row, column):
    """The factors of `1 / sqrt(V)`, `V = (R / mean(R)) outer C`, never materialising V.

    Returns `(row_factor, column_factor, update_mean_square)`: the update is
    `grad * row_factor[..., :, None] * column_factor[..., None, :]`, and
    `update_mean_square` is `mean(update^2)` computed from the factors,
    `mean_i(r_i^2 * mean_j(g_ij^2 c_j^2))`, so that the update need not be
    written to memory to be reduced.
    """
    row_factor = ops.rsqrt(row / ops.mean(row, axis=-1, keepdims=True))
    column_factor = ops.rsqrt(column)
    grad, row_factor, column_factor = _separately((grad, row_factor, column_factor))
    row_mean_square = _weighted_row_mean(ops.square(grad), ops.square(column_factor))
    update_mean_square = ops.mean(ops.square(row_factor) * row_mean_square)
    return row_factor, column_factor, update_mean_square


def unfactored_second_moment(grad_sq, second_moment, beta2_t):
    return beta2_t * second_moment + (1.0 - beta2_t) * grad_sq


def clip_factor(update_mean_square, clip_threshold):
    """`1 / max(1, RMS(u) / d)`: the update clipping of the paper (§6), given `mean(u^2)`."""
    return 1.0 / ops.maximum(1.0, ops.sqrt(update_mean_square) / clip_threshold)


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
    beta2_t = second_moment_decay(step, beta_2_decay)
    if len(second_moment_slots) == 2:
        row, column = factored_second_moment(grad, *second_moment_slots, beta2_t, epsilon_1)
        second_moment_slots = (row, column)
        row_factor, column_factor, update_mean_square = factored_preconditioner(grad, row, column)
        # The scalars ride on the row factor: two full-size products, not four
        # (what eager and non-XLA graphs pay for; XLA fuses either form).
        scale = alpha * clip_factor(update_mean_square, clip_threshold)
        delta = grad * ops.expand_dims(row_factor * scale, -1) * ops.expand_dims(column_factor, -2)
    else:
        (v,) = second_moment_slots
        v = unfactored_second_moment(ops.square(grad) + epsilon_1, v, beta2_t)
        second_moment_slots = (v,)
        update = grad * ops.rsqrt(v)
        delta = update * (alpha * clip_factor(mean_square(update), clip_threshold))
    if beta_1 is not None:
        # Momentum of the scaled update, as optax/t5x: no bias correction.
        momentum = beta_1 * momentum + (1.0 - beta_1) * delta
        delta = momentum
    return delta, second_moment_slots, momentum
