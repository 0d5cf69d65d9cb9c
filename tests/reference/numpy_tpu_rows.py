"""What a TPU embedding engine computes for one row, in numpy, from docs/algorithms.md#embeddingadam and #export-to-tpu-embedding-engines.

The engines apply Adam with no bias correction (TF's optimization_parameters.proto,
AdamParameters): the bias correction lives entirely in the dynamic learning rate
they are fed, `lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`. Given that rate,
a row is updated exactly as docs/algorithms.md#embeddingadam says. Float64 throughout; written from
the formulas, not from the package's code.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np


def bias_corrected_learning_rate(
    learning_rate: float, step: int, beta_1: float, beta_2: float
) -> float:
    """`lr_t` for the 1-based step `step`."""
    return learning_rate * np.sqrt(1.0 - beta_2**step) / (1.0 - beta_1**step)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine's static configuration for a table (the fields of the TF proto)."""

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    sum_inside_sqrt: bool = True
    gradient_clip: Tuple[Optional[float], Optional[float]] = (None, None)
    weight_clip: Tuple[Optional[float], Optional[float]] = (None, None)
    weight_decay_factor: Optional[float] = None
    multiply_weight_decay_factor_by_learning_rate: bool = False

    @classmethod
    def from_proto(cls, parameters) -> "EngineOptions":
        """Read a TF `OptimizationParameters` the way the TPU does."""

        def limits(field):
            if not parameters.HasField(field):
                return (None, None)
            message = getattr(parameters, field)
            return (
                message.lower.value if message.HasField("lower") else None,
                message.upper.value if message.HasField("upper") else None,
            )

        return cls(
            beta_1=parameters.adam.beta1,
            beta_2=parameters.adam.beta2,
            epsilon=parameters.adam.epsilon,
            sum_inside_sqrt=parameters.adam.use_sum_inside_sqrt,
            gradient_clip=limits("gradient_clipping_limits"),
            weight_clip=limits("clipping_limits"),
            weight_decay_factor=parameters.weight_decay_factor or None,
            multiply_weight_decay_factor_by_learning_rate=parameters.multiply_weight_decay_factor_by_learning_rate,
        )


def _clip(x, bounds):
    low, high = bounds
    if low is not None:
        x = np.maximum(x, low)
    if high is not None:
        x = np.minimum(x, high)
    return x


def engine_row_update(grad, weight, momenta, velocities, learning_rate, options: EngineOptions):
    """One step of the engine on rows, `learning_rate` being the fed (bias-corrected) rate."""
    grad, weight, momenta, velocities = (
        np.asarray(a, np.float64) for a in (grad, weight, momenta, velocities)
    )
    grad = _clip(grad, options.gradient_clip)
    if options.weight_decay_factor is not None:
        decay = options.weight_decay_factor
        if options.multiply_weight_decay_factor_by_learning_rate:
            decay *= learning_rate
        weight = weight - decay * weight
    momenta = options.beta_1 * momenta + (1.0 - options.beta_1) * grad
    velocities = options.beta_2 * velocities + (1.0 - options.beta_2) * grad**2
    if options.sum_inside_sqrt:
        weight = weight - learning_rate * momenta / np.sqrt(velocities + options.epsilon**2)
    else:
        weight = weight - learning_rate * momenta / (np.sqrt(velocities) + options.epsilon)
    return _clip(weight, options.weight_clip), momenta, velocities
