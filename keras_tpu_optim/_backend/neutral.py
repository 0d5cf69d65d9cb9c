"""What a backend runs where it has nothing of its own: the optimizers' steps in plain `keras.ops`."""

from __future__ import annotations

import contextlib

import keras
from keras import ops

from keras_tpu_optim._math import adafactor as adafactor_math


def cond(condition, true_fn, false_fn):
    """`ops.cond`; a backend whose `ops.cond` compiles both branches eagerly calls only the one taken."""
    return ops.cond(condition, true_fn, false_fn)


def eager_branches(iterations) -> bool:
    """Whether Keras's own step would compile both branches of its `ops.cond`s at every call (eager JAX)."""
    return False


def apply_if(condition, apply, state):
    """Run `apply()` only where the scalar `condition` holds (`state`: the variables it may change)."""
    ops.cond(condition, apply, lambda: None)


def checked_gradient(gradient, variable, mismatch):
    """`gradient`, checked to have the variable's shape (`ValueError(mismatch(shape))` if not)."""
    shape = tuple(gradient.shape)
    if shape != tuple(variable.shape):
        raise ValueError(mismatch(shape))
    return gradient


def unstacked(rows):
    """`rows` split along its first axis (`ops.unstack`)."""
    return ops.unstack(rows, axis=0)


def state_creation_scope():
    """Where an optimizer's `build` creates its state: the current scope."""
    return contextlib.nullcontext()


def accumulation_rows(owner):
    """The row operations of `keras_tpu_optim._accumulation`, or None: sparse gradients densified first."""
    return None


def adafactor_step(
    gradient,
    variable,
    slots,
    momentum,
    *,
    learning_rate,
    step,
    options,
    variable_index,
    evaluation,
    assign=None,
    assign_sub=None,
):
    """One Adafactor step of `variable`, its `slots` and `momentum` (or None), through `assign`s."""
    delta, new_slots, new_momentum = adafactor_math.float32_update(
        gradient,
        ops.convert_to_tensor(variable),
        tuple(ops.convert_to_tensor(s) for s in slots),
        None if momentum is None else ops.convert_to_tensor(momentum),
        learning_rate=learning_rate,
        step=step,
        options=options,
        evaluation=evaluation,
    )
    assign_update(
        variable,
        (slots, new_slots),
        (momentum, new_momentum),
        delta,
        rounding=adafactor_math.rounding(options, step, variable_index, variable.shape),
        assign=assign,
        assign_sub=assign_sub,
    )


def assign_update(variable, slots, momentum, delta, *, rounding, assign=None, assign_sub=None):
    """Write a step's results: `slots` and `momentum` as `(variables, new values)`, the variable minus `delta`
    (a float32 variable in place, any other rounded once by `rounding`). `assign(target, value)` and
    `assign_sub` default to the variables' own."""
    assign = assign or (lambda target, value: target.assign(value))
    assign_sub = assign_sub or (lambda target, value: target.assign_sub(value))
    for slot, value in zip(*slots):
        assign(slot, value)
    if momentum[0] is not None:
        assign(momentum[0], ops.cast(momentum[1], momentum[0].dtype))
    if keras.backend.standardize_dtype(variable.dtype) == "float32":
        assign_sub(variable, delta)
    else:
        assign(
            variable, adafactor_math.subtracted(ops.convert_to_tensor(variable), delta, rounding)
        )


def adafactor_steps(grads, variables, states, *, learning_rate, keras_steps, **step_numbers):
    """A step's Adafactor updates (`states`, `indices`, `platforms`: the variables'): Keras's loop over
    `update_step` (`keras_steps`), one variable at a time."""
    keras_steps(grads, variables, learning_rate)


def embedding_adam_step(gradient, variable, slots, update_rows, *, lazy, lazy_row_update, densify):
    """One EmbeddingAdam step: the touched rows (`lazy_row_update(update_rows, gradient, variable, slots)`, the
    backend's), or every row."""
    if lazy:
        lazy_row_update(update_rows, gradient, variable, slots)
    else:
        dense_row_update(update_rows, densify(gradient), variable, slots)


def dense_row_update(update_rows, gradient, variable, slots):
    """Update every row (ordinary, non-lazy Adam)."""
    # TF's optimizer passes native tf.Variables; convert_to_tensor reads either kind.
    new_values = update_rows(gradient, *(ops.convert_to_tensor(t) for t in (variable, *slots)))
    for target, value in zip((variable, *slots), new_values):
        target.assign(value)
