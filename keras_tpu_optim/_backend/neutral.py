"""The optimizers' steps in plain `keras.ops`: what every backend runs where it has no kernel of its own.

Each backend package calls these with its own parts (how to densify a
gradient, how to update a table's touched rows, which reductions to use).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import keras
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._math import adafactor as adafactor_math
from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim._math import stochastic_rounding


def cond(condition, true_fn, false_fn):
    """`ops.cond`: TF and torch run only the branch taken."""
    return ops.cond(condition, true_fn, false_fn)


def apply_if(condition, apply, state):
    """Run `apply()` only where the scalar boolean `condition` holds.

    `state` lists the variables `apply` may change, for backends whose
    branches must be pure (JAX); here only the branch taken runs.
    """
    ops.cond(condition, apply, lambda: None)


def checked_gradient(gradient, variable, mismatch):
    """`gradient`, after checking that its shape is the variable's (raises `ValueError(mismatch(shape))`).

    Where shapes are always concrete (JAX, torch) this is the whole check.
    """
    shape = tuple(gradient.shape)
    if shape != tuple(variable.shape):
        raise ValueError(mismatch(shape))
    return gradient


def state_creation_scope():
    """Where an optimizer's `build` creates its state: the current scope (nothing to escape)."""
    return contextlib.nullcontext()


def adafactor_step(optimizer, gradient, variable, learning_rate, evaluation=adafactor_math.NEUTRAL):
    """One Adafactor step on a dense gradient, through the optimizer's `assign`s."""
    state = optimizer._state_of(variable)
    step = optimizer.iterations + 1
    options = optimizer._options
    delta, new_slots, new_momentum = adafactor_results(
        gradient,
        variable,
        tuple(s.value for s in state.slots),
        None if state.momentum is None else state.momentum.value,
        learning_rate=learning_rate,
        step=step,
        options=options,
        evaluation=evaluation,
    )
    assign_update(
        variable,
        delta,
        state.slots,
        new_slots,
        state.momentum,
        new_momentum,
        assign=optimizer.assign,
        assign_sub=optimizer.assign_sub,
        round_to=variable_rounding(
            options, step, _private.variable_index(optimizer, variable), variable.shape
        ),
    )


def adafactor_steps(optimizer, grads, variables, learning_rate, keras_steps):
    """Keras's loop over `update_step` for a step's variables (`keras_steps`), one variable at a time."""
    keras_steps(grads, variables, learning_rate)


def adafactor_results(
    gradient, variable, slots, momentum, *, learning_rate, step, options, evaluation
):
    """`adafactor_math.adafactor_update` on a step's tensors (the slots and momentum already read): float32
    inputs, the factored axes of the variable's shape. Returns `(delta, new_slots, new_momentum)`."""
    return adafactor_math.adafactor_update(
        ops.cast(gradient, "float32"),
        ops.cast(variable, "float32"),
        tuple(slots),
        momentum,
        learning_rate=ops.cast(learning_rate, "float32"),
        step=ops.cast(step, "float32"),
        options=options,
        factored_axes=options.factored_axes(variable.shape),
        evaluation=evaluation,
    )


def variable_rounding(options, step, variable_index, shape, offset=0):
    """How a step's float32 result is cast to a variable's dtype: `ops.cast`, or stochastic rounding.

    `step` is `iterations + 1` (an integer scalar), `variable_index` the
    variable's position in the optimizer's list: with the seed, the key of
    the rounding's random bits (`_math.stochastic_rounding`). `shape` is the
    variable's static shape (None: the result's), `offset` the element index
    of the result's first element when it is a block of the variable.
    """
    if not options.stochastic_rounding:
        return ops.cast
    return functools.partial(
        stochastic_rounding.stochastic_round,
        seed=options.seed,
        step=step,
        variable_index=variable_index,
        shape=None if shape is None else tuple(shape),
        offset=offset,
    )


def assign_update(
    variable,
    delta,
    slots,
    new_slots,
    momentum,
    new_momentum,
    *,
    assign,
    assign_sub,
    round_to=ops.cast,
):
    """Write one Adafactor step's results: the statistics, the momentum, and `variable - delta`.

    A float32 variable is updated in place; any other dtype is subtracted in
    float32 and rounded once, by `round_to(value, dtype)` (`ops.cast`: to
    nearest; or `variable_rounding`'s stochastic rounding). A bfloat16
    momentum slot is stored rounded to nearest.
    """
    for slot, value in zip(slots, new_slots):
        assign(slot, value)
    if momentum is not None:
        assign(momentum, ops.cast(new_momentum, momentum.dtype))
    if keras.backend.standardize_dtype(variable.dtype) == "float32":
        assign_sub(variable, delta)
    else:
        assign(variable, subtracted(variable, delta, round_to))


