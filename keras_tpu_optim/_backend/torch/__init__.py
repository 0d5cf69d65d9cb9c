"""The torch backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import functools
import weakref

from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.torch import accumulation, adafactor, rows
from keras_tpu_optim._math import adafactor as adafactor_math


cond = neutral.cond
apply_if = neutral.apply_if  # Eager: a Python branch.
state_creation_scope = neutral.state_creation_scope
checked_gradient = neutral.checked_gradient

# Each optimizer's scratch for the in-place Adafactor kernel, released with the optimizer.
_scratches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def platform_of(variable) -> str:
    device_type = variable.value.device.type
    return "gpu" if device_type == "cuda" else device_type


def gradient_values(gradient):
    if gradient.is_sparse:
        return _private.torch_sparse_entries(gradient)[1]  # Duplicates do not matter here.
    return gradient


def unscale(gradient, scale):
    return gradient / scale


def densify(gradient):
    return gradient.to_dense() if gradient.is_sparse else gradient


def adafactor_reductions(platform: str) -> adafactor_math.Reductions:
    """torch runs the neutral reductions (eagerly); its CPU kernel is `fused_adafactor_applies`."""
    return adafactor_math.NEUTRAL


def fused_adafactor_applies(platform: str) -> bool:
    """Whether the in-place kernel (`adafactor.adafactor_step`, measured on CPU) updates a variable on `platform`.

    The kernel implements every `AdafactorOptions` value (both `factored_dims`,
    `decay_offset`, `beta_2_cap`, a bfloat16 momentum, stochastic rounding),
    so no option value is routed to the neutral step.
    """
    return platform == "cpu"


def scratch_of(optimizer) -> adafactor.Scratch:
    scratch = _scratches.get(optimizer)
    if scratch is None:
        scratch = _scratches[optimizer] = adafactor.Scratch()
    return scratch


def adafactor_step(optimizer, gradient, variable, learning_rate):
    if _private.in_stateless_scope() or not fused_adafactor_applies(optimizer._platform_of(variable)):
        neutral.adafactor_step(optimizer, densify(gradient), variable, learning_rate)
        return
    state = optimizer._state_of(variable)
    adafactor.adafactor_step(
        densify(gradient),
        variable.value,
        tuple(s.value for s in state.slots),
        None if state.momentum is None else state.momentum.value,
        learning_rate=ops.convert_to_tensor(learning_rate),
        step=ops.convert_to_tensor(optimizer.iterations) + 1,
        options=optimizer._options,
        scratch=scratch_of(optimizer),
        variable_index=_private.variable_index(optimizer, variable),
    )


def embedding_adam_step(optimizer, gradient, variable, learning_rate):
    neutral.embedding_adam_step(
        optimizer,
        gradient,
        variable,
        learning_rate,
        lazy_row_update=functools.partial(
            rows.lazy_row_update, accumulate_duplicates=optimizer.use_gradient_accumulation
        ),
        densify=densify,
    )


def apply_gradients(optimizer, grads, variables, keras_apply):
    """Keras's step (`keras_apply`), or with `accumulates_rows` the same step with sparse rows accumulated in place."""
    if not optimizer._accumulates_rows:
        keras_apply(grads, variables)
        return
    neutral.accumulated_apply(optimizer, grads, variables, rows=accumulation)
