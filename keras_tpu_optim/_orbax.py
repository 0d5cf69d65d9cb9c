"""Resuming from a `keras.callbacks.OrbaxCheckpoint`, checked first: Keras's loaders silently skip
every path that does not match, with no hook to check before."""

from __future__ import annotations

import json
import os

import keras
from keras.backend import standardize_dtype

from keras_tpu_optim import _saving


def _ocp():
    try:
        import orbax.checkpoint

        return orbax.checkpoint.v1  # the API Keras's OrbaxCheckpoint writes with
    except (ImportError, AttributeError) as error:  # pragma: no cover - orbax is a Keras extra
        raise ImportError(
            "load_checkpoint needs the 'orbax-checkpoint' package (pip install orbax-checkpoint)."
        ) from error


def _latest_step(directory: str) -> tuple[str, int]:
    """(step directory, step) of the latest complete checkpoint under an OrbaxCheckpoint directory."""
    if not os.path.isdir(directory):
        raise ValueError(f"No Orbax checkpoint at {directory!r}: not a directory.")
    if not any(
        d.isdigit() and os.path.isdir(os.path.join(directory, d)) for d in os.listdir(directory)
    ):
        raise ValueError(
            f"No Orbax checkpoint steps in {directory!r}: pass the directory given to "
            "keras.callbacks.OrbaxCheckpoint (its latest step is restored)."
        )
    latest = _ocp().training.Checkpointer(directory=directory).latest
    if latest is None:
        raise ValueError(f"No complete Orbax checkpoint in {directory!r}.")
    return os.path.join(directory, str(latest.step)), latest.step


def _flatten(tree, prefix="") -> dict:
    flat = {}
    for key, value in (tree or {}).items():
        is_tree = isinstance(value, dict)
        flat.update(_flatten(value, f"{prefix}{key}/") if is_tree else {f"{prefix}{key}": value})
    return flat


def _saved_optimizer_config(root: str, step) -> dict | None:
    """The saving optimizer's config (for the error message only)."""
    try:
        checkpointer = _ocp().training.Checkpointer(directory=root)
        loaded = checkpointer.load_checkpointables(step, {"model_config": None})
        config = json.loads(loaded["model_config"]["config"])
        return config["compile_config"]["optimizer"]["config"]
    except Exception:
        return None


def _shape_and_dtype(meta) -> tuple[tuple[int, ...], str]:
    # On TensorFlow and torch, OrbaxCheckpoint saves scalars as Python numbers.
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return tuple(int(d) for d in meta.shape), standardize_dtype(meta.dtype)
    if isinstance(meta, (bool, int)):
        return (), "int64"
    if isinstance(meta, float):
        return (), "float32"
    return tuple(getattr(meta, "shape", ())), str(getattr(meta, "dtype", type(meta).__name__))


def _same(saved: tuple, variable) -> bool:
    shape, dtype = saved
    current = standardize_dtype(variable.dtype)
    if shape != tuple(int(d) for d in variable.shape):
        return False
    if shape == () and dtype.startswith("float") and current.startswith("float"):
        return True  # a scalar saved as a Python float
    return _saving._same_dtype(dtype, current)


def _describe(shape, dtype) -> str:
    return f"shape {tuple(int(d) for d in shape)} and dtype {standardize_dtype(dtype)}"


def checkpoint_differences(model, metadata: dict) -> list[str]:
    """What differs between a checkpoint's `pytree` metadata and `model` (and its optimizer)."""
    differences = []
    # A float learning rate is a variable, a schedule is not: either may resume the other.
    learning_rate = f"{model.optimizer.name}/learning_rate"
    for group, variables in [
        ("trainable_variables", model.trainable_variables),
        ("non_trainable_variables", model.non_trainable_variables),
        ("optimizer_variables", model.optimizer.variables),
    ]:
        saved = _flatten(metadata.get(group))
        current = {v.path: v for v in variables}
        lr_saved, lr_here = learning_rate in saved, learning_rate in current
        if group == "optimizer_variables" and variables and lr_saved != lr_here:
            saved.pop(learning_rate, None)
            current.pop(learning_rate, None)
        for path, variable in current.items():
            here = _describe(variable.shape, variable.dtype)
            if path not in saved:
                differences.append(
                    f"{group}: this model has '{path}' with {here}, which the checkpoint lacks"
                )
            elif not _same(meta := _shape_and_dtype(saved[path]), variable):
                differences.append(
                    f"{group}: saved '{path}' with {_describe(*meta)} where this model has {here}"
                )
        for path, meta in saved.items():
            if path not in current:
                differences.append(
                    f"{group}: the checkpoint has '{path}' with {_describe(*_shape_and_dtype(meta))}, which this model lacks"
                )
    return differences


def load_checkpoint(model, directory) -> None:
    """Restore `model` (weights and optimizer state) from the latest step in a
    `keras.callbacks.OrbaxCheckpoint` directory, after checking that every saved variable
    has a place in `model` and its optimizer and every variable a saved value.

    Builds the optimizer first if needed (Keras's loaders skip an unbuilt optimizer's
    slots). On a mismatch raises a `ValueError` naming each difference and the optimizer
    settings that differ, before anything is assigned. On JAX the arrays are read onto the
    current variables' placements, so a checkpoint of a multi-process or multi-device job
    restores onto any mesh (or one device) its shapes fit; where Orbax still cannot place
    them, a `ValueError` says so and nothing is assigned.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "load_checkpoint restores a compiled model: call model.compile(optimizer=...) first."
        )
    root = os.fspath(directory)
    step_directory, step = _latest_step(root)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    metadata = _ocp().metadata(step_directory, checkpointable_name="pytree").metadata
    differences = checkpoint_differences(model, metadata)
    if differences:
        current = {"config": json.loads(json.dumps(optimizer.get_config(), default=repr))}
        raise ValueError(
            f"Cannot restore the Orbax checkpoint {step_directory!r} into this model and its "
            f"{type(optimizer).__name__} '{optimizer.name}': the saved variables differ:"
            + _saving.listed(differences, 8)
            + _saving.configured_differently(
                {"config": _saved_optimizer_config(root, step)}, current
            )
            + "\nRecreate the model and optimizer as they were saved (same layer names, same optimizer "
            "configuration) to resume. Nothing was loaded."
        )
    if keras.backend.backend() != "jax":
        model.load_weights(root)  # Keras reads the latest step
        return
    import jax

    try:
        loaded = _ocp().load_checkpointables(
            step_directory, {"pytree": _abstract_tree(metadata, model.get_state_tree())}
        )
    except Exception as error:
        raise ValueError(
            f"Cannot restore the Orbax checkpoint {step_directory!r} onto this process's devices "
            f"({jax.process_count()} process(es), {len(jax.devices())} device(s)): "
            f"{type(error).__name__}: {error}. Nothing was loaded."
        ) from error
    model.set_state_tree(loaded["pytree"])


def _abstract_tree(metadata: dict, state: dict) -> dict:
    """The checkpoint's arrays placed like this model's variables (Orbax would place them as saved,
    failing where those devices are missing); one with no variable here goes to the first device."""
    import jax

    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(meta, ref):
        if isinstance(meta, dict):
            ref = ref if isinstance(ref, dict) else {}
            return {key: leaf(value, ref.get(key)) for key, value in meta.items()}
        if hasattr(meta, "shape") and hasattr(meta, "dtype"):
            sharding = getattr(ref, "sharding", None)
            return jax.ShapeDtypeStruct(
                meta.shape, meta.dtype, sharding=here if sharding is None else sharding
            )
        return None

    return {key: leaf(value, state.get(key)) for key, value in metadata.items()}
