"""The JAX backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import functools

import jax
from keras import ops
from jax.experimental import sparse as jax_sparse

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend import rows as sparse_rows
from keras_tpu_optim._backend.jax import rows
from keras_tpu_optim._math import adafactor as adafactor_math
from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim._backend.jax.adafactor import adafactor_evaluation


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


def concrete(x) -> bool:
    """Whether `x` has a value now (eager code), rather than being traced (`jax.jit`, a traced branch)."""
    return not isinstance(getattr(x, "value", x), jax.core.Tracer)


def cond(condition, true_fn, false_fn):
    """`ops.cond`; where `condition` is concrete, only the branch taken is called.

    Eagerly, `jax.lax.cond` traces both branches and compiles them, at every
    call: the branches are new functions each time.
    """
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


state_creation_scope = neutral.state_creation_scope
checked_gradient = neutral.checked_gradient
adafactor_steps = neutral.adafactor_steps  # one variable at a time: XLA fuses each step


def adafactor_step(optimizer, gradient, variable, learning_rate):
    """The neutral step with the platform's reductions, as one `jax.jit` per options (inlined where traced)."""
    state = optimizer._state_of(variable)
    targets = (variable, *state.slots) + (() if state.momentum is None else (state.momentum,))
    structure, values = adafactor_math.split_options(optimizer._options)
    update = _adafactor_update(structure, adafactor_evaluation(optimizer._platform_of(variable)))
    new_values = update(
        densify(gradient),
        tuple(t.value for t in targets),
        ops.convert_to_tensor(learning_rate),
        ops.convert_to_tensor(optimizer.iterations + 1),
        _private.variable_index(optimizer, variable),
        {name: ops.convert_to_tensor(value, "float32") for name, value in values.items()},
    )
    for target, value in zip(targets, new_values):
        optimizer.assign(target, value)


@functools.cache
def _adafactor_update(structure, evaluation):
    """`(gradient, (variable, *slots[, momentum]), learning_rate, step, variable_index, option_values)` -> the new values.

    Compiled once per shape and options' structure (`adafactor_math.split_options`: the numbers are arguments).
    """

    def update(gradient, values, learning_rate, step, variable_index, option_values):
        options = adafactor_math.joined_options(structure, option_values)
        variable, slots = values[0], values[1 : len(values) - (options.beta_1 is not None)]
        momentum = values[-1] if options.beta_1 is not None else None
        delta, new_slots, new_momentum = neutral.adafactor_results(
            gradient,
            variable,
            slots,
            momentum,
            learning_rate=learning_rate,
            step=step,
            options=options,
            evaluation=evaluation,
        )
        if momentum is not None:
            new_slots = (*new_slots, ops.cast(new_momentum, momentum.dtype))
        rounding = neutral.variable_rounding(options, step, variable_index, variable.shape)
        return (neutral.subtracted(variable, delta, rounding), *new_slots)

    return jax.jit(update)


def embedding_adam_step(optimizer, gradient, variable, learning_rate):
    if not optimizer.lazy_adam:
        neutral.embedding_adam_step(
            optimizer, gradient, variable, learning_rate, lazy_row_update=None, densify=densify
        )
        return
    num_rows = variable.shape[0]
    if isinstance(gradient, jax_sparse.BCOO):
        # The rows a BCOO names are the touched rows, as a tf.IndexedSlices' indices.
        path = ("sparse", optimizer.use_gradient_accumulation)
        entries = rows.row_entries(gradient)
        if concrete(entries[0]):
            entries = sparse_rows.padded(*entries)
    else:
        path = (
            "dense",
            min(num_rows, optimizer.max_touched_rows or rows.default_capacity(num_rows)),
        )
        entries = (gradient,)
    targets = (variable, *optimizer._row_slots(variable))
    structure, values = adam_math.split_options(optimizer._row_update_options(variable))
    update = _row_update(path, structure)
    ema_step = optimizer._ema_step()
    new_values = update(
        entries,
        tuple(t.value for t in targets),
        ops.convert_to_tensor(optimizer._row_learning_rate(learning_rate)),
        None if ema_step is None else ops.convert_to_tensor(ema_step),
        {name: ops.convert_to_tensor(value, "float32") for name, value in values.items()},
    )
    for target, value in zip(targets, new_values):
        target.assign(value)


@functools.cache
def _row_update(path, structure):
    """The lazy row update of a path (`("dense", capacity)` or `("sparse", accumulate_duplicates)`), as one `jax.jit`.

    Traced, it is inlined into the caller's computation; eagerly it compiles
    once per shape and options' structure (`adam_math.split_options`: the
    numbers are arguments), where its loop and gathers traced op by op would
    compile at every call; a BCOO's entries are padded to a power-of-two count.
    """
    kind, static = path

    def update(entries, tables, learning_rate, ema_step, values):
        update_rows = functools.partial(
            neutral.update_rows_in_float32,
            learning_rate=learning_rate,
            options=adam_math.joined_options(structure, values),
            ema_step=ema_step,
        )
        if kind == "dense":
            return rows.lazy_row_update(update_rows, *entries, tables, capacity=static)
        return rows.sparse_row_update(update_rows, *entries, tables, accumulate_duplicates=static)

    return jax.jit(update)


