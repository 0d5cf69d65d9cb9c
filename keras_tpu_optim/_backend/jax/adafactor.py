"""Adafactor on JAX: the reductions measured on CPU.

XLA's CPU backend fuses the sibling row and column reductions of a factored
step into one loop, and recomputes the statistics inside the update's
reduction, both several times slower than separate passes. Optimisation
barriers keep those computations apart on CPU; elsewhere XLA's own fusion
decisions stand (the neutral reductions).
"""

from __future__ import annotations

import jax
from keras import ops

from keras_tpu_optim._math import adafactor as adafactor_math


class CpuReductions(adafactor_math.Reductions):
    """Optimisation barriers between the step's reductions; scalar means reduced rows first."""

    def mean_square(self, x):
        if len(x.shape) < 2:
            return super().mean_square(x)
        return ops.mean(ops.mean(ops.square(x), axis=-1))

    def separately(self, x):
        return jax.lax.optimization_barrier(x)


CPU_REDUCTIONS = CpuReductions()


def adafactor_reductions(platform: str) -> adafactor_math.Reductions:
    """The reductions for a variable on `platform`: barriers on CPU, the neutral forms elsewhere."""
    return CPU_REDUCTIONS if platform == "cpu" else adafactor_math.NEUTRAL

