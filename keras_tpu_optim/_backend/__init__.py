"""The backend-specific code, one package per backend; `backend`, the active one, is picked by an import as
Keras picks its backend optimizer. It takes plain arguments and never calls back into the optimizers;
`neutral` runs where a backend has nothing of its own (tests/test_backend_interface.py)."""

from __future__ import annotations

import importlib
from types import ModuleType

import keras

SUPPORTED = ("tensorflow", "jax", "torch")

# The modules imported so far. A plain dict, not `functools.cache`: `torch.compile` traces a dict
# lookup, and breaks its graph at an `importlib` call (even one a cache would skip).
_MODULES: dict = {}


def backend_module(package: str, name: str) -> ModuleType:
    """`package.name`, imported once: how every per-backend module of the package is found."""
    module = _MODULES.get((package, name))
    if module is None:
        module = _MODULES[(package, name)] = importlib.import_module(f"{package}.{name}")
    return module


def get(name: str | None = None) -> ModuleType:
    """The backend package for `name` (default: the active Keras backend)."""
    name = keras.backend.backend() if name is None else name
    if name not in SUPPORTED:
        raise NotImplementedError(
            f"keras_tpu_optim supports the {', '.join(SUPPORTED)} backends, not {name!r}."
        )
    return backend_module(__name__, name)


if keras.backend.backend() == "tensorflow":
    from keras_tpu_optim._backend import tensorflow as backend
elif keras.backend.backend() == "jax":
    from keras_tpu_optim._backend import jax as backend
elif keras.backend.backend() == "torch":
    from keras_tpu_optim._backend import torch as backend
else:
    backend = None  # Refused when an optimizer is made (`get`).
