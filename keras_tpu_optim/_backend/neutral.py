"""What a backend runs where it has nothing of its own: the optimizers' steps in plain `keras.ops`."""

from __future__ import annotations

import contextlib
import functools

from keras import ops

from keras_tpu_optim._math import adafactor as adafactor_math
from keras_tpu_optim._math import catch_up, sparse_rows
from keras_tpu_optim._math import embedding_adam as adam_math


# A backend whose `ops.cond` compiles both branches eagerly calls only the one taken.
cond = ops.cond


def eager_branches(iterations) -> bool:
    """Whether Keras's own step would compile both branches of its `ops.cond`s at every call (eager JAX)."""
    return False


def apply_if(condition, apply, state):
    """Run `apply()` only where the scalar `condition` holds (`state`: the variables it may change)."""
    ops.cond(condition, apply, lambda: None)


def checked_gradient(gradient, variable, mismatch):
    """`gradient`, checked to have the variable's shape (`ValueError(mismatch(shape))` if not)."""
    shape = tuple(gradient.shape)
    if shape != tuple(variable.shape):
        raise ValueError(mismatch(shape))
    return gradient


unstacked = functools.partial(ops.unstack, axis=0)  # `rows` split along its first axis
state_creation_scope = contextlib.nullcontext  # where `build` creates its state: the current scope


def dense_ids(ids, weights, width):
    """`(ids, present, weights)`: a feature's ids as a dense tensor. A ragged or sparse input (the backend's
    kinds) is padded to `width` where given (longer rows truncated, as keras-rs does), with `present`
    marking its entries and `weights` zero elsewhere (ones where it has none); any other input is returned
    as it is, with `present` None."""
    return ids, None, weights


def accumulation_rows():
    """The row operations of `keras_tpu_optim._accumulation`, or None: sparse gradients densified first."""
    return None


def adafactor_step(
    gradient,
    variable,
    slots,
    momentum,
    *,
    learning_rate,
    step,
    options,
    variable_index,
    evaluation,
    assign=None,
    assign_sub=None,
):
    """One Adafactor step of `variable`, its `slots` and `momentum` (or None), through `assign(target, value)`
    and `assign_sub` (default: the variables' own; `assign` alone: functionally, no subtraction in place)."""
    delta, new_slots, new_momentum = adafactor_math.float32_update(
        gradient,
        ops.convert_to_tensor(variable),
        tuple(ops.convert_to_tensor(s) for s in slots),
        None if momentum is None else ops.convert_to_tensor(momentum),
        learning_rate=learning_rate,
        step=step,
        options=options,
        evaluation=evaluation,
    )
    if assign is None:
        assign, assign_sub = (lambda t, v: t.assign(v)), (lambda t, v: t.assign_sub(v))
    for slot, value in zip(slots, new_slots):
        assign(slot, value)
    adafactor_math.write_back(
        variable,
        delta,
        momentum,
        new_momentum,
        rounding=adafactor_math.rounding(options, step, variable_index, variable.shape),
        assign=assign,
        assign_sub=assign_sub,
        value=lambda: ops.convert_to_tensor(variable),
    )


def nothing():
    """The branch of a condition that does nothing."""
    return None


def step_numbers(numbers, structure) -> dict:
    """The keywords of `adafactor_step` from a compiled step's arguments `(learning_rate, step,
    variable_index, option_values)`, the options joined from their values (`adafactor_math.split_options`):
    one trace serves every value of the numbers."""
    learning_rate, step, variable_index, values = numbers
    return dict(
        learning_rate=learning_rate,
        step=step,
        options=adafactor_math.joined_options(structure, values),
        variable_index=variable_index,
    )


def adafactor_group_steps(grads, variables, states, **step_numbers):
    """Step the variables evaluated as groups; return the positions of the others (here: every variable,
    each stepped by itself, which XLA fuses)."""
    return range(len(variables))