def subtracted(value, delta, round_to=ops.cast):
    """`value - delta` in `value`'s dtype: in float32, rounded once by `round_to(x, dtype)` for any other dtype."""
    if keras.backend.standardize_dtype(value.dtype) == "float32":
        return value - delta
    return round_to(ops.cast(value, "float32") - delta, value.dtype)


def embedding_adam_step(optimizer, gradient, variable, learning_rate, *, lazy_row_update, densify):
    """One EmbeddingAdam step: the touched rows (`lazy_row_update`), or every row.

    `lazy_row_update(update_rows, gradient, variable, slots)` is the backend's
    row-sparse update; `densify` its conversion of a sparse gradient.
    """
    slots = optimizer._row_slots(variable)
    update_rows = RowUpdate(
        learning_rate=optimizer._row_learning_rate(learning_rate),
        options=optimizer._row_update_options(variable),
        ema_step=optimizer._ema_step(),
    )
    if optimizer.lazy_adam:
        lazy_row_update(update_rows, gradient, variable, slots)
    else:
        dense_row_update(update_rows, densify(gradient), variable, slots)


def dense_row_update(update_rows, gradient, variable, slots):
    """Update every row (ordinary, non-lazy Adam)."""
    # TF's optimizer passes native tf.Variables; convert_to_tensor reads either kind.
    new_values = update_rows(gradient, *(ops.convert_to_tensor(t) for t in (variable, *slots)))
    for target, value in zip((variable, *slots), new_values):
        target.assign(value)


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """One step's row update, `update_rows_in_float32` with its arguments: `RowUpdate(...)(grad, weight, *slots)`.

    A backend with a row kernel of its own reads the arguments
    (`learning_rate`, `options`, `ema_step`) instead of calling it.
    """

    learning_rate: Any
    options: adam_math.RowUpdateOptions
    ema_step: Any = None

    def __call__(self, grad, weight, *slots):
        return update_rows_in_float32(
            grad,
            weight,
            *slots,
            learning_rate=self.learning_rate,
            options=self.options,
            ema_step=self.ema_step,
        )


def update_rows_in_float32(
    grad, weight, momenta, velocities, *extra_slots, learning_rate, options, ema_step=None
):
    """The row update on rows of any dtype: computed in float32, cast back.

    The slot rows are `options.slot_names`' (`momenta`, `velocities`, then
    `row_steps` with per-row bias correction, kept as integers; then
    `average_steps` and `average` with a lazy EMA, updated as Keras's EMA
    update number `ema_step`).
    """
    adam_extra = extra_slots[: len(options.adam_slot_names) - 2]
    new_values = adam_math.row_update(
        ops.cast(grad, "float32"),
        ops.cast(weight, "float32"),
        ops.cast(momenta, "float32"),
        ops.cast(velocities, "float32"),
        learning_rate,
        options,
        *adam_extra,
    )
    old = (weight, momenta, velocities, *adam_extra)
    new_values = tuple(ops.cast(new, before.dtype) for new, before in zip(new_values, old))
    if options.ema_momentum is None:
        return new_values
    average_steps, average = extra_slots[len(adam_extra) :]
    new_average, new_steps = adam_math.ema_rows(
        ops.cast(weight, "float32"),
        ops.cast(new_values[0], "float32"),  # the stored new weights, as Keras's EMA reads them
        ops.cast(average, "float32"),
        average_steps,
        ema_step,
        options,
    )
    return new_values + (new_steps, ops.cast(new_average, average.dtype))


# ------------------------------------------------------- gradient accumulation of rows


