"""The TensorFlow backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.tensorflow import accumulation, rows
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_where_it_helps,
    compiling_helps,
    native_variable,
    platform_of,
)
from keras_tpu_optim._backend.tensorflow.gradients import (
    checked_gradient,
    densify,
    gradient_values,
    sparse_entries,
    unscale,
)
from keras_tpu_optim._backend.tensorflow.adafactor import adafactor_step
from keras_tpu_optim._math import sparse_rows

cond = neutral.cond
eager_branches = neutral.eager_branches
adafactor_group_steps = neutral.adafactor_group_steps
unstacked = neutral.unstacked
apply_if = neutral.apply_if  # tf.cond runs only the branch taken: sparse updates stay sparse.


@contextlib.contextmanager
def state_creation_scope():
    """Out of any function being traced (`tf.init_scope`, no variable lifting): the state created eagerly
    (docs/algorithms.md, end); under a `tf.distribute` strategy, where the strategy says."""
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        yield
        return
    with tf.init_scope(), tf.variable_creator_scope(_not_lifted):
        yield


def _not_lifted(next_creator, **kwargs):
    return next_creator(**dict(kwargs, experimental_enable_variable_lifting=False))


def embedding_adam_step(
    gradient, variable, slots, update_rows, *, lazy, accumulate_duplicates, max_touched_rows, cache
):
    if isinstance(gradient, tf.IndexedSlices):
        rows.sparse_step(
            [variable, *slots],
            *sparse_entries(gradient),
            update_rows,
            lazy=lazy,
            accumulate_duplicates=accumulate_duplicates,
            cache=cache,
        )
    elif lazy:
        rows.dense_row_update(update_rows, gradient, variable, slots)
    else:
        neutral.dense_row_update(update_rows, gradient, variable, slots)


def dense_ids(ids, weights, width):
    """(`neutral.dense_ids`) TF's ragged and sparse tensors."""
    if isinstance(ids, tf.RaggedTensor):
        shape = [None, width]
        present = tf.ones_like(ids, tf.bool).to_tensor(False, shape=shape)
        weights = tf.cast(tf.ones_like(ids) if weights is None else weights, tf.float32)
        return ids.to_tensor(0, shape=shape), present, weights.to_tensor(0.0, shape=shape)
    if not isinstance(ids, tf.SparseTensor):
        return ids, None, weights
    if width is not None:
        ids = tf.sparse.slice(ids, [0, 0], [ids.dense_shape[0], width])
        ids = tf.SparseTensor(ids.indices, ids.values, [ids.dense_shape[0], width])
    ones = tf.SparseTensor(ids.indices, tf.ones_like(ids.values, tf.float32), ids.dense_shape)
    weights = ones if weights is None else weights
    weights = tf.sparse.to_dense(weights) if isinstance(weights, tf.SparseTensor) else weights
    return tf.sparse.to_dense(ids), tf.sparse.to_dense(ones) > 0, tf.cast(weights, tf.float32)


def accumulation_rows():
    return accumulation


class _Lookup(neutral.LookupEvaluation):
    """The backward pass writes the table, its slots and the window in place; outside XLA the catch-up and its
    step are each one XLA computation; under a mirrored strategy every replica steps every replica's rows."""

    def hook(self, forward, backward, ids, step, learning_rate, state, window, cache, name):
        replicas = _replica_context(name, window)
        window_before = None if window is None else tf.convert_to_tensor(window.value)
        found, residuals = forward(
            ids, step, learning_rate, [native_variable(t) for t in state], window_before
        )

        @tf.custom_gradient
        def hooked(found, step):
            def gradient(row_gradients, loss_scale):
                every_id = ids
                loss_scale = 0.0 if loss_scale is None else loss_scale
                if replicas is not None:
                    # Every replica steps the table with every replica's rows, alike; the writes of
                    # the first reach every copy (the state's aggregation, `only_first_replica`).
                    every_id = replicas.all_gather(ids, axis=0)
                    row_gradients = replicas.all_gather(row_gradients, axis=0)
                    # Keras divides each replica's loss by their number: its rows' gradients then sum to
                    # one device's, and the probe's gradient is the scale divided by it.
                    loss_scale = loss_scale * replicas.num_replicas_in_sync
                _, _, next_step = backward(
                    residuals,
                    row_gradients,
                    loss_scale,
                    every_id,
                    step,
                    learning_rate,
                    window_before,
                )
                return None, next_step

            return (tf.identity(found), tf.zeros((), "float32")), gradient

        return hooked(found, step)

    def read_step(self, iterations):
        return tf.convert_to_tensor(iterations.value)

    def unless_nonfinite(self, finite, write, ids, targets, every_row, name):
        if tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError(
                f"keras_tpu_optim.layers.Embedding '{name}' with `optimizer`: skipping a non-finite step "
                "(`skip_nonfinite_updates=True` in its optimizer or the model's, or the model's "
                "LossScaleOptimizer) does not run under a tf.distribute strategy "
                f"({type(tf.distribute.get_strategy()).__name__}): the skip is a condition around the replicas' "
                "writes, which TF's strategies do not allow. Unset it, or train on one device."
            )
        return functools.partial(tf.cond, finite, functools.partial(write, ids), neutral.nothing)

    def grouped(self, every):
        if compiling_helps():
            group = tf.unique(every, out_idx=tf.int32).idx
        else:  # Inside XLA: ranked by a sort (XLA's binary search compares every pair).
            group = sparse_rows.id_ranks(every, False)
        return (group, *sparse_rows.distinct_ids(every, group))

    def gather(self, table, ids, axis=0):
        return tf.gather(table, ids, axis=axis)

    def compiled(self, name, function, options, cache):
        return compiled_where_it_helps(cache, (name, options), function)

    def write_rows(self, targets, ids, new_rows):
        for target, new in zip(targets, new_rows):
            native_variable(target).scatter_update(
                tf.IndexedSlices(tf.cast(new, target.dtype), ids)
            )

    sparse_step = staticmethod(rows.sparse_step)


# The strategies whose replicas each hold a whole copy of every variable (`only_first_replica` writes).
_MIRRORED = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)


def _replica_context(name, window):
    """The replica context of a `tf.distribute` strategy with several replicas, or None (none, or one
    replica); a strategy the layers cannot serve raises, naming it."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == 1:
        return None
    if not isinstance(strategy, _MIRRORED):
        raise ValueError(
            f"keras_tpu_optim.layers.Embedding '{name}' with `optimizer` runs under MirroredStrategy and "
            f"MultiWorkerMirroredStrategy, not under {type(strategy).__name__}: its replicas do not each hold "
            "the table. Use the layer without `optimizer` (EmbeddingAdam as the model's optimizer), or JAX's "
            "keras.distribution."
        )
    replicas = tf.distribute.get_replica_context()
    if replicas is None:
        return None
    if window is not None:
        raise ValueError(
            f"keras_tpu_optim.layers.Embedding '{name}': `lazy_adam=False` does not run under "
            f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas (each replica catches its "
            "own rows up). Use `lazy_adam=True` there."
        )
    return replicas


trained_lookup = functools.partial(neutral.trained_lookup, evaluation=_Lookup())


def host_value(x):
    """`x`'s value as a Python int where it has one now (eagerly), else None."""
    return int(x) if tf.executing_eagerly() else None


def lookup_trace(iterations):
    """The graph function being traced (under a strategy: the replica's context, one per replica and
    trace), or None eagerly."""
    if tf.executing_eagerly():
        return None
    if tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None:
        return tf.distribute.get_replica_context()
    return tf.compat.v1.get_default_graph()
