"""The JAX backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import functools

import jax
from keras import ops
from jax.experimental import sparse as jax_sparse

from keras_tpu_optim._backend import neutral
from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim._backend.jax import rows
from keras_tpu_optim._math import adafactor as adafactor_math
from keras_tpu_optim._math import embedding_adam as adam_math


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
    """A BCOO gradient as a dense array, duplicate indices summed, ids out of range dropped."""
    if not isinstance(gradient, jax_sparse.BCOO):
        return gradient
    ids, values = rows.row_entries(gradient)
    ids = sparse_rows.in_table(ids, gradient.shape[0])
    return jax.numpy.zeros(gradient.shape, values.dtype).at[ids].add(values, mode="drop")


def concrete(x) -> bool:
    """Whether `x` has a value now (eager code), rather than being traced (`jax.jit`, a traced branch)."""
    return not isinstance(getattr(x, "value", x), jax.core.Tracer)


def cond(condition, true_fn, false_fn):
    """`ops.cond`; where `condition` is concrete, only the branch taken is called (eagerly, `jax.lax.cond`
    compiles both branches anew at every call)."""
    if concrete(condition):
        return true_fn() if bool(condition) else false_fn()
    return ops.cond(condition, true_fn, false_fn)


def apply_if(condition, apply, state):
    if concrete(condition):
        if bool(condition):
            apply()
        return
    # Traced, JAX branches must be pure: apply, then keep the old or the new value of every variable.
    before = [v.value for v in state]
    apply()
    after = [v.value for v in state]
    kept = jax.lax.cond(condition, lambda: after, lambda: before)
    for variable, value in zip(state, kept):
        variable.assign(value)


# Adafactor on CPU: XLA fuses the sibling row and column reductions of a factored step into one loop and
# recomputes the statistics inside the update's reduction, both several times slower than separate
# passes; optimisation barriers keep them apart. Elsewhere XLA's own fusion decisions stand.
class CpuEvaluation(adafactor_math.Evaluation):
    """Optimisation barriers between the step's reductions."""

    def square_sums(self, x, axes):
        # Each sum its own pass over `x`: XLA would fuse sibling reductions into one slower loop.
        sums = []
        for index, axis in enumerate(axes):
            sums += super().square_sums(self.separately(x) if index else x, (axis,))
        return tuple(sums)

    def separately(self, x):
        return jax.lax.optimization_barrier(x)


CPU_EVALUATION = CpuEvaluation()


def adafactor_evaluation(platform: str) -> adafactor_math.Evaluation:
    """How a step of a variable on `platform` is evaluated: barriers on CPU, the neutral form elsewhere."""
    return CPU_EVALUATION if platform == "cpu" else adafactor_math.NEUTRAL


def dense_ids(ids, weights, width):
    """(`neutral.dense_ids`) JAX's sparse arrays (BCOO)."""
    if not isinstance(ids, jax_sparse.JAXSparse):
        return ids, None, weights
    ones = jax_sparse.BCOO((ops.ones_like(ids.data, "float32"), ids.indices), shape=ids.shape)
    ones = ones.todense()
    if weights is None:
        weights = ones
    elif isinstance(weights, jax_sparse.JAXSparse):
        weights = weights.todense()
    return ids.todense(), ones > 0, weights


def eager_branches(iterations) -> bool:
    return concrete(iterations)


state_creation_scope = neutral.state_creation_scope
checked_gradient = neutral.checked_gradient
accumulation_rows = neutral.accumulation_rows
adafactor_group_steps = neutral.adafactor_group_steps


@jax.custom_vjp
def unstacked(rows):
    """`rows` split along its first axis, differentiated into one stack: JAX's own gradient of `unstack` is a
    padded copy of the whole stack per part (work growing with the square of the parts)."""
    return tuple(rows[i] for i in range(rows.shape[0]))


def _stacked(_, parts):
    # Joined along their last axis and moved: XLA folds a concatenation of adjacent slices of one array (a
    # model concatenating the parts) into one slice, where a stack copies each part by itself.
    joined = jax.numpy.concatenate(parts, axis=-1)
    shape = parts[0].shape
    return (jax.numpy.moveaxis(joined.reshape(shape[:-1] + (len(parts), shape[-1])), -2, 0),)


unstacked.defvjp(lambda rows: (unstacked(rows), None), _stacked)


def adafactor_step(
    gradient, variable, state, *, learning_rate, step, options, variable_index, platform, cache
):
    """The neutral step with the platform's evaluation, as one `jax.jit` per options (inlined where traced)."""
    structure, values = adafactor_math.split_options(options)
    update = _adafactor_update(structure, adafactor_evaluation(platform))
    new_values = update(
        densify(gradient),
        variable.value,
        tuple(s.value for s in state.slots),
        None if state.momentum is None else state.momentum.value,
        ops.convert_to_tensor(learning_rate),
        ops.convert_to_tensor(step),
        variable_index,
        {name: ops.convert_to_tensor(value, "float32") for name, value in values.items()},
    )
    # The momentum last: without one, the values stop before it.
    for target, value in zip((variable, *state.slots, state.momentum), new_values):
        target.assign(value)


