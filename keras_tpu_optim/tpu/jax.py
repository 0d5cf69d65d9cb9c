"""Export to JAX SparseCore (`jax_tpu_embedding`, and keras-rs's `DistributedEmbedding` on JAX).

SparseCore runs a custom optimizer as a per-row JAX function: `jax_tpu_embedding`
traces it with `jax.make_jaxpr` on `[1, dim]` float32 rows in the order
`(grad, table, *slots, *hyperparameters)` -- the hyperparameters too are traced
as `[1, dim]` rows, though it passes them as scalars -- and expects
`(table, *slots)` back. Ours is `EmbeddingAdam`'s own `row_update`, with the
static options baked in and the bias-corrected learning rate as the only
hyperparameter.
"""

from __future__ import annotations

import dataclasses

import jax
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim.tpu import _export

_ENGINE = "SparseCore embedding engine"


@dataclasses.dataclass(frozen=True)
class RowUpdateComputation:
    """The per-row custom computation: `(grad, table, momenta, velocities, learning_rate)`.

    A frozen dataclass rather than a closure so that two exports with the
    same options hash and compare equal: `jax_tpu_embedding` stacks only
    tables whose optimizer specs are equal.
    """

    options: adam_math.RowUpdateOptions

    def __call__(self, grad, table, momenta, velocities, learning_rate):
        return tuple(
            adam_math.row_update(grad, table, momenta, velocities, learning_rate, self.options)
        )


class BiasCorrectedLearningRate:
    """The SparseCore learning rate: `lr_t` as a function of the engine's step count.

    `step` is the number of updates already applied (keras-rs passes its own
    counter, starting at 0, like `optimizer.iterations`): the Keras schedule is
    evaluated at `step` and the bias correction uses `t = step + 1`.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self, step):
        return _export.bias_corrected_learning_rate_at(self.optimizer, step)

    # Equal for the same optimizer, so exporting it once per table still lets tables stack.
    def __eq__(self, other):
        return isinstance(other, BiasCorrectedLearningRate) and other.optimizer is self.optimizer

    def __hash__(self):
        return hash((BiasCorrectedLearningRate, id(self.optimizer)))

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
