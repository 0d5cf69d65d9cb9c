"""Export to JAX SparseCore (`jax_tpu_embedding`, and keras-rs's `DistributedEmbedding` on JAX).

SparseCore traces a custom optimizer on `[1, dim]` float32 rows (hyperparameters too) in the
order `(grad, table, *slots, *hyperparameters)`, expecting `(table, *slots)` back: ours is
`EmbeddingAdam`'s `row_update`, the bias-corrected learning rate its only hyperparameter.
"""

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
    """The per-row computation; a frozen dataclass, not a closure, so that exports with the
    same options compare equal (`jax_tpu_embedding` stacks only tables with equal specs)."""

    options: adam_math.RowUpdateOptions

    def __call__(self, grad, table, momenta, velocities, learning_rate):
        return tuple(
            adam_math.row_update(grad, table, momenta, velocities, learning_rate, self.options)
        )


@dataclasses.dataclass(frozen=True)
class BiasCorrectedLearningRate:
    """`lr_t` at the engine's step count: the updates already applied (keras-rs counts from 0,
    like `optimizer.iterations`), so the bias correction uses `t = step + 1`. Equal for the
    same optimizer, so that exporting it once per table still lets tables stack."""

    optimizer: Any

    def __call__(self, step):
        return _export.bias_corrected_learning_rate_at(self.optimizer, step)

    def __repr__(self):
        return f"BiasCorrectedLearningRate({self.optimizer.name!r})"


def _check_sparsecore_options(optimizer) -> None:
    def unsupported(option, why):
        return _export.unsupported_option(option, getattr(optimizer, option), why)

    if not optimizer.lazy_adam:
        raise unsupported(
            "lazy_adam",
            f"the {_ENGINE} updates only the rows looked up in the step; ordinary (non-lazy) "
            "Adam would also decay the slots of every other row.",
        )
    if not optimizer.use_gradient_accumulation:
        raise unsupported(
            "use_gradient_accumulation",
            f"the {_ENGINE} always sums the gradients of duplicate ids, so it cannot reproduce "
            "the last-occurrence-wins update of `use_gradient_accumulation=False`.",
        )
    if optimizer.slot_variable_creation_fn is not None:
        raise unsupported(
            "slot_variable_creation_fn",
            f"the {_ENGINE} creates the slots itself from initializers (zeros).",
        )
    if optimizer.low_dimensional_packing_status:
        raise unsupported(
            "low_dimensional_packing_status",
            f"it is a setting of TensorFlow's TPUEmbedding; the {_ENGINE} has no such setting.",
        )


def to_tpu_embedding(optimizer) -> embedding_spec.CustomOptimizerSpec:
    """See `keras_tpu_optim.tpu.to_tpu_embedding`."""
    _export.check_keras_options(optimizer, _ENGINE)
    _export.check_row_options(optimizer, _ENGINE)
    _check_sparsecore_options(optimizer)
    return embedding_spec.CustomOptimizerSpec(
        learning_rate=BiasCorrectedLearningRate(optimizer),
        custom_computation_fn=RowUpdateComputation(optimizer._row_update_options()),
        slot_variable_initializers_tuple=(jax.nn.initializers.zeros, jax.nn.initializers.zeros),
        short_name_str="embedding_adam",
    )
