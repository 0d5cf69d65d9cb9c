"""One interface to the backend-specific code, resolved once per optimizer.

Each backend package (`tensorflow`, `jax`, `torch`) provides the same
functions; the optimizers call them and never ask which backend runs:

- `platform_of(variable) -> str`: where a variable lives (`"cpu"`, `"gpu"`,
  `"tpu"`, or another device type).
- `gradient_values(gradient)`: the stored values of a gradient (a sparse
  gradient's values, a dense one itself), `unscale(gradient, scale)`:
  `gradient / scale`, sparse gradients included, and `densify(gradient)`.
- `checked_gradient(gradient, variable, mismatch)`: the gradient, checked to
  have the variable's shape (a `ValueError(mismatch(shape))` if not; in a TF
  graph, at run time where the static shape is partly unknown) and carrying
  that static shape, so that every kernel may read its shapes from it.
- `apply_if(condition, apply, state)`: run `apply()` only where the scalar
  `condition` holds, with `state` the variables `apply` may change.
- `adafactor_step(optimizer, gradient, variable, learning_rate)` and
  `embedding_adam_step(optimizer, gradient, variable, learning_rate)`: one
  optimizer step for one variable, in place; `adafactor_steps(optimizer,
  grads, variables, learning_rate, keras_steps)`: a step's Adafactor updates
  of all its variables (`keras_steps`, Keras's loop over `update_step`, or
  groups of variables at once).
- `cond(condition, true_fn, false_fn)`: `ops.cond`, which on JAX calls only
  the branch taken where `condition` is concrete (eager code): a traced
  branch would be compiled anew at every call.
- `apply_gradients(optimizer, grads, variables, keras_apply)`: Keras's step
  after unscaling (the accumulate-or-update of `gradient_accumulation_steps`,
  then the EMA); `keras_apply` is Keras's own. The rows of sparse gradients
  are accumulated sparsely where the backend can
  (`optimizer._accumulates_rows`); eager JAX runs only the branch taken.
- `adafactor_evaluation(platform)`: how Adafactor's sums are evaluated on
  that platform (see `_math.adafactor.Evaluation`).
- `state_creation_scope()`: the context `build` creates the optimizer's state
  in (TF: out of a function being traced, so that each variable is created
  and initialised once, eagerly, not as a traced initializer function).
- `trained_lookup(ids, state, iterations, row_update_arguments, *, lazy,
  accumulate_duplicates, owner)`: `layers.Embedding`'s lookup of the rows
  `ids` of `state[0]`, whose backward pass applies EmbeddingAdam's row update
  to the rows looked up (`state` is the table and its slots, `iterations` the
  float32 step count, `row_update_arguments(step) -> (learning_rate,
  options)`) and returns `iterations + 1` as the gradient of `iterations`;
  `lookup_trace(iterations)`: what identifies the traced step a lookup is in
  (the same object for every lookup of one trace), or None where steps are
  not traced.

Evaluations measured on one platform are chosen by platform (a variable's, from
`platform_of`), and the neutral `keras.ops` form runs everywhere else
(docs/algorithms.md#platform-specific-evaluation lists which runs where).
Dependencies point down: optimizers -> `_backend` -> `_backend.neutral` ->
`_math` -> `keras.ops`; a backend package imports its framework, never the
optimizer classes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import keras

SUPPORTED = ("tensorflow", "jax", "torch")
# What every backend package provides (see above).
INTERFACE = (
    "platform_of",
    "gradient_values",
    "checked_gradient",
    "unscale",
    "densify",
    "apply_if",
    "adafactor_step",
    "adafactor_steps",
    "embedding_adam_step",
    "apply_gradients",
    "cond",
    "adafactor_evaluation",
    "state_creation_scope",
    "trained_lookup",
    "lookup_trace",
)


def get(name: str | None = None) -> ModuleType:
    """The backend package for `name` (default: the active Keras backend)."""
    name = keras.backend.backend() if name is None else name
    if name not in SUPPORTED:
        raise NotImplementedError(
            f"keras_tpu_optim supports the {', '.join(SUPPORTED)} backends, not {name!r}."
        )
    return backend_module(__name__, name)


# The modules imported so far. A plain dict, not `functools.cache`: `torch.compile` traces a dict
# lookup, and breaks its graph at an `importlib` call (even one a cache would skip).
_MODULES: dict = {}


def backend_module(package: str, name: str) -> ModuleType:
    """`package.name`, imported once: how every per-backend module of the package is found."""
    module = _MODULES.get((package, name))
    if module is None:
        module = _MODULES[(package, name)] = importlib.import_module(f"{package}.{name}")
    return module
