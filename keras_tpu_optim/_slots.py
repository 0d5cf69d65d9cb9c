"""Optimizer state created per model variable, with the owner and role recorded at creation
for the saved-state signature (`_saving`), rather than parsed back from names later."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import keras

from keras_tpu_optim import _private

_ROLES_ATTRIBUTE = "_keras_tpu_optim_roles"
_PLAN_ATTRIBUTE = "_keras_tpu_optim_slot_plan"


class PlannedSlot(NamedTuple):  # a slot `add_slot` would create
    path: str
    shape: tuple
    axes: tuple
    owner_path: str


@contextlib.contextmanager
def planning(optimizer):
    """Within, `add_slot` only records a `PlannedSlot`: `build` checks layouts before creating anything."""
    optimizer.__dict__[_PLAN_ATTRIBUTE] = plan = []
    try:
        yield plan
    finally:
        optimizer.__dict__.pop(_PLAN_ATTRIBUTE, None)


def variable_path(variable) -> str:
    """A model variable's path; a plain `tf.Variable` has only a name (`dense/kernel:0`)."""
    path = getattr(variable, "path", None)
    return path if path is not None else str(variable.name).split(":")[0]


def record_role(optimizer, state_variable, owner_index, role: str) -> None:
    optimizer.__dict__.setdefault(_ROLES_ATTRIBUTE, {})[id(state_variable)] = (owner_index, role)


def role_of(optimizer, state_variable):
    """`(owner_index, role)` recorded for `state_variable`, or None for the optimizer's own variables."""
    return optimizer.__dict__.get(_ROLES_ATTRIBUTE, {}).get(id(state_variable))


def record_keras_roles(optimizer) -> None:
    """Record the roles of the EMA averages and gradient accumulators Keras's `build` made."""
    for role, variables in (
        ("average", _private.moving_averages(optimizer)),
        ("gradient_accumulator", _private.gradient_accumulators(optimizer)),
    ):
        for owner, variable in enumerate(variables):
            if variable is not None:
                record_role(optimizer, variable, owner, role)


def add_slot(optimizer, variable, slot_name: str, kept_axes=None, dtype: str = "float32"):
    """A zero-initialised variable named after `variable`, keeping its `kept_axes` (None: all)
    and their layout; float32 by default, so bf16/fp16 variables' statistics do not underflow."""
    axes = range(len(variable.shape)) if kept_axes is None else kept_axes
    shape = tuple(variable.shape[i] for i in axes)
    name = variable_path(variable).replace("/", "_") + "_" + slot_name
    layout = kept_layout(_private.variable_layout(variable), axes)
    plan = optimizer.__dict__.get(_PLAN_ATTRIBUTE)
    if plan is not None:
        planned_axes = tuple(getattr(layout, "axes", None) or (None,) * len(shape))
        plan.append(
            PlannedSlot(f"{optimizer.name}/{name}", shape, planned_axes, variable_path(variable))
        )
        return None
    slot = optimizer.add_variable(
        shape=shape, initializer="zeros", dtype=dtype, name=name, layout=layout
    )
    record_role(optimizer, slot, _private.variable_index(optimizer, variable), slot_name)
    return slot


def kept_layout(layout, axes):
    """`layout` along the kept `axes` of its variable (None where it has no axes and they are not leading)."""
    layout_axes = getattr(layout, "axes", None)
    if layout_axes is None:
        return layout if list(axes) == list(range(len(axes))) else None
    return keras.distribution.TensorLayout(
        [layout_axes[i] for i in axes], device_mesh=getattr(layout, "device_mesh", None)
    )