def dense_row_update(update_rows, gradient, variable, slots):
    """Update every row (ordinary, non-lazy Adam)."""
    # TF's optimizer passes native tf.Variables; convert_to_tensor reads either kind.
    new_values = update_rows(gradient, *(ops.convert_to_tensor(t) for t in (variable, *slots)))
    for target, value in zip((variable, *slots), new_values):
        target.assign(value)


class LookupEvaluation(catch_up.Evaluation):
    """How a backend evaluates `trained_lookup`: its autograd hook, and its forms of the steps' gathers,
    groupings and writes (here the neutral forms, in `keras.ops`)."""

    def hook(self, forward, backward, ids, step, learning_rate, state, window, cache, name):
        """The looked-up rows, `forward`'s, and a float32 zero, with `backward` run in the lookup's backward
        pass on their gradients (the rows', then the zero's: the loss's scale; `cache`, `name`: the layer's);
        `backward` returns the new tables (None: written in place), the new window and the next value of
        `iterations`, its gradient. The `targets` the backward pass writes are the layer's variables where
        state is written in place (TF, torch; the default), their values where it is not (JAX)."""
        raise NotImplementedError

    def write_in_place(self, variable, value):
        """Write the step count or the catch-up window where state is written in place (TF, torch)."""
        variable.assign(value)

    def read_step(self, iterations):
        """The value of `iterations` the step reads."""
        return iterations.value

    def grouped(self, every):
        """`(group, distinct, slot)` of a catch-up's ids, as `catch_up.looked_up` takes them."""
        group = sparse_rows.id_ranks(every)
        return (group, *sparse_rows.distinct_ids(every, group))

    def table_rows(self, tables, ids):
        """The rows `ids` of each of `tables`, the catch-up's own (it updates them in place where tensors are
        mutable) until the backward pass has stepped them."""
        return [self.gather(t, ids) for t in tables]

    def compiled(self, name, function, options, cache):
        """`function`, or its compiled form where the backend compiles it."""
        return function

    def write_rows(self, targets, ids, new_rows):
        """Write `new_rows` into the `targets` at `ids`: the new tables where state is immutable, else None."""
        raise NotImplementedError

    def unless_nonfinite(self, finite, write, ids, targets, every_row, name):
        """A call of no arguments making `write(ids)`, the backward pass's writes into `targets` at `ids`
        (`every_row`: all of them), only where `finite` holds (`name`: the layer's, for errors), and
        returning what `write` returns: here in place, under a condition (eager torch reads `finite` on the
        host, as the optimizers' `skip_nonfinite_updates` does)."""
        return functools.partial(ops.cond, finite, functools.partial(write, ids), nothing)

    def sparse_step(self, targets, ids, values, update_rows, *, lazy, accumulate_duplicates, cache):
        """EmbeddingAdam's step of the `targets` (the table, its slots) with the sparse gradient `(ids,
        values)` (every row without `lazy`): the new tables where state is immutable, else None."""
        raise NotImplementedError


