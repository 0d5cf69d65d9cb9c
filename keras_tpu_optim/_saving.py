"""The optimizer-state signature saved beside the variables, and the check made on load.

Keras saves an optimizer's state as its variables numbered `"0"`, `"1"`, ... and,
on load, only compares how many there are: a different count is a warning and a
fresh optimizer, an equal count is assigned position by position whatever the
variables mean. An Adafactor that factors a matrix into row and column
statistics and one that keeps a full second moment can have the same count, so
a resumed run would silently train with the wrong statistics.

`OptimizerBase` therefore writes one more entry, `STATE_SIGNATURE_KEY`: a JSON
document (stored as uint8 bytes, which every Keras weights store and every
backend accepts) describing the optimizer class and, for each variable, its role
(the slot name, e.g. `row_second_moment`), the model variable it belongs to (by
position in the optimizer's variable list, path for the message), shape and
dtype, plus the saving optimizer's config so that an error can say which
setting differs. Roles and owners are those recorded when the state was created
(`_slots`); a variable with none (`iterations`, `learning_rate`, a slot made by
a user's `slot_variable_creation_fn`) is described by its name.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import keras
import numpy as np

from keras_tpu_optim import _private, _slots

STATE_SIGNATURE_KEY = "keras_tpu_optim_state_signature"
SIGNATURE_FORMAT = 1

# Variables every Keras optimizer may or may not have depending on how the
# learning rate is given (a float makes a variable, a schedule does not):
# switching between the two on resume is legitimate, so it is matched by role.
_LEARNING_RATE_ROLE = "learning_rate"


def describe_state(optimizer) -> dict[str, Any]:
    """The signature of `optimizer`'s current variables (see the module docstring)."""
    model_variables = _private.trainable_variables(optimizer)
    entries = []
    for variable in optimizer.variables:
        recorded = _slots.role_of(optimizer, variable)
        owner, role = recorded if recorded is not None else (None, variable.name)
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
    return np.frombuffer(
        json.dumps(signature, sort_keys=True).encode("utf-8"), dtype=np.uint8
    ).copy()


def decode(stored) -> Optional[dict[str, Any]]:
    """The signature from its stored bytes, or None if they are not one."""
    try:
        signature = json.loads(np.asarray(stored, dtype=np.uint8).tobytes().decode("utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(signature, dict) or "variables" not in signature or "class" not in signature:
        return None
    return signature


def _same_dtype(saved: str, current: str) -> bool:
    # The iteration counter is int64 on TF/torch and int32 on JAX: a file must
    # move between backends, so integers only need to stay integers.
    if saved.startswith(("int", "uint")) and current.startswith(("int", "uint")):
        return True
    return saved == current


def _entry_text(entry: dict[str, Any]) -> str:
    owner = "" if entry["of"] is None else f" of '{entry['of_path']}'"
    return f"'{entry['role']}'{owner} with shape {tuple(entry['shape'])} and dtype {entry['dtype']}"


def _entries_fit(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    if saved["of"] is None and current["of"] is None and saved["role"] != current["role"]:
        # Neither is a slot named after a model variable (e.g. one made by a
        # user's `slot_variable_creation_fn`): names may be auto-numbered
        # differently in another model instance, so only shape and dtype count.
        return saved["shape"] == current["shape"] and _same_dtype(saved["dtype"], current["dtype"])
    return (
        saved["role"] == current["role"]
        and saved["of"] == current["of"]
        and saved["shape"] == current["shape"]
        and _same_dtype(saved["dtype"], current["dtype"])
    )


def match_variables(saved: dict[str, Any], current: dict[str, Any]):
    """Pair saved variable positions with current ones, or raise a ValueError naming what differs.

    Returns a list of `(saved_position, current_position)` to assign.
    """
    saved_entries = list(enumerate(saved["variables"]))
    current_entries = list(enumerate(current["variables"]))
    saved_rest = [
        (i, e) for i, e in saved_entries if e["role"] != _LEARNING_RATE_ROLE or e["of"] is not None
    ]
    current_rest = [
        (i, e)
        for i, e in current_entries
        if e["role"] != _LEARNING_RATE_ROLE or e["of"] is not None
    ]
    differences = []
    for position in range(max(len(saved_rest), len(current_rest))):
        saved_entry = saved_rest[position][1] if position < len(saved_rest) else None
        current_entry = current_rest[position][1] if position < len(current_rest) else None
        if saved_entry is None:
            differences.append(
                f"this optimizer has {_entry_text(current_entry)}, which the saved state lacks"
            )
        elif current_entry is None:
            differences.append(
                f"the saved state has {_entry_text(saved_entry)}, which this optimizer lacks"
            )
        elif not _entries_fit(saved_entry, current_entry):
            differences.append(
                f"saved {_entry_text(saved_entry)} where this optimizer has {_entry_text(current_entry)}"
            )
    if differences:
        return None, differences
    pairs = [(s[0], c[0]) for s, c in zip(saved_rest, current_rest)]
    saved_lr = [i for i, e in saved_entries if e["role"] == _LEARNING_RATE_ROLE and e["of"] is None]
    current_lr = [
        i for i, e in current_entries if e["role"] == _LEARNING_RATE_ROLE and e["of"] is None
    ]
    if saved_lr and current_lr:
        pairs.append((saved_lr[0], current_lr[0]))
    return pairs, []


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    saved_config, current_config = saved.get("config"), current.get("config")
    if not isinstance(saved_config, dict) or not isinstance(current_config, dict):
        return []
    differences = []
    for key in sorted(set(saved_config) | set(current_config)):
        if key == "name":
            continue
        if saved_config.get(key) != current_config.get(key):
            differences.append(
                f"{key}={saved_config.get(key)!r} (saved) vs {current_config.get(key)!r} (here)"
            )
    return differences


def mismatch_error(
    optimizer, saved: dict[str, Any], current: dict[str, Any], differences: list[str]
) -> ValueError:
    shown = differences[:5]
    more = (
        f"\n  ... and {len(differences) - len(shown)} more" if len(differences) > len(shown) else ""
    )
    message = (
        f"Cannot load the saved optimizer state into {type(optimizer).__name__} '{optimizer.name}': "
        f"it was saved by a {type(optimizer).__name__} whose variables differ "
        f"({len(saved['variables'])} saved, {len(current['variables'])} here):\n  "
        + "\n  ".join(shown)
        + more
    )
    settings = config_differences(saved, current)
    if settings:
        message += "\nThe saved optimizer was configured differently: " + "; ".join(settings) + "."
    message += (
        "\nRecreate the optimizer with the saved configuration (and the same model) to resume, "
        "or compile with a new optimizer to start its state fresh."
    )
    return ValueError(message)
