"""The JAX backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import functools

import jax
from keras import ops
from jax.experimental import sparse as jax_sparse

from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.jax import compile_heap, huge_pages, rows
from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim._backend.jax.adafactor import adafactor_reductions



def platform_of(variable) -> str:
    try:
        devices = variable.value.devices()
    except (AttributeError, TypeError, jax.errors.ConcretizationTypeError):
        devices = ()  # A tracer: not placed yet.
    for device in devices:
        return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    return jax.default_backend()


def gradient_values(gradient):
    return gradient.data if isinstance(gradient, jax_sparse.BCOO) else gradient


def unscale(gradient, scale):
    if isinstance(gradient, jax_sparse.BCOO):
        return jax_sparse.BCOO((gradient.data / scale, gradient.indices), shape=gradient.shape)
    return gradient / scale


def densify(gradient):
    """A BCOO gradient as a dense array, duplicate indices summed."""
    return gradient.todense() if isinstance(gradient, jax_sparse.BCOO) else gradient


def apply_if(condition, apply, state):
    # JAX branches must be pure: apply, then keep the old or the new value of
    # every variable (stateless under jit, eager outside).
    before = [v.value for v in state]
    apply()
    after = [v.value for v in state]
    kept = jax.lax.cond(condition, lambda: after, lambda: before)
    for variable, value in zip(state, kept):
        variable.assign(value)


state_creation_scope = neutral.state_creation_scope
checked_gradient = neutral.checked_gradient


def prepare_platforms(platforms):
    """On CPU, XLA's freed compile heap goes back to the OS before the compiled step runs (see `compile_heap`)."""
    if "cpu" in platforms:
        compile_heap.release_after_compilations()


def prepare_row_tables(tables, slots):
    """Huge pages for the tables' and slots' CPU buffers (see `huge_pages`): random rows cost fewer TLB misses."""
    huge_pages.advise_tables(tables, collapse=True)
    huge_pages.advise_tables(slots)


def adafactor_step(optimizer, gradient, variable, learning_rate):
    neutral.adafactor_step(
        optimizer, densify(gradient), variable, learning_rate, adafactor_reductions(optimizer.platform_of(variable))
    )


def embedding_adam_step(optimizer, gradient, variable, learning_rate):
    if isinstance(gradient, jax_sparse.BCOO):
        # The rows a BCOO names are the touched rows, as a tf.IndexedSlices' indices.
        lazy_row_update = functools.partial(
            rows.sparse_row_update, accumulate_duplicates=optimizer.use_gradient_accumulation
        )
    else:
        lazy_row_update = functools.partial(rows.lazy_row_update, max_touched_rows=optimizer.max_touched_rows)
    neutral.embedding_adam_step(
        optimizer, gradient, variable, learning_rate, lazy_row_update=lazy_row_update, densify=densify
    )


def accumulated_apply(optimizer, grads, variables, keras_apply):
    """Keras's own accumulate-or-update step (`keras_apply`), BCOO gradients densified, then the window marks.

    Keras's JAX step is stateless (both branches computed, one kept), so the
    accumulator stays dense; a dense gradient is table-sized anyway. The
    `window` slot is kept as on the other backends, so a state saved here
    resumes there.
    """
    number = ops.cast(optimizer.iterations + 1, "int32")  # before `apply` counts this micro-step
    grads = [densify(g) for g in grads]
    keras_apply(grads, variables)
    for gradient, variable in zip(grads, variables):
        window = optimizer.accumulation_window(variable)
        if window is not None:
            window.assign(adam_math.mark_touched(gradient, window.value, number))