def trained_lookup(
    ids,
    state,
    iterations,
    learning_rate,
    options,
    *,
    lazy,
    accumulate_duplicates,
    window,
    cache,
    name,
    evaluation,
    skip_nonfinite=False,
    skip_with_model=False,
):
    """The rows of the table `state[0]` (then its slots) at `ids` and a zero for the caller to add to the loss,
    trained in the lookup's backward pass by `evaluation` (the backend's `LookupEvaluation`) with the row
    update's `learning_rate` and `options`: as EmbeddingAdam steps a sparse gradient, or, with a catch-up
    `window`, by `_math.catch_up`. The zero's gradient is the loss scale, which divides the rows' gradient;
    the gradient of `iterations` is its next value (NaN for a skipped step with `skip_with_model`)
    (docs/algorithms.md#tables-trained-in-the-lookup, #non-finite-steps-in-the-layers)."""
    ev = evaluation
    cache["model_skips"] = skip_with_model  # (torch's check of a second update in a step)
    step = ev.read_step(iterations)
    # The key of stochastic rounding (the table's index is 0), read only where it rounds.
    rounding_step = ops.cast(step, "int32") if options.stochastic_rounding else None

    def next_step(step, finite):
        if finite is None:
            return step + 1
        new_step = step + ops.cast(finite, step.dtype)
        if skip_with_model:
            # The model's optimizer skips too: a NaN gradient. Where it skips for a reason of its own, the
            # count written in place (TF, torch) keeps up with the table written in place.
            ev.write_in_place(iterations, new_step)
            return ops.where(finite, new_step, float("nan"))
        return new_step

    # `writes(...)`: `(write, written_ids, every_row, new_window)`, `write(written_ids)` the backward pass's
    # writes into `targets` (the new tables where state is immutable).
    if window is None:

        def forward(ids, step, learning_rate, tables, window):
            return ops.take(tables[0], sparse_rows.clipped(ids, tables[0].shape[0]), axis=0), None

        def writes(residuals, row_gradients, ids, step, learning_rate, targets, window):
            write = functools.partial(
                ev.sparse_step,
                targets,
                values=ops.reshape(row_gradients, (-1,) + tuple(targets[0].shape[1:])),
                update_rows=adam_math.RowUpdate(learning_rate, options, step=rounding_step),
                lazy=lazy,
                accumulate_duplicates=accumulate_duplicates,
                cache=cache,
            )
            return write, ops.reshape(ids, (-1,)), not lazy, None

    else:
        caught_up = functools.partial(catch_up.looked_up, options=options, evaluation=ev)

        def stepped(residuals, row_gradients, learning_rate, step, window):
            distinct, new_rows = catch_up.stepped_rows(
                residuals, row_gradients, learning_rate, step, options, ev
            )
            return new_rows, catch_up.advanced_window(window, learning_rate, step, options, ev)

        def forward(ids, step, learning_rate, tables, window):
            # A row looked up for an id past the table steps with a zero gradient: ordinary Adam's step.
            ids = sparse_rows.clipped(ids, tables[0].shape[0])
            every = catch_up.read_ids(ids, step, tables[0].shape[0], options)
            group, distinct, slot = ev.grouped(every)
            rows = ev.table_rows(tables, distinct)
            return ev.compiled("catch_up_lookup", caught_up, options, cache)(
                rows, ids, group, distinct, slot, step, window
            )

        def writes(residuals, row_gradients, ids, step, learning_rate, targets, window):
            new_rows, new_window = ev.compiled("catch_up_step", stepped, options, cache)(
                residuals, row_gradients, learning_rate, step, window
            )
            return (
                functools.partial(ev.write_rows, targets, new_rows=new_rows),
                residuals[0],
                False,
                new_window,
            )

    def backward(
        residuals, row_gradients, loss_scale, ids, step, learning_rate, window_value, targets=state
    ):
        loss_scale = ops.cast(loss_scale, "float32")
        loss_scale = ops.where(ops.equal(loss_scale, 0), ops.ones_like(loss_scale), loss_scale)
        row_gradients = ops.cast(row_gradients, "float32") / loss_scale
        write, written_ids, every_row, new_window = writes(
            residuals, row_gradients, ids, step, learning_rate, targets, window_value
        )
        finite = ops.all(ops.isfinite(row_gradients)) if skip_nonfinite else None
        if finite is None:
            write = functools.partial(write, written_ids)
        else:
            write = ev.unless_nonfinite(finite, write, written_ids, targets, every_row, name)
        new_tables = write()
        if finite is not None and window is not None:
            new_window = ops.where(finite, new_window, window_value)
        if window is not None:
            ev.write_in_place(window, new_window)
        return new_tables, new_window, next_step(step, finite)

    return ev.hook(forward, backward, ids, step, learning_rate, state, window, cache, name)
