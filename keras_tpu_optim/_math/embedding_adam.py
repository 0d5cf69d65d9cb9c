"""EmbeddingAdam's per-row update as one pure function (docs/algorithms.md#embeddingadam).

`row_update` is the single source of truth for the math: the Keras optimizer
calls it on the gathered rows of a table (or on the whole table), and the TPU
export hands the very same function to the JAX SparseCore engine as its
per-row custom optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from keras import ops


@dataclasses.dataclass(frozen=True)
class RowUpdateOptions:
    """The static (trace-time) options of the row update."""

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    sum_inside_sqrt: bool = True
    gradient_clip_min: Optional[float] = None
    gradient_clip_max: Optional[float] = None
    clip_weight_min: Optional[float] = None
    clip_weight_max: Optional[float] = None
    weight_decay_factor: Optional[float] = None
    multiply_weight_decay_factor_by_learning_rate: bool = False
    # "full": v has the table's shape; "rowwise": one v per row, of the mean of g^2 over the row.
    second_moment: str = "full"
    # "global": `learning_rate` is lr_t (t = iterations + 1); "per_row": it is the
    # uncorrected lr, and each row is corrected with its own count of updates.
    bias_correction: str = "global"

    @property
    def slot_names(self) -> tuple:
        """The slots `row_update` takes and returns after the weights, in order."""
        return ("momenta", "velocities") + (("row_steps",) if self.bias_correction == "per_row" else ())


def bias_corrected_learning_rate(learning_rate, step, beta_1: float, beta_2: float):
    """`lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`, t = iterations + 1.

    The TPU embedding engines apply no bias correction, so this is also the
    dynamic learning rate the TPU export feeds them. `1 - beta^t` is computed
    as `-expm1(t * log(beta))` with `log(beta)` in float64: in float32,
    `1 - 0.999**1` loses five digits to cancellation.
    """
    return learning_rate * ops.sqrt(_one_minus_power(beta_2, step)) / _one_minus_power(beta_1, step)


def _one_minus_power(beta: float, step):
    if beta == 0.0:
        return ops.ones_like(step)
    return -ops.expm1(step * math.log(beta))


def clip_between(x, low: Optional[float], high: Optional[float]):
    """Clip with either bound optional (None = unbounded on that side)."""
    if low is not None:
        x = ops.maximum(x, low)
    if high is not None:
        x = ops.minimum(x, high)
    return x


def _per_row(x, like):
    """A `(rows,)` array shaped to broadcast against `like` (`(rows, *row_shape)`)."""
    return ops.reshape(x, (-1,) + (1,) * (len(like.shape) - 1))


def row_update(grad, weight, momenta, velocities, learning_rate, options: RowUpdateOptions, row_steps=None):
    """Adam on rows, with TPU-embedding semantics.

    Args:
        grad, weight, momenta: float32 arrays of the same shape (`[rows,
            *row_shape]`, or any shape whose rows are updated independently).
        velocities: float32, of that shape (`second_moment="full"`) or
            `[rows]` (`"rowwise"`: one second moment per row, of the mean of
            `g^2` over the row).
        learning_rate: a scalar: the bias-corrected rate `lr_t` with
            `bias_correction="global"`, the uncorrected `lr` with `"per_row"`.
        options: the static options.
        row_steps: with `bias_correction="per_row"`, the `[rows]` int32 count
            of updates each row has had; the row is corrected with
            `c = row_steps + 1`: `lr_c = lr * sqrt(1 - beta_2^c) / (1 - beta_1^c)`.

    Returns:
        `(weight, momenta, velocities)`, the updated rows, and the updated
        `row_steps` after them with `bias_correction="per_row"`.
    """
    o = options
    per_row = o.bias_correction == "per_row"
    if per_row:
        if row_steps is None:
            raise ValueError('`bias_correction="per_row"` needs the rows\' `row_steps`.')
        row_steps = row_steps + ops.ones_like(row_steps)
        count = ops.cast(row_steps, "float32")
        learning_rate = _per_row(bias_corrected_learning_rate(learning_rate, count, o.beta_1, o.beta_2), weight)
    grad = clip_between(grad, o.gradient_clip_min, o.gradient_clip_max)
    if o.weight_decay_factor is not None:
        decay = o.weight_decay_factor
        if o.multiply_weight_decay_factor_by_learning_rate:
            decay = decay * learning_rate
        weight = weight - decay * weight
    momenta = o.beta_1 * momenta + (1.0 - o.beta_1) * grad
    square = ops.square(grad)
    if o.second_moment == "rowwise" and len(grad.shape) > 1:
        square = ops.mean(square, axis=tuple(range(1, len(grad.shape))))
    velocities = o.beta_2 * velocities + (1.0 - o.beta_2) * square
    if o.sum_inside_sqrt:
        denominator = ops.sqrt(velocities + o.epsilon**2)
    else:
        denominator = ops.sqrt(velocities) + o.epsilon
    if len(denominator.shape) < len(weight.shape):
        denominator = _per_row(denominator, weight)
    weight = weight - learning_rate * momenta / denominator
    weight = clip_between(weight, o.clip_weight_min, o.clip_weight_max)
    if per_row:
        return weight, momenta, velocities, row_steps
    return weight, momenta, velocities
