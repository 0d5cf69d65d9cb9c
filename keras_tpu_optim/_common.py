"""Machinery both optimizers share: argument validation and slot creation."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import keras


def check_number(name: str, value, *, low=None, high=None, low_open=False, high_open=False, allow_none=False):
    """Raise a ValueError naming `name` unless `value` is a finite number in range."""
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Argument `{name}` must be a finite number. Received: {name}={value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        interval = (
            ("(" if low_open else "[")
            + ("-inf" if low is None else f"{low}")
            + ", "
            + ("inf" if high is None else f"{high}")
            + (")" if high_open else "]")
        )
        raise ValueError(f"Argument `{name}` must be in {interval}. Received: {name}={value!r}")
    return value


def check_int(name: str, value, *, low: int, allow_none=False):
    """Raise a ValueError naming `name` unless `value` is an int >= `low`."""
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(
            f"Argument `{name}` must be an int >= {low}{' or None' if allow_none else ''}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_bool(name: str, value, allow_none=False):
    if value is None and allow_none:
        return value
    if not isinstance(value, bool):
        raise ValueError(f"Argument `{name}` must be a bool. Received: {name}={value!r}")
    return value


def add_slot(optimizer, variable, slot_name: str, kept_axes=None, dtype: str = "float32"):
    """A zero-initialised optimizer variable named and laid out after `variable`.

    Args:
        kept_axes: the axes of `variable` the slot keeps (None: all of them, a
            full-size slot). Factored statistics keep all but one axis, and
            under `keras.distribution` they are sharded along the axes they
            keep, like the variable.
        dtype: slots are float32 by default whatever the variable's dtype, so
            the statistics of bf16/fp16 variables do not underflow.
    """
    axes = range(len(variable.shape)) if kept_axes is None else kept_axes
    shape = tuple(variable.shape[i] for i in axes)
    return optimizer.add_variable(
        shape=shape,
        initializer="zeros",
        dtype=dtype,
        name=variable.path.replace("/", "_") + "_" + slot_name,
        layout=_kept_layout(getattr(variable, "_layout", None), axes),
    )


def _kept_layout(layout, axes):
    """The variable's layout restricted to `axes`, when it is a Keras TensorLayout."""
    if layout is None:
        return None
    layout_axes = getattr(layout, "axes", None)
    if layout_axes is None:
        return layout if list(axes) == list(range(len(axes))) else None
    return keras.distribution.TensorLayout(
        [layout_axes[i] for i in axes], device_mesh=getattr(layout, "device_mesh", None)
    )


def serialize_callable(argument: str, fn):
    """A callable argument as its registered name, so configs load with `safe_mode=True`.

    An unregistered callable could only be restored by deserializing bytecode
    (`safe_mode=False`); rather than write such a file, say so now.
    """
    if fn is None:
        return None
    try:
        name = keras.saving.get_registered_name(fn)
    except AttributeError:  # No __name__: a functools.partial, a callable instance.
        name = None
    if name is None or keras.saving.get_registered_object(name) is not fn:
        raise ValueError(
            f"Argument `{argument}` ({fn!r}) is not registered serializable, so a saved "
            "config could not restore it safely. Decorate it with "
            "`@keras.saving.register_keras_serializable()`."
        )
    return name


def deserialize_callable(argument: str, name, custom_objects=None):
    if name is None or callable(name):
        return name
    fn = keras.saving.get_registered_object(name, custom_objects=custom_objects)
    if fn is None:
        raise ValueError(
            f"Cannot restore `{argument}`: no registered serializable object named {name!r}. "
            "Import the module that registers it before loading."
        )
    return fn
