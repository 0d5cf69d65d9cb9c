"""Every use of a private API of Keras, TensorFlow or torch, in one place, so an upgrade that moves one
breaks this file and `tests/test_private_api.py` names the use. Importing it imports no backend."""

from __future__ import annotations

import contextlib

import keras

# ------------------------------------------------------------------ Keras


def in_stateless_scope() -> bool:
    """Whether Keras is tracing a stateless call (JAX's `stateless_apply`): variables must not be written."""
    from keras.src.backend.common import stateless_scope

    return stateless_scope.in_stateless_scope()


def calling_model():
    """The outermost layer of the call running now (the model whose `train_step` called it, where
    Keras's or a custom step calls `self(x)`), from Keras's call context; None outside a call."""
    # Keras keeps one call context per thread, entered by the outermost layer called.
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.entry_layer


def base_optimizer_keyword_args() -> str:
    """The `Args:` text Keras's own optimizers append for the base keywords."""
    from keras.src.optimizers.optimizer import base_optimizer_keyword_args as text

    return text.strip()


def raw_learning_rate(optimizer):
    """The learning rate as given (float, Variable, schedule or callable), not evaluated."""
    return optimizer._learning_rate


def learning_rate_at(optimizer, step):
    """The (uncorrected) learning rate after `step` updates: Keras's `_get_current_learning_rate` at any step."""
    learning_rate = raw_learning_rate(optimizer)
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        return learning_rate(step)
    if isinstance(learning_rate, keras.Variable):
        # Read as stored: a layer calling this under a mixed policy's autocast would round it.
        from keras.src.backend.common.variables import AutocastScope

        with AutocastScope(None):
            return learning_rate.value
    if callable(learning_rate):
        return learning_rate()
    return learning_rate


def trainable_variables(optimizer) -> list:
    """The model variables the optimizer was built for (empty before `build`)."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def variable_index(optimizer, variable) -> int:
    """The position of a model variable in the list the optimizer was built for."""
    return optimizer._get_variable_index(variable)


def overwritten_with_gradient(optimizer, variable) -> bool:
    """Whether Keras overwrites `variable` with its gradient (float8 scales), so it needs no slots."""
    return optimizer._overwrite_variable_with_gradient(variable)


def uses_weight_decay(optimizer, variable) -> bool:
    """Keras's `exclude_from_weight_decay` decision, also unbuilt (a `layers.Embedding`'s EmbeddingAdam):
    Keras 3.16's `_use_weight_decay` raises before `build`, 3.15's checks on each call."""
    if optimizer.built or not hasattr(optimizer, "_is_excluded_from_weight_decay"):
        return optimizer._use_weight_decay(variable)
    return not optimizer._is_excluded_from_weight_decay(variable)


def has_weight_decay_exclusions(optimizer) -> bool:
    return bool(getattr(optimizer, "_exclude_from_weight_decay", None)) or (
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None
    )


def moving_averages(optimizer) -> list:
    """The EMA variables, one per model variable (None where there is none)."""
    return list(getattr(optimizer, "_model_variables_moving_average", None) or [])


@contextlib.contextmanager
def moving_averages_left_out(optimizer, left_out):
    """Within, Keras's EMA list holds None in place of the averages in `left_out`, so its EMA step skips them."""
    averages = optimizer._model_variables_moving_average
    kept = [None if any(a is b for b in left_out) else a for a in averages]
    object.__setattr__(optimizer, "_model_variables_moving_average", kept)  # not tracked
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_model_variables_moving_average", averages)


def raw_iterations(optimizer):
    """The counter of `apply` calls (micro-steps under `gradient_accumulation_steps`): it numbers the EMA updates."""
    return optimizer._iterations


# Keras's EMA hooks, overridden by EmbeddingAdam (a lazy EMA): `apply` calls the first after every
# update, the second to install the averages (`ema_overwrite_frequency`, `finalize_variable_values`).
EMA_HOOKS = (
    "_update_model_variables_moving_average",
    "_overwrite_model_variables_with_average_value",
)


# Keras's accumulate-or-update step (then the EMA), which `apply` calls after unscaling; both
# optimizers override it (`keras_tpu_optim._accumulation`).
ACCUMULATION_HOOK = "_backend_apply_gradients"


def clip_gradients(optimizer, grads) -> list:
    """Keras's `clipnorm`/`global_clipnorm` (and `clipvalue`) of a step's gradients."""
    return optimizer._clip_gradients(grads)


def apply_weight_decay(optimizer, variables) -> None:
    """Keras's decoupled weight decay of a step (before the update)."""
    optimizer._apply_weight_decay(variables)


def backend_update_step(optimizer, grads, variables, learning_rate) -> None:
    """Keras's per-step loop over `update_step` (its TF form handles `tf.distribute`)."""
    optimizer._backend_update_step(grads, variables, learning_rate)


def update_moving_averages(optimizer) -> None:
    """Keras's EMA update after a step (the first of `EMA_HOOKS`)."""
    getattr(optimizer, EMA_HOOKS[0])(trainable_variables(optimizer))


def overwrite_with_moving_averages(optimizer) -> None:
    """Keras's installing of the averages as the weights (the second of `EMA_HOOKS`)."""
    getattr(optimizer, EMA_HOOKS[1])(trainable_variables(optimizer))


def gradient_accumulators(optimizer) -> list:
    """The gradient accumulators of `gradient_accumulation_steps`, one per model variable."""
    return list(getattr(optimizer, "_accumulated_gradients", None) or [])


def is_tracked(optimizer, variable) -> bool:
    return any(v is variable for v in optimizer._variables)


def track_variable(optimizer, variable) -> None:
    """Make a variable created outside `add_variable` part of the optimizer's state."""
    optimizer._track_variable(variable)


def variable_layout(variable):
    """A Keras variable's `keras.distribution` layout, or None."""
    return getattr(variable, "_layout", None)


def layout_map(distribution):
    """The `keras.distribution.LayoutMap` of a `ModelParallel` distribution, or None."""
    return getattr(distribution, "_layout_map", None)


# ------------------------------------------------------------------ TensorFlow


def tf_in_xla_context() -> bool:
    """Whether the TF op being built will be compiled by XLA; True if TF moved the function (the
    callers' XLA forms are correct everywhere, only slower)."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        return True
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# ------------------------------------------------------------------ torch


def torch_sparse_entries(gradient):
    """`(row indices, values)` of a torch sparse COO gradient, duplicates kept if uncoalesced (the
    public `indices()`/`values()` require coalescing, which would sum them)."""
    if gradient.is_coalesced():
        return gradient.indices()[0], gradient.values()
    return gradient._indices()[0], gradient._values()
