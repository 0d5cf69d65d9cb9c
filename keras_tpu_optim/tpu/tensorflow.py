"""Export to TensorFlow's TPU embedding engine (`TPUEmbedding`, `TPUEmbeddingV2`, keras-rs)."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb

from keras_tpu_optim.tpu import _export

_ENGINE = "TPU embedding engine"


class TPUEmbeddingAdam(tf.tpu.experimental.embedding.Adam):
    """`tf.tpu.experimental.embedding.Adam` whose configuration proto builds with protobuf >= 5
    (TF's own assigns a bool to the enum `low_dimensional_packing_status`)."""

    def _set_optimization_parameters(self, parameters: pb.OptimizationParameters) -> None:
        accumulation = pb.GradientAccumulationStatus
        parameters.gradient_accumulation_status = (
            accumulation.ENABLED if self.use_gradient_accumulation else accumulation.DISABLED
        )
        if self.clip_weight_min is not None:
            parameters.clipping_limits.lower.value = self.clip_weight_min
        if self.clip_weight_max is not None:
            parameters.clipping_limits.upper.value = self.clip_weight_max
        if self.clip_gradient_min is not None:
            parameters.gradient_clipping_limits.lower.value = self.clip_gradient_min
        if self.clip_gradient_max is not None:
            parameters.gradient_clipping_limits.upper.value = self.clip_gradient_max
        if self.weight_decay_factor:
            parameters.weight_decay_factor = self.weight_decay_factor
            if self.multiply_weight_decay_factor_by_learning_rate:
                parameters.multiply_weight_decay_factor_by_learning_rate = True
        packing = pb.LowDimensionalPackingStatus
        parameters.low_dimensional_packing_status = (
            packing.ENABLED if self.low_dimensional_packing_status else packing.DISABLED
        )
        parameters.adam.beta1 = self.beta_1
        parameters.adam.beta2 = self.beta_2
        parameters.adam.epsilon = self.epsilon
        parameters.adam.use_non_lazy_adam = not self.lazy_adam
        parameters.adam.use_sum_inside_sqrt = self.sum_inside_sqrt


class BiasCorrectedLearningRate:
    """`lr_t` of the coming step, called by the engine at each step (`TPUEmbedding.apply_gradients`), after
    `iterations` updates (the optimizer's own counter when None)."""

    def __init__(self, optimizer, iterations=None):
        self.optimizer = optimizer
        self.iterations = iterations

    def __call__(self):
        iterations = self.optimizer.iterations if self.iterations is None else self.iterations
        return self.optimizer._row_learning_rate(iterations)

    def __repr__(self):
        return f"BiasCorrectedLearningRate({self.optimizer.name!r})"


def to_tpu_embedding(optimizer, iterations=None) -> TPUEmbeddingAdam:
    """See `keras_tpu_optim.tpu.to_tpu_embedding`."""
    _export.check_options(optimizer, _ENGINE)
    options = optimizer._row_update_options()
    decay = options.weight_decay_factor
    # Without decay both stay None: TPUEmbeddingV2 refuses a table whose multiply flag is merely False.
    multiply = None if decay is None else options.multiply_weight_decay_factor_by_learning_rate
    clip = (options.gradient_clip_min, options.gradient_clip_max)
    return TPUEmbeddingAdam(
        learning_rate=BiasCorrectedLearningRate(optimizer, iterations),
        beta_1=options.beta_1,
        beta_2=options.beta_2,
        epsilon=options.epsilon,
        lazy_adam=optimizer.lazy_adam,
        sum_inside_sqrt=options.sum_inside_sqrt,
        use_gradient_accumulation=optimizer.use_gradient_accumulation,
        clip_weight_min=options.clip_weight_min,
        clip_weight_max=options.clip_weight_max,
        weight_decay_factor=decay,
        multiply_weight_decay_factor_by_learning_rate=multiply,
        slot_variable_creation_fn=optimizer.slot_variable_creation_fn,
        clipvalue=None if clip == (None, None) else clip,
        low_dimensional_packing_status=optimizer.low_dimensional_packing_status,
    )
