"""The TensorFlow backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.tensorflow import accumulation, rows
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_function,
    compiling_helps,
    native_variable,
)
from keras_tpu_optim._backend.tensorflow.gradients import (
    checked_gradient,
    densify,
    gradient_values,
    unscale,
)
from keras_tpu_optim._backend.tensorflow.adafactor import adafactor_step
from keras_tpu_optim._math import catch_up
from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._math import embedding_adam as adam_math

cond = neutral.cond
eager_branches = neutral.eager_branches
adafactor_group_steps = neutral.adafactor_group_steps
unstacked = neutral.unstacked
apply_if = neutral.apply_if  # tf.cond runs only the branch taken: sparse updates stay sparse.


def state_creation_scope():
    """Out of any function being traced (`tf.init_scope`): the state created eagerly, not lifted.

    Keras's TF trainer builds the optimizer while it traces the train step:
    variables created there get initializer functions of their own, kept in
    the process, and the step traces itself a second time. Under a
    `tf.distribute` strategy the state is created where the strategy says.
    """
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return contextlib.nullcontext()
    return _created_eagerly()


@contextlib.contextmanager
def _created_eagerly():
    with tf.init_scope(), tf.variable_creator_scope(_not_lifted):
        yield


def _not_lifted(next_creator, **kwargs):
    kwargs["experimental_enable_variable_lifting"] = False
    return next_creator(**kwargs)


def platform_of(variable) -> str:
    device = getattr(variable, "device", "") or ""
    if device:
        return tf.DeviceSpec.from_string(device).device_type.lower() or "cpu"
    # Not placed yet: where TF would place it.
    for kind in ("TPU", "GPU"):
        if tf.config.list_logical_devices(kind):
            return kind.lower()
    return "cpu"


def embedding_adam_step(
    gradient, variable, slots, update_rows, *, lazy, accumulate_duplicates, max_touched_rows, owner
):
    if lazy and not _private.in_stateless_scope() and rows.compiled_update_applies(gradient):
        rows.compiled_lazy_row_update(
            owner,
            update_rows,
            gradient,
            variable,
            slots,
            accumulate_duplicates=accumulate_duplicates,
        )
        return
    neutral.embedding_adam_step(
        gradient,
        variable,
        slots,
        update_rows,
        lazy=lazy,
        lazy_row_update=functools.partial(
            rows.lazy_row_update, accumulate_duplicates=accumulate_duplicates
        ),
        densify=densify,
    )


def accumulation_rows(owner):
    return accumulation


def trained_lookup(
    ids, state, iterations, row_update_arguments, *, lazy, accumulate_duplicates, owner, window=None
):
    """The rows of `state[0]` at `ids`; the backward pass steps the table (and its slots) in place with the
    lookup's gradient and returns `iterations + 1` as the gradient of `iterations`, the one trainable
    variable. With a catch-up `window` (`_math.catch_up`) the rows read are caught up and the window
    advanced. Refused under a `tf.distribute` strategy: each replica would update the table."""
    if tf.distribute.has_strategy():
        raise ValueError(
            "keras_tpu_optim.layers.Embedding with `optimizer` does not run under a tf.distribute strategy "
            f"({type(tf.distribute.get_strategy()).__name__}): each replica would update the table with its own "
            "gradient. Use the layer without `optimizer` (EmbeddingAdam as the model's optimizer), or JAX's "
            "keras.distribution."
        )
    step_before = tf.convert_to_tensor(iterations.value)
    if window is not None:
        return _caught_up_lookup(ids, state, step_before, row_update_arguments, window, owner)
    looked_up = ops.take(state[0].value, ids, axis=0)
    options = dict(
        lazy=lazy, accumulate_duplicates=accumulate_duplicates, max_touched_rows=None, owner=owner
    )

    @tf.custom_gradient
    def hooked(looked_up, step):
        def gradient(row_gradients):
            # The lookup's gradient as the table's `IndexedSlices`, stepped as the optimizer steps one.
            flat_ids = tf.reshape(ids, [-1])
            shape = tf.shape(state[0].value, out_type=flat_ids.dtype)
            values = tf.reshape(
                row_gradients, tf.concat([tf.shape(flat_ids, shape.dtype), shape[1:]], 0)
            )
            update_rows = adam_math.RowUpdate(*row_update_arguments(step))
            embedding_adam_step(
                tf.IndexedSlices(values, flat_ids, shape),
                state[0],
                state[1:],
                update_rows,
                **options,
            )
            return None, step + 1

        return tf.identity(looked_up), gradient

    return hooked(looked_up, step_before)


def _caught_up_lookup(ids, state, step, row_update_arguments, window, owner):
    """`trained_lookup` with a catch-up `window` (`_math.catch_up`): the rows read are caught up in the forward
    pass; the backward pass steps them, scatters them and advances the window. Outside XLA the catch-up and
    the step are each one XLA computation (op by op, every catch-up term is a kernel), while TF's own kernels
    group the ids, gather the rows and scatter them (XLA's CPU sort, gathers and scatters are slower), the
    ids checked first (a gather in XLA would clip them)."""
    learning_rate, options = row_update_arguments(step)
    window_before = tf.convert_to_tensor(window.value)
    targets = [native_variable(t) for t in state]
    compiling = compiling_helps()

    def compiled(name, function):
        if not compiling:
            return function
        return compiled_function(owner, (name, options), lambda: function)

    def forward(tables, ids, every, group, distinct, slot, step, window):
        return catch_up.looked_up(
            tables, ids, every, group, step, window, options, distinct=distinct, slot=slot
        )

    def backward(caught_up, row_gradients, learning_rate, step, window):
        new_rows = catch_up.stepped_rows(caught_up, row_gradients, learning_rate, step, options)[1]
        new_window = catch_up.advanced_window(window, learning_rate, step, options)
        return [tf.cast(new, t.dtype) for new, t in zip(new_rows, targets)], new_window

    if compiling:
        ids = rows.checked_indices(ids, tf.shape(targets[0], out_type=ids.dtype)[0], state[0])
    every = catch_up.read_ids(ids, step, state[0].shape[0], options)
    group = (
        tf.unique(every, out_idx=tf.int32).idx if compiling else sparse_rows.id_ranks(every, False)
    )
    distinct, slot = sparse_rows.distinct_ids(every, group)
    tables = [tf.gather(t, distinct) for t in targets]
    found, caught_up = compiled("catch_up_lookup", forward)(
        tables, ids, every, group, distinct, slot, step, window_before
    )

    @tf.custom_gradient
    def hooked(found, step):
        def gradient(row_gradients):
            new_rows, new_window = compiled("catch_up_step", backward)(
                caught_up, row_gradients, learning_rate, step, window_before
            )
            for target, new in zip(targets, new_rows):
                target.scatter_update(tf.IndexedSlices(new, distinct))
            window.assign(new_window)
            return None, step + 1

        return tf.identity(found), gradient

    return hooked(found, step)


def lookup_trace(iterations):
    """The graph function being traced, or None eagerly."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
