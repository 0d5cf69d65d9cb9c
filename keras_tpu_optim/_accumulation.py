"""Keras's `gradient_accumulation_steps` step where ours must differ from Keras's: sparse rows accumulated
in place, and on eager JAX only the branch taken (docs/algorithms.md#gradient-accumulation)."""

from __future__ import annotations

from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import backend
from keras_tpu_optim._math import embedding_adam as adam_math


def apply_gradients(optimizer, grads, variables, keras_apply):
    """Keras's step (`keras_apply`), or ours where it must differ (module docstring)."""
    steps = optimizer.gradient_accumulation_steps
    rows = backend.accumulation_rows() if optimizer._accumulates_rows else None
    if steps and (rows is not None or backend.eager_branches(optimizer.iterations)):
        _accumulated_apply(optimizer, grads, variables, rows)
        return
    if not optimizer._accumulates_rows:
        keras_apply(grads, variables)
        return
    number = ops.cast(optimizer.iterations + 1, "int32")  # before `apply` counts this micro-step
    grads = [backend.densify(g) for g in grads]
    keras_apply(grads, variables)
    for gradient, variable in zip(grads, variables):
        window = optimizer._accumulation_window(variable)
        if window is not None:
            window.assign(adam_math.mark_touched(gradient, window.value, number))


def _accumulated_apply(optimizer, grads, variables, rows):
    """The accumulate-or-update step, sparse gradients' rows accumulated by `rows` (a backend's
    `accumulation_rows`, or None), which provides:

    `sparse_entries(gradient)` (`(ids, values)`, None if dense), `add_to_window(accumulator, window, ids,
    values, number, *, cache)`, `window_sizes(like, window, steps)` (static lengths to try for the list
    of a window's rows, smallest first; `(None,)`: dynamic), `window_count(window, number)` and
    `window_gradient(accumulator, window, number, steps, like, size, *, cache)` (the window's rows of
    `accumulator / steps` as a sparse gradient like `like`, then zeroed); `cache` keeps what they compile.
    """
    steps = optimizer.gradient_accumulation_steps
    is_update_step = ops.equal((_private.raw_iterations(optimizer) + 1) % steps, 0)
    number = ops.cast(optimizer.iterations + 1, "int32")  # the update this window ends in
    accumulators = _private.gradient_accumulators(optimizer)
    if rows is None:
        grads = [backend.densify(g) for g in grads]
    cache = optimizer._backend_cache
    entries = []  # (gradient, accumulator, window, the window's sizes; None: accumulated densely)
    for gradient, variable in zip(grads, variables):
        acc = accumulators[_private.variable_index(optimizer, variable)]
        window = optimizer._accumulation_window(variable)
        sparse = None if window is None or rows is None else rows.sparse_entries(gradient)
        sizes = None
        if sparse is not None:
            # A sparse gradient joins the window at every micro-step, the update step's included.
            rows.add_to_window(acc, window, *sparse, number, cache=cache)
            sizes = rows.window_sizes(gradient, window, steps)
        entries.append((gradient, acc, window, sizes))

    def update_with(choice):
        means = []
        for gradient, acc, window, sizes in entries:
            if sizes is not None:
                means.append(
                    rows.window_gradient(
                        acc, window, number, steps, gradient, sizes[choice], cache=cache
                    )
                )
            else:
                means.append((gradient + acc) / steps)  # Keras's mean
                acc.assign(ops.zeros(acc.shape, acc.dtype))
        means = _private.clip_gradients(optimizer, means)
        _private.apply_weight_decay(optimizer, variables)
        _private.backend_update_step(optimizer, means, variables, optimizer.learning_rate)
        # Keras resets every accumulator, also of variables without a gradient at this step.
        given = {id(acc) for _, acc, _, _ in entries}
        for acc in accumulators:
            if acc is not None and id(acc) not in given:
                acc.assign(ops.zeros(acc.shape, acc.dtype))

    def accumulate():
        for gradient, acc, window, sizes in entries:
            if sizes is None:
                acc.assign(gradient + acc)  # Keras's `g + acc`
                if window is not None:
                    window.assign(adam_math.mark_touched(gradient, window.value, number))

    bounded = [(w, sizes[0]) for _, _, w, sizes in entries if sizes is not None and len(sizes) > 1]
    if not bounded:
        backend.cond(is_update_step, lambda: update_with(0), accumulate)
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
    if optimizer.use_ema:
        # The end of Keras's step: the EMA, installed in the weights every `ema_overwrite_frequency` updates.
        _private.update_moving_averages(optimizer)
        if optimizer.ema_overwrite_frequency:
            due = ops.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
            backend.cond(
                due, lambda: _private.overwrite_with_moving_averages(optimizer), lambda: None
            )
