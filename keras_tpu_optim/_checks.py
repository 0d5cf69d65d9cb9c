"""Argument checks both optimizers share: each raises a ValueError naming the argument."""

from __future__ import annotations

import math
import numbers
import re

import keras

from keras_tpu_optim import _private


def check_number(
    name: str, value, *, low=None, high=None, low_open=False, high_open=False, allow_none=False
):
    """Raise a ValueError naming `name` unless `value` is a finite number in range."""
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Argument `{name}` must be a finite number. Received: {name}={value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        low_end = f"{'(' if low_open else '['}{'-inf' if low is None else low}"
        interval = f"{low_end}, {'inf' if high is None else high}{')' if high_open else ']'}"
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


def check_choice(name: str, value, choices):
    """Raise a ValueError naming `name` unless `value` is one of the strings `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"Argument `{name}` must be one of {', '.join(repr(c) for c in choices)}. Received: {name}={value!r}"
        )
    return value


def serialize_callable(argument: str, fn):
    """A callable argument as its registered name, so configs load with `safe_mode=True`."""
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


def check_base_arguments(**keywords):
    """The ranges of Keras's base keywords that its base optimizer leaves unchecked, checked before any variable exists."""
    learning_rate = keywords.get("learning_rate")
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        check_number("learning_rate", learning_rate, low=0)
    for name in ("clipnorm", "global_clipnorm", "loss_scale_factor"):
        check_number(name, keywords.get(name), low=0, low_open=True, allow_none=True)
    check_number("weight_decay", keywords.get("weight_decay"), low=0, allow_none=True)
    if not isinstance(keywords.get("clipvalue"), (tuple, list)):
        check_number("clipvalue", keywords.get("clipvalue"), low=0, low_open=True, allow_none=True)
    check_bool("use_ema", keywords.get("use_ema", False))
    check_number("ema_momentum", keywords.get("ema_momentum", 0.99), low=0, high=1)
    for name, low in (("ema_overwrite_frequency", 1), ("gradient_accumulation_steps", 2)):
        check_int(name, keywords.get(name), low=low, allow_none=True)


def _current_layout_map():
    try:
        distribution = keras.distribution.distribution()
    except Exception:  # a backend without keras.distribution
        return None
    return _private.layout_map(distribution)


def check_layout_map(optimizer_class, name) -> None:
    """Refuse a LayoutMap that shards the optimizer's scalars, which JAX would fail on deep inside."""
    layouts = _current_layout_map()
    if layouts is None:
        return
    if name is None:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", optimizer_class.__name__).lower()
    for variable in ("iteration", "learning_rate"):
        path = f"{name}/{variable}"
        if axes := tuple(getattr(layouts[path], "axes", ()) or ()):
            raise ValueError(
                f"The current distribution's LayoutMap gives {optimizer_class.__name__}'s scalar "
                f"'{path}' the layout {axes}: one of its keys matches optimizer variables as well as "
                "model variables. The optimizer's state follows each model variable's layout by "
                "itself; make the keys match only model variables (e.g. '.*embedding/embeddings' "
                f"rather than '.*embedding.*'), or name the optimizer so that no key matches it."
            )


def check_slot_layouts(optimizer_class, planned) -> None:
    """Refuse a LayoutMap key matching a state variable but not its model variable (it would be ignored)."""
    layouts = _current_layout_map()
    if layouts is None:
        return
    for slot in planned:
        keys = [key for key in layouts.keys() if re.fullmatch(key, slot.path)]
        keys = [key for key in keys if not re.fullmatch(key, slot.owner_path)]
        requested = tuple(getattr(layouts[keys[0]], "axes", ()) or ()) if keys else slot.axes
        if requested == slot.axes:
            continue
        rank = f" (rank {len(requested)} for a rank-{len(slot.shape)} variable)"
        rank = "" if len(requested) == len(slot.shape) else rank
        raise ValueError(
            f"The current distribution's LayoutMap key {keys[0]!r} gives {optimizer_class.__name__}'s state "
            f"'{slot.path}' of shape {slot.shape} the layout {requested}{rank}, but it does not match the model "
            f"variable '{slot.owner_path}' that state belongs to. {optimizer_class.__name__} lays out each state "
            f"variable after its model variable ({slot.axes} here) and cannot take a layout of its own: shard "
            f"'{slot.owner_path}' instead, or make the key match only model variables. Nothing was built."
        )
