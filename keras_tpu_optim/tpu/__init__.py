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


def to_tpu_embedding(optimizer, *, iterations=None) -> Any:
    """Export an `EmbeddingAdam`, or every table's of a `kto.layers.DistributedEmbedding`, to the TPU
    embedding engine of the Keras backend.

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

    A `kto.layers.DistributedEmbedding` exports each table's optimizer (its config's, else the layer's):
    the same configs then run on TPU through keras-rs's layer, each keras-rs `TableConfig` given its
    table's export. Tables with one optimizer share one export (the engine stacks them). On TPU nothing
    steps those optimizers, so on TensorFlow `iterations` names the step counter the exported rates
    read, the model's optimizer's `iterations`.

    Args:
        optimizer: The `keras_tpu_optim.EmbeddingAdam` to export, or a
            `keras_tpu_optim.layers.DistributedEmbedding`.
        iterations: TensorFlow only: the variable counting the updates applied, read by the exported
            learning rate (default: the optimizer's own `iterations`; required for a layer). JAX's
            engine passes its own step count, so there it must be None.

    Returns:
        The TPU embedding optimizer of the active backend; for a layer, `{table name: optimizer}`.

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
    from keras_tpu_optim.layers import DistributedEmbedding

    if isinstance(optimizer, DistributedEmbedding):
        layer = optimizer
        if iterations is None and keras.backend.backend() == "tensorflow":
            raise ValueError(
                "`to_tpu_embedding` of a DistributedEmbedding on TensorFlow needs `iterations`: the step "
                "counter its tables' learning rates read on TPU, where nothing steps the tables' own "
                "optimizers (pass `iterations=model.optimizer.iterations`)."
            )
        exported = {}  # one export per optimizer, shared by its tables
        names = dict.fromkeys(f.table.name for f in keras.tree.flatten(layer.feature_configs))
        for name in names:
            table_optimizer = layer.table_optimizer(name)
            if id(table_optimizer) not in exported:
                exported[id(table_optimizer)] = to_tpu_embedding(
                    table_optimizer, iterations=iterations
                )
            names[name] = exported[id(table_optimizer)]
        return names
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
    return backend_module(__name__, backend).to_tpu_embedding(optimizer, iterations)
