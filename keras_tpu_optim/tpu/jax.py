"""Export to JAX SparseCore (`jax_tpu_embedding`): `EmbeddingAdam`'s `row_update` as a custom optimizer,
the bias-corrected learning rate its only hyperparameter."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim.tpu import _export

_ENGINE = "SparseCore embedding engine"


@dataclasses.dataclass(frozen=True)
class RowUpdateComputation:
    """A frozen dataclass, not a closure: exports with the same options compare equal, and
    `jax_tpu_embedding` stacks only tables with equal specs."""

    options: adam_math.RowUpdateOptions

    def __call__(self, grad, table, momenta, velocities, learning_rate):
        return tuple(
            adam_math.row_update(grad, table, momenta, velocities, learning_rate, self.options)
        )


@dataclasses.dataclass(frozen=True)
class BiasCorrectedLearningRate:
    """`lr_t` at the engine's step count (the updates applied, as `optimizer.iterations`); equal for
    the same optimizer, so that tables exported one by one still stack."""

    optimizer: Any

    def __call__(self, step):
        return self.optimizer._row_learning_rate(step)

    def __repr__(self):
        return f"BiasCorrectedLearningRate({self.optimizer.name!r})"


def to_tpu_embedding(optimizer, iterations=None) -> embedding_spec.CustomOptimizerSpec:
    """See `keras_tpu_optim.tpu.to_tpu_embedding`."""
    if iterations is not None:
        raise ValueError(
            "`to_tpu_embedding` on JAX takes no `iterations`: SparseCore passes its own step count to the "
            f"exported learning rate. Received: iterations={iterations!r}"
        )
    o = optimizer
    _export.check_options(
        o,
        _ENGINE,
        ("lazy_adam", not o.lazy_adam),
        ("use_gradient_accumulation", not o.use_gradient_accumulation),
        ("slot_variable_creation_fn", o.slot_variable_creation_fn is not None),
        ("low_dimensional_packing_status", o.low_dimensional_packing_status),
    )
    return embedding_spec.CustomOptimizerSpec(
        learning_rate=BiasCorrectedLearningRate(optimizer),
        custom_computation_fn=RowUpdateComputation(optimizer._row_update_options()),
        slot_variable_initializers_tuple=(jax.nn.initializers.zeros, jax.nn.initializers.zeros),
        short_name_str="embedding_adam",
    )