@functools.cache
def _adafactor_update(structure, evaluation):
    """`(gradient, variable, slots, momentum, learning_rate, step, variable_index, option_values)` -> the new
    `(variable, *slots, momentum)` (momentum None: left out), compiled once per shape and options' structure."""

    def adafactor_values(*arguments):
        new = {}  # The neutral step, functionally: each array's new value by its identity.
        _, variable, slots, momentum = arguments[:4]
        neutral.adafactor_step(
            *arguments[:4],
            **neutral.step_numbers(arguments[4:], structure),
            evaluation=evaluation,
            assign=lambda t, value: new.__setitem__(id(t), value),
        )
        return tuple(new[id(t)] for t in (variable, *slots, momentum) if t is not None)

    return jax.jit(adafactor_values)


def embedding_adam_step(
    gradient, variable, slots, update_rows, *, lazy, accumulate_duplicates, max_touched_rows, cache
):
    if not lazy:
        neutral.dense_row_update(update_rows, densify(gradient), variable, slots)
        return
    if isinstance(gradient, jax_sparse.BCOO):
        # The rows a BCOO names are the touched rows, as a tf.IndexedSlices' indices.
        path = ("sparse", accumulate_duplicates)
        entries = rows.row_entries(gradient)
        if concrete(entries[0]):
            entries = sparse_rows.padded(*entries)
    else:
        path = ("dense", min(variable.shape[0], max_touched_rows or 4096))
        entries = (gradient,)
    targets = (variable, *slots)
    structure, arguments = update_rows.split()
    new_values = _row_update(path, structure)(entries, tuple(t.value for t in targets), arguments)
    for target, value in zip(targets, new_values):
        target.assign(value)


@functools.cache
def _row_update(path, structure):
    """The lazy row update of a path (`("dense", capacity)` or `("sparse", accumulate_duplicates)`), one
    `jax.jit` per options' structure (inlined where traced)."""
    kind, static = path

    def row_values(entries, tables, arguments):
        update_rows = adam_math.RowUpdate.joined(structure, arguments)
        if kind == "dense":
            return rows.lazy_row_update(update_rows, *entries, tables, capacity=static)
        return rows.sparse_row_update(update_rows, *entries, tables, accumulate_duplicates=static)

    return jax.jit(row_values)


class _Lookup(neutral.LookupEvaluation):
    """State is immutable: the backward pass returns, as the gradients of the table, its slots, the window and
    `iterations`, their new values, which Keras's `overwrite_with_gradient` installs (in place under `jax.jit`
    with donated state)."""

    def hook(self, forward, backward, ids, step, learning_rate, state, window, cache, name):
        @jax.custom_vjp
        def lookup(*arguments):
            return saving(*arguments)[0]

        def saving(ids, step, learning_rate, window, *tables):
            found, residuals = forward(ids, step, learning_rate, tables, window)
            saved = (residuals, ids, step, learning_rate, window, tables)
            return (found, jax.numpy.zeros((), "float32")), saved

        def stepping(saved, cotangents):
            residuals, ids, step, learning_rate, window, tables = saved
            row_gradients, loss_scale = cotangents
            new_tables, new_window, next_step = backward(
                residuals, row_gradients, loss_scale, ids, step, learning_rate, window, tables
            )
            return (None, next_step, None, new_window, *new_tables)

        lookup.defvjp(saving, stepping)
        window = None if window is None else window.value
        return lookup(ids, step, learning_rate, window, *(t.value for t in state))

    def write_in_place(self, variable, value):
        pass  # Its new value is its gradient: the model's optimizer installs it (or skips the step).

    def gather(self, table, ids, axis=0):
        # An id past the table reads as `ops.take` reads it (NaN); its update is dropped.
        return jax.numpy.take(table, ids, axis=axis, mode="fill")

    def write_rows(self, targets, ids, new_rows):
        return [rows.scatter(t, ids, r.astype(t.dtype)) for t, r in zip(targets, new_rows)]

    def unless_nonfinite(self, finite, write, ids, targets, every_row, name):
        # Functionally: ids past the table, whose writes are dropped (the cost stays the rows'); or, where
        # every row is written, the old tables selected.
        if every_row:
            return lambda: [jax.numpy.where(finite, n, t) for n, t in zip(write(ids), targets)]
        return functools.partial(write, jax.numpy.where(finite, ids, targets[0].shape[0]))

    def sparse_step(self, targets, ids, values, update_rows, *, lazy, accumulate_duplicates, cache):
        if lazy:
            new_tables = rows.sparse_row_update(
                update_rows, ids, values, targets, accumulate_duplicates=accumulate_duplicates
            )
        else:
            zeros = jax.numpy.zeros(targets[0].shape, values.dtype)
            new_tables = update_rows(zeros.at[ids].add(values, mode="drop"), *targets)
        return tuple(new.astype(t.dtype) for new, t in zip(new_tables, targets))


trained_lookup = functools.partial(neutral.trained_lookup, evaluation=_Lookup())


def host_value(x):
    """`x`'s value as a Python int where it has one now (eagerly), else None."""
    return int(x) if concrete(x) else None


def lookup_trace(iterations):
    """The step's traced value of `iterations` (one tracer per trace), or None eagerly."""
    value = iterations.value
    return None if concrete(value) else value