def accumulated_apply(optimizer, grads, variables, *, rows):
    """Keras's `gradient_accumulation_steps` step, the rows of sparse gradients accumulated sparsely.

    Keras's own numbers (`BaseOptimizer._backend_apply_gradients`): on
    micro-steps `acc += g`; on every N-th, one update with the mean
    `(g + acc) / N`, clipped as Keras clips, then `acc = 0`; then the EMA.
    A sparse gradient of a table with a `window` slot instead adds its rows
    into `acc` and records them in `window` (the number of the update the
    window ends in, so nothing is ever cleared); at the update step the rows
    of the window are found by one scan of `window` (`(rows,)` int32), and
    only they are gathered, averaged, updated and zeroed. Dense gradients
    keep Keras's dense arithmetic (and mark their rows).

    `rows` is the backend's row module: `sparse_entries(gradient)` (`(ids,
    values)`, or None for a dense gradient), `add_to_window(accumulator,
    window, ids, values, number)` (add the rows, mark them), `window_sizes(like, window, steps)` (the static
    lengths to try for the list of a window's rows, smallest first; `(None,)`:
    dynamic), `window_count(window, number)` and `window_gradient(accumulator,
    window, number, steps, like, size)` (the window's rows of `accumulator /
    steps` as a sparse gradient like `like`, in a list of length `size`; those
    rows of `accumulator` then zeroed).
    """
    steps = optimizer.gradient_accumulation_steps
    is_update_step = ops.equal((_private.raw_iterations(optimizer) + 1) % steps, 0)
    number = ops.cast(optimizer.iterations + 1, "int32")  # the update this window ends in
    accumulators = _private.gradient_accumulators(optimizer)
    pairs = [
        (g, accumulators[_private.variable_index(optimizer, v)], optimizer._accumulation_window(v))
        for g, v in zip(grads, variables)
    ]

    sparse = [window is not None and rows.sparse_entries(g) is not None for g, _, window in pairs]
    # A sparse gradient joins the window at every micro-step, the update step's included.
    for (gradient, acc, window), is_sparse in zip(pairs, sparse):
        if is_sparse:
            _add_to_window(gradient, acc, window, number, rows)
    sizes = [
        rows.window_sizes(g, window, steps) if is_sparse else (None,)
        for (g, _, window), is_sparse in zip(pairs, sparse)
    ]

    def update_with(choice):
        means = [
            rows.window_gradient(acc, window, number, steps, g, size[choice])
            if is_sparse
            else _dense_mean(g, acc, steps)
            for (g, acc, window), is_sparse, size in zip(pairs, sparse, sizes)
        ]
        means = _private.clip_gradients(optimizer, means)
        _private.apply_weight_decay(optimizer, variables)
        _private.backend_update_step(optimizer, means, variables, optimizer.learning_rate)
        # Keras resets every accumulator, also of variables without a gradient at this step.
        given = {id(acc) for _, acc, _ in pairs}
        for acc in accumulators:
            if acc is not None and id(acc) not in given:
                acc.assign(ops.zeros(acc.shape, acc.dtype))

    def accumulate():
        for (gradient, acc, window), is_sparse in zip(pairs, sparse):
            if not is_sparse:
                _add_to_window(gradient, acc, window, number, rows)

    bounded = [(window, size[0]) for (_, _, window), size in zip(pairs, sizes) if len(size) > 1]
    if not bounded:
        ops.cond(is_update_step, lambda: update_with(0), accumulate)
    else:
        # Static shapes: at the update step the window's rows are listed in the smaller size when they
        # fit, else in the larger. One three-way switch: a nested `cond` makes XLA copy the state.
        def fits():
            return ops.all(
                ops.stack([rows.window_count(window, number) <= size for window, size in bounded])
            )

        small = ops.cond(is_update_step, fits, lambda: ops.convert_to_tensor(True))
        branch = ops.where(is_update_step, ops.where(small, 1, 2), 0)
        ops.switch(branch, [accumulate, lambda: update_with(0), lambda: update_with(-1)])
    keras_moving_average(optimizer)


def _add_to_window(gradient, accumulator, window, number, rows):
    entries = None if window is None else rows.sparse_entries(gradient)
    if entries is None:
        accumulator.assign(gradient + accumulator)  # Keras's `g + acc`
        if window is not None:
            window.assign(adam_math.mark_touched(gradient, window.value, number))
        return
    ids, values = entries
    rows.add_to_window(accumulator, window, ids, values, number)


def _dense_mean(gradient, accumulator, steps):
    """Keras's mean of the window, `(g + acc) / steps`, densely; the accumulator is then zero."""
    mean = (gradient + accumulator) / steps
    accumulator.assign(ops.zeros(accumulator.shape, accumulator.dtype))
    return mean


def keras_moving_average(optimizer):
    """The end of Keras's step: the EMA update, and its overwrite of the weights every `ema_overwrite_frequency`."""
    if not optimizer.use_ema:
        return
    _private.update_moving_averages(optimizer)
    if optimizer.ema_overwrite_frequency:
        due = ops.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
        ops.cond(due, lambda: _private.overwrite_with_moving_averages(optimizer), lambda: None)