def apply_gradients(optimizer, grads, variables, keras_apply):
    """Keras's step (`keras_apply`), or, eagerly under `gradient_accumulation_steps`, its numbers with only the branch taken.

    Keras's JAX step is stateless: it computes both the accumulation and the
    update, and keeps one (in `jax.lax.cond`s, compiled anew at every eager
    call). Traced (`jax.jit`, as `fit` runs it) that is what runs. With
    `accumulates_rows` (EmbeddingAdam's lazy tables) the accumulator stays
    dense here, BCOO gradients densified; the `window` slot is kept as on the
    other backends, so a state saved here resumes there.
    """
    number = ops.cast(optimizer.iterations + 1, "int32")  # before `apply` counts this micro-step
    if optimizer._accumulates_rows:
        grads = [densify(g) for g in grads]
    if optimizer.gradient_accumulation_steps and concrete(optimizer.iterations):
        _eager_accumulated_apply(optimizer, grads, variables)
    else:
        keras_apply(grads, variables)
    if optimizer._accumulates_rows:
        for gradient, variable in zip(grads, variables):
            window = optimizer._accumulation_window(variable)
            if window is not None:
                window.assign(adam_math.mark_touched(gradient, window.value, number))


def _eager_accumulated_apply(optimizer, grads, variables):
    """Keras's `gradient_accumulation_steps` step and EMA (`JaxOptimizer._backend_apply_gradients`), eagerly.

    On micro-steps `acc += g`; on every N-th one update with the mean
    `(g + acc) / N`, clipped and decayed as Keras does, then `acc = 0`; then
    the EMA, installed in the weights every `ema_overwrite_frequency` updates.
    """
    steps = optimizer.gradient_accumulation_steps
    accumulators = [
        _private.gradient_accumulators(optimizer)[_private.variable_index(optimizer, v)]
        for v in variables
    ]
    if (int(_private.raw_iterations(optimizer)) + 1) % steps == 0:
        means = [(g + acc.value) / steps for g, acc in zip(grads, accumulators)]
        means = _private.clip_gradients(optimizer, means)
        _private.apply_weight_decay(optimizer, variables)
        _private.backend_update_step(optimizer, means, variables, optimizer.learning_rate)
        for acc in accumulators:
            acc.assign(jax.numpy.zeros(acc.shape, acc.dtype))
    else:
        for gradient, acc in zip(grads, accumulators):
            acc.assign(gradient + acc.value)
    if optimizer.use_ema:
        _private.update_moving_averages(optimizer)
        frequency = optimizer.ema_overwrite_frequency
        if frequency and (int(optimizer.iterations) + 1) % frequency == 0:
            _private.overwrite_with_moving_averages(optimizer)


def trained_lookup(
    ids, state, iterations, row_update_arguments, *, lazy, accumulate_duplicates, owner
):
    """The rows of `state[0]` at `ids`; the backward pass returns, as the gradients of the table, its slots and
    `iterations`, their values after the row update (Keras's `overwrite_with_gradient` installs them).

    `state` is the table and its slots (`(table, momenta, velocities[, row_steps])`), `iterations` the float32
    step count, `row_update_arguments(step) -> (learning_rate, options)` the row update's arguments. A JAX
    gradient cannot update a variable in place; under `jax.jit` with donated state (Keras's trainer) the
    scatters of the new rows reuse the table's and slots' buffers. Out-of-range ids gather as Keras's `take`
    does and update nothing.
    """

    @jax.custom_vjp
    def lookup(ids, step, *tables):
        return ops.take(tables[0], ids, axis=0)

    def forward(ids, step, *tables):
        return lookup(ids, step, *tables), (ids, step, tables)

    def backward(residuals, row_gradients):
        ids, step, tables = residuals
        flat_ids = ids.reshape(-1)
        values = row_gradients.reshape((flat_ids.shape[0],) + tuple(tables[0].shape[1:]))
        learning_rate, options = row_update_arguments(step)
        update_rows = functools.partial(
            neutral.update_rows_in_float32, learning_rate=learning_rate, options=options
        )
        if lazy:
            new_tables = rows.sparse_row_update(
                update_rows, flat_ids, values, tables, accumulate_duplicates=accumulate_duplicates
            )
        else:
            gradient = (
                jax.numpy.zeros(tables[0].shape, values.dtype).at[flat_ids].add(values, mode="drop")
            )
            new_tables = update_rows(gradient, *tables)
        return (None, step + 1, *(new.astype(t.dtype) for new, t in zip(new_tables, tables)))

    lookup.defvjp(forward, backward)
    return lookup(ids, iterations.value, *(t.value for t in state))


def lookup_trace(iterations):
    """The step's traced value of `iterations` (one tracer per trace), or None eagerly."""
    value = iterations.value
    return None if concrete(value) else value
