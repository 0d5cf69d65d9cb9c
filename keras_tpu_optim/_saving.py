"""The state signature saved beside the optimizer's variables (JSON as uint8 bytes, which every store
accepts), checked on load: Keras loads by position whatever the variables mean."""

from __future__ import annotations

import itertools
import json
from typing import Any

import keras
import numpy as np

from keras_tpu_optim import _private, _slots

STATE_SIGNATURE_KEY = "keras_tpu_optim_state_signature"
SIGNATURE_FORMAT = 1

# A float learning rate makes a variable, a schedule does not: either may resume the other.
_LEARNING_RATE_ROLE = "learning_rate"


def describe_state(optimizer) -> dict[str, Any]:
    """The class, each variable's role, model variable, shape and dtype, and the config (for errors)."""
    model_variables = _private.trainable_variables(optimizer)
    entries = []
    for variable in optimizer.variables:
        owner, role = _slots.role_of(optimizer, variable) or (None, variable.name)
        entries.append(
            {
                "role": role,
                "of": owner,
                "of_path": None if owner is None else _slots.variable_path(model_variables[owner]),
                "shape": [int(d) for d in variable.shape],
                "dtype": keras.backend.standardize_dtype(variable.dtype),
            }
        )
    try:
        config = json.loads(json.dumps(optimizer.get_config(), default=repr))
    except Exception:  # An unserializable config only costs the error message its detail.
        config = None
    return {
        "format": SIGNATURE_FORMAT,
        "class": keras.saving.get_registered_name(type(optimizer)),
        "variables": entries,
        "config": config,
    }


def encode(signature: dict[str, Any]) -> np.ndarray:
    data = json.dumps(signature, sort_keys=True).encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode(stored) -> dict[str, Any] | None:
    """The signature from its stored bytes, or None if they are not one."""
    try:
        signature = json.loads(np.asarray(stored, dtype=np.uint8).tobytes().decode("utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(signature, dict) or "variables" not in signature or "class" not in signature:
        return None
    return signature


def _same_dtype(saved: str, current: str) -> bool:
    # The iteration counter's int dtype differs between backends: integers need only stay integers.
    if saved.startswith(("int", "uint")) and current.startswith(("int", "uint")):
        return True
    return saved == current


def _entry_text(entry: dict[str, Any]) -> str:
    owner = "" if entry["of"] is None else f" of '{entry['of_path']}'"
    return f"'{entry['role']}'{owner} with shape {tuple(entry['shape'])} and dtype {entry['dtype']}"


def _entries_fit(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    if saved["shape"] != current["shape"] or not _same_dtype(saved["dtype"], current["dtype"]):
        return False
    # Variables of no model variable (a `slot_variable_creation_fn`'s) may be numbered differently.
    unowned = saved["of"] is None and current["of"] is None
    return unowned or (saved["role"] == current["role"] and saved["of"] == current["of"])


def _is_learning_rate(entry: dict[str, Any]) -> bool:
    return entry["role"] == _LEARNING_RATE_ROLE and entry["of"] is None


def _split(signature: dict[str, Any]):
    """`(position, entry)` of each variable but the learning rate; the learning rate's positions."""
    entries = list(enumerate(signature["variables"]))
    rest = [(i, e) for i, e in entries if not _is_learning_rate(e)]
    return rest, [i for i, e in entries if _is_learning_rate(e)]


def match_variables(saved: dict[str, Any], current: dict[str, Any]):
    """`(pairs, [])` of `(saved_position, current_position)` to assign, or `(None, differences)`."""
    (saved_rest, saved_lr), (current_rest, current_lr) = _split(saved), _split(current)
    differences = []
    for s, c in itertools.zip_longest(saved_rest, current_rest):  # (position, entry) or None
        if s is None:
            difference = f"this optimizer has {_entry_text(c[1])}, which the saved state lacks"
        elif c is None:
            difference = f"the saved state has {_entry_text(s[1])}, which this optimizer lacks"
        elif not _entries_fit(s[1], c[1]):
            difference = f"saved {_entry_text(s[1])} where this optimizer has {_entry_text(c[1])}"
        else:
            continue
        differences.append(difference)
    if differences:
        return None, differences
    pairs = [(s[0], c[0]) for s, c in zip(saved_rest, current_rest)]
    return pairs + list(zip(saved_lr[:1], current_lr[:1])), []


def configured_differently(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """A line for a load error naming the settings that differ, or "" if none do."""
    saved, current = saved.get("config"), current.get("config")
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return ""
    settings = "; ".join(
        f"{key}={saved.get(key)!r} (saved) vs {current.get(key)!r} (here)"
        for key in sorted(set(saved) | set(current))
        if key != "name" and saved.get(key) != current.get(key)
    )
    return f"\nThe saved optimizer was configured differently: {settings}." if settings else ""


def listed(differences: list[str], limit: int) -> str:
    """The first `limit` differences, one per indented line, and how many more there are."""
    more = len(differences) - limit
    return (
        "\n  " + "\n  ".join(differences[:limit]) + (f"\n  ... and {more} more" if more > 0 else "")
    )


def mismatch_error(optimizer, saved: dict, current: dict, differences: list[str]) -> ValueError:
    return ValueError(
        f"Cannot load the saved optimizer state into {type(optimizer).__name__} '{optimizer.name}': "
        f"it was saved by a {type(optimizer).__name__} whose variables differ "
        f"({len(saved['variables'])} saved, {len(current['variables'])} here):"
        + listed(differences, 5)
        + configured_differently(saved, current)
        + "\nRecreate the optimizer with the saved configuration (and the same model) to resume, "
        "or compile with a new optimizer to start its state fresh."
    )
