"""Export of `EmbeddingAdam` to the TPU embedding engines (docs/algorithms.md#export-to-tpu-embedding-engines).

On TPU, embedding tables are updated by the TPU embedding engine, not by `update_step`:
TensorFlow's `TPUEmbedding`/`TPUEmbeddingV2` or JAX SparseCore via `jax_tpu_embedding` (each
also behind `keras_rs.layers.DistributedEmbedding`). Each backend's export is a module of its
own, imported only under that backend, so TensorFlow is never imported under JAX or torch.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_tpu_optim._backend import backend_module
from keras_tpu_optim.embedding_adam import EmbeddingAdam

__all__ = ["to_tpu_embedding"]


def to_tpu_embedding(optimizer: EmbeddingAdam) -> Any:
    """Export an `EmbeddingAdam` to the TPU embedding engine of the Keras backend.

    The TPU engines apply Adam without bias correction, so the exported learning rate is
    the bias-corrected `lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`, with `lr` read
    from the optimizer's schedule at each step: every row update equals `EmbeddingAdam`'s.

    - TensorFlow backend: a `tf.tpu.experimental.embedding.Adam` (a subclass whose
      configuration proto builds with protobuf >= 5) carrying every option. Its learning
      rate is a zero-argument callable reading `optimizer.iterations`, so the engine must
      apply the table gradients before `optimizer.iterations` is incremented for the step
      (as it is when `optimizer` is the model's optimizer and the embedding gradients are
      applied during the backward pass). Use it in
      `tf.tpu.experimental.embedding.TableConfig(optimizer=...)`,
      `TPUEmbedding(optimizer=...)` or `keras_rs.layers.TableConfig(optimizer=...)`.
    - JAX backend: a `jax_tpu_embedding.sparsecore.lib.nn.embedding_spec.CustomOptimizerSpec`
      whose per-row computation
      `(grad, table, momenta, velocities, learning_rate) -> (table, momenta, velocities)`
      is `EmbeddingAdam`'s own row update, with zero-initialised slots and a learning rate
      that is a function of the engine's step count (the updates already applied, as
      `optimizer.iterations`).

    Args:
        optimizer: The `keras_tpu_optim.EmbeddingAdam` to export.

    Returns:
        The TPU embedding optimizer of the active backend.

    Raises:
        TypeError: If `optimizer` is not an `EmbeddingAdam` (for instance
            `keras_tpu_optim.Adafactor`, or a `LossScaleOptimizer` wrapping one).
        ValueError: If the backend has no TPU embedding engine (torch), or the engine
            cannot honour an option (named in the message). Both engines: `clipnorm`,
            `global_clipnorm`, `use_ema`, `loss_scale_factor`, `gradient_accumulation_steps`,
            `weight_decay` with `exclude_from_weight_decay`, `second_moment="rowwise"`,
            `bias_correction="per_row"`. JAX SparseCore also: `lazy_adam=False`,
            `use_gradient_accumulation=False`, `slot_variable_creation_fn`,
            `low_dimensional_packing_status=True`.
    """
    if not isinstance(optimizer, EmbeddingAdam):
        raise TypeError(
            "`to_tpu_embedding` exports a `keras_tpu_optim.EmbeddingAdam` to the TPU embedding "
            f"engine; received {type(optimizer).__module__}.{type(optimizer).__qualname__}. "
            "Dense variables (and optimizers such as `keras_tpu_optim.Adafactor`) are updated by "
            "XLA-compiled `update_step` code on TPU and need no export."
        )
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        raise ValueError(
            f"The Keras backend {backend!r} has no TPU embedding engine: `to_tpu_embedding` "
            "supports KERAS_BACKEND='tensorflow' (TPUEmbedding) and KERAS_BACKEND='jax' "
            "(SparseCore via jax_tpu_embedding)."
        )
    return backend_module(__name__, backend).to_tpu_embedding(optimizer)
