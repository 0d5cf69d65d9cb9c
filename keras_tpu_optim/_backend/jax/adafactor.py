"""Adafactor on JAX: how its sums are evaluated on CPU.

XLA's CPU backend fuses the sibling row and column reductions of a factored
step into one loop, and recomputes the statistics inside the update's
reduction, both several times slower than separate passes. Optimisation
barriers keep those computations apart on CPU; elsewhere XLA's own fusion
decisions stand (the neutral evaluation).
"""

from __future__ import annotations

import jax

from keras_tpu_optim._math import adafactor as adafactor_math


class CpuEvaluation(adafactor_math.Evaluation):
    """Optimisation barriers between the step's reductions."""

    def square_sums(self, x, axes):
        # Each sum its own pass over `x`: XLA would fuse sibling reductions into one slower loop.
        sums = []
        for index, axis in enumerate(axes):
            sums += super().square_sums(self.separately(x) if index else x, (axis,))
        return tuple(sums)

    def separately(self, x):
        return jax.lax.optimization_barrier(x)


CPU_EVALUATION = CpuEvaluation()


def adafactor_evaluation(platform: str) -> adafactor_math.Evaluation:
    """How a step of a variable on `platform` is evaluated: barriers on CPU, the neutral form elsewhere."""
    return CPU_EVALUATION if platform == "cpu" else adafactor_math.NEUTRAL
