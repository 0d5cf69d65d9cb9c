"""Row-sparse updates of tables: one neutral entry point, one module per backend.

An "update rows" function maps `(grad_rows, weight_rows, *slot_rows)` to new
`(weight_rows, *slot_rows)`. `lazy_row_update` finds the rows a gradient
touches (a sparse gradient's indices, or a dense gradient's non-zero rows),
gathers them, applies the function and scatters the results back in place, so
the optimizer's work is proportional to the rows touched, not to the table.
`dense_row_update` applies the function to every row.

Each backend module provides `lazy_row_update` and `densify`; the choice is
made on `keras.backend.backend()` at call time.
"""

from __future__ import annotations

import importlib

import keras
from keras import ops


def _backend_module():
    name = keras.backend.backend()
    if name not in ("tensorflow", "jax", "torch"):
        raise NotImplementedError(f"keras_tpu_optim does not support the {name!r} backend.")
    return importlib.import_module(f"{__name__}.{name}")


def lazy_row_update(update_rows, gradient, variable, slots, *, accumulate_duplicates, max_touched_rows):
    """Update only the rows present in `gradient`; untouched rows keep their bits.

    Args:
        update_rows: the row function (see the module docstring).
        gradient: a dense gradient, or the backend's sparse gradient
            (`tf.IndexedSlices`, a torch sparse COO tensor).
        variable: the table (a `keras.Variable`), updated in place.
        slots: the table's slot variables, updated in place.
        accumulate_duplicates: sum the gradients of duplicate indices before
            the update (True), or let the last occurrence's update win (False).
        max_touched_rows: the static row capacity of one JAX gather/update/
            scatter round (ignored by backends with dynamic shapes).
    """
    _backend_module().lazy_row_update(
        update_rows,
        gradient,
        variable,
        slots,
        accumulate_duplicates=accumulate_duplicates,
        max_touched_rows=max_touched_rows,
    )


def densify(gradient):
    """A sparse gradient (`tf.IndexedSlices`, torch sparse) as a dense tensor, duplicates summed."""
    return _backend_module().densify(gradient)


def dense_row_update(update_rows, gradient, variable, slots):
    """Update every row (ordinary, non-lazy Adam)."""
    gradient = densify(gradient)
    # TF's optimizer passes native tf.Variables; convert_to_tensor reads either kind.
    new_values = update_rows(gradient, *(ops.convert_to_tensor(t) for t in (variable, *slots)))
    for target, value in zip((variable, *slots), new_values):
        target.assign(value)
