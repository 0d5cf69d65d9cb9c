"""What a backend runs where it has nothing of its own: the optimizers' steps in plain `keras.ops`."""

from __future__ import annotations

import contextlib

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
    assign = assign or (lambda target, value: target.assign(value))
    for slot, value in zip(slots, new_slots):
        assign(slot, value)
    adafactor_math.write_back(
        variable,
        delta,
        momentum,
        new_momentum,
        rounding=adafactor_math.rounding(options, step, variable_index, variable.shape),
        assign=assign,
        assign_sub=assign_sub or (lambda target, value: target.assign_sub(value)),
        value=lambda: ops.convert_to_tensor(variable),
    )


def adafactor_group_steps(grads, variables, states, **step_numbers):
    """Step the variables evaluated as groups; return the positions of the others (here: every variable,
    each stepped by itself, which XLA fuses)."""
    return range(len(variables))


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
