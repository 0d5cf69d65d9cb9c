"""The torch backend (see `keras_tpu_optim._backend` for the interface)."""

from __future__ import annotations

import collections
import math
import weakref

import torch
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.torch import adafactor, rows
from keras_tpu_optim._math import adafactor as adafactor_math


cond = neutral.cond
eager_branches = neutral.eager_branches
apply_if = neutral.apply_if  # Eager: a Python branch.
state_creation_scope = neutral.state_creation_scope
unstacked = neutral.unstacked
dense_ids = neutral.dense_ids
checked_gradient = neutral.checked_gradient


def platform_of(variable) -> str:
    device_type = variable.value.device.type
    return "gpu" if device_type == "cuda" else device_type


def gradient_values(gradient):
    if gradient.is_sparse:
        return _private.torch_sparse_entries(gradient)[1]  # Duplicates do not matter here.
    return gradient


def unscale(gradient, scale):
    return gradient / scale


def densify(gradient):
    """A dense gradient; a sparse one's duplicates summed, its ids out of range dropped."""
    if not gradient.is_sparse or gradient.sparse_dim() != 1:
        return gradient.to_dense() if gradient.is_sparse else gradient
    indices, values = rows.in_table(*_private.torch_sparse_entries(gradient), gradient.shape[0])
    dense = values.new_zeros(tuple(gradient.shape))
    return dense.index_add_(0, indices, values)


def blocked_adafactor_applies(platform: str) -> bool:
    """Whether a variable on `platform` stepped alone is stepped in blocks (`adafactor.blocked_step`)."""
    return platform == "cpu"


def scratch_of(cache) -> rows.Scratch:
    """The scratch of an optimizer's (or `layers.Embedding`'s) row steps, kept in its `cache`."""
    if torch.compiler.is_compiling():
        # A fresh one, not the cache's: its buffers are the compiled graph's own temporaries, and the
        # graph reads no cache whose filling would make it recompile.
        return rows.Scratch()
    scratch = cache.get("scratch")
    if scratch is None:
        scratch = cache["scratch"] = rows.Scratch()
    return scratch


def adafactor_step(gradient, variable, state, *, platform, cache, **numbers):
    """`numbers`: the step's `learning_rate`, `step`, `options` and `variable_index`."""
    if _private.in_stateless_scope() or not blocked_adafactor_applies(platform):
        neutral.adafactor_step(
            densify(gradient),
            variable,
            state.slots,
            state.momentum,
            evaluation=adafactor_math.NEUTRAL,
            **numbers,
        )
        return
    adafactor.blocked_step(
        densify(gradient),
        variable.value,
        tuple(s.value for s in state.slots),
        None if state.momentum is None else state.momentum.value,
        learning_rate=ops.convert_to_tensor(numbers["learning_rate"]),
        step=ops.convert_to_tensor(numbers["step"]),
        options=numbers["options"],
        variable_index=numbers["variable_index"],
    )


# On CPU, the largest variable (elements) that the grouped step updates: below it, dispatching ops is
# most of a variable's step and the grouped step measured faster than the blocked step; above
# it the blocked step wins (the benchmark report's torch launch rows).
CPU_GROUPED_ELEMENTS = 1 << 15


def grouped_adafactor_applies(platform: str, size: int) -> bool:
    """Whether a variable of `size` elements on `platform` takes the grouped step (`adafactor.grouped_step`):
    a few dozen ops per group of one shape instead of about forty per variable, each op a kernel launch on a GPU."""
    return platform != "cpu" or size <= CPU_GROUPED_ELEMENTS


# The dtypes the grouped step takes (its reductions are float32, which torch refuses to narrow float64 to).
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adafactor_group_steps(
    grads, variables, states, *, indices, platforms, learning_rate, step, options, cache
):
    """Step the variables on a grouped platform by group (`adafactor.grouped_step`); return the positions of
    the others, each stepped by itself."""
    if _private.in_stateless_scope():
        return range(len(variables))
    alone, groups = _group_plan(cache, variables, states, indices, platforms, options)
    if groups:
        learning_rate, step = ops.convert_to_tensor(learning_rate), ops.convert_to_tensor(step)
    on_device = {}  # the step and its scalars on each device, computed once for all its groups
    for positions, group_indices, axes in groups:
        members = [
            adafactor.Member(
                variables[p].value,
                densify(grads[p]),
                tuple(s.value for s in states[p].slots),
                None if states[p].momentum is None else states[p].momentum.value,
            )
            for p in positions
        ]
        device = members[0].param.device
        if device not in on_device:
            device_step = step.to(device)
            on_device[device] = (
                device_step,
                adafactor_math.step_scalars(
                    learning_rate.to(device, torch.float32), device_step.to(torch.float32), options
                ),
            )
        device_step, scalars = on_device[device]
        adafactor.grouped_step(
            members,
            step=device_step,
            scalars=scalars,
            options=options,
            axes=axes,
            indices=group_indices,
        )
    return alone


def _group_plan(cache, variables, states, indices, platforms, options) -> tuple:
    """`(alone, groups)`: the positions in `variables` of those stepped one at a time (Keras's loop), and
    `(positions, indices, axes)` per chunk of a group: the chunk's positions, its variables' indices in the
    optimizer (an int32 tensor), its factored axes. Computed once per list of variables (kept in `cache`)."""
    key = tuple(indices)
    plans = {} if torch.compiler.is_compiling() else cache.setdefault("plans", {})
    if key in plans:  # traced once when compiling: no cache to guard on
        return plans[key]
    alone, groups = [], {}
    for position, (variable, state) in enumerate(zip(variables, states)):
        if variable.value.dtype not in _GROUPED_DTYPES or not grouped_adafactor_applies(
            platforms[position], math.prod(variable.shape)
        ):
            alone.append(position)
            continue
        axes = options.factored_axes(variable.shape) if len(state.slots) == 2 else None
        momentum = None if state.momentum is None else state.momentum.value
        groups.setdefault(
            adafactor.group_key(variable.value, state.slots, momentum, axes), []
        ).append(position)
    chunks = []
    for group, positions in groups.items():
        for chunk in adafactor.chunked(positions, math.prod(group[0])):
            group_indices = torch.tensor(
                [key[p] for p in chunk], dtype=torch.int32, device=group[2]
            )
            chunks.append((chunk, group_indices, group[3]))
    plans[key] = alone, chunks
    return alone, chunks


def embedding_adam_step(
    gradient, variable, slots, update_rows, *, lazy, accumulate_duplicates, max_touched_rows, cache
):
    if not lazy:
        neutral.dense_row_update(update_rows, densify(gradient), variable, slots)
        return
    rows.lazy_row_update(
        update_rows,
        gradient,
        variable,
        slots,
        accumulate_duplicates=accumulate_duplicates,
        scratch=scratch_of(cache),
    )


def accumulation_rows():
    return rows


class _Lookup(neutral.LookupEvaluation):
    """One call's evaluation. The backward pass writes the table, its slots and the window in place, and returns
    the next value of `iterations` as its gradient. The ids are grouped and their gradients summed by torch's
    own kernels (Keras's segment ops replicate the ids to the rows' shape and scatter through a reduction).
    The rows the forward pass gathers, their gradients' sums and the reads before the writes go to the
    layer's scratch buffers, as the lazy step's rows do: row-sized tensors allocated afresh each step make the
    process's heap grow and shrink again, a page fault for every page."""

    def __init__(self, cache):
        self._cache = cache
        self._scratch = scratch_of(cache)
        self._rows_scratch = None  # where the forward pass gathers its rows

    def hook(self, forward, backward, ids, step, learning_rate, state, window, cache, name):
        window_before = None if window is None else window.value
        # The forward pass's residuals, for the backward pass (a deque can be weakly referenced).
        saved = collections.deque()

        def read(ids, step):
            self._rows_scratch = self._lent_rows_scratch(saved)
            found, residuals = forward(
                ids, step, learning_rate, [t.value for t in state], window_before
            )
            saved.append(residuals)
            return found

        # The step count's tensor, whose in-place version tells a second update (`_check_one_update_per_step`);
        # not checked under `torch.compile`, where the step count here is the trace's.
        count = None if torch.compiler.is_compiling() else step
        stepping = (backward, saved, learning_rate, window_before, cache, name, count)
        return _TrainedLookup.apply(ids, step, state[0].value, stepping, read)

    def _lent_rows_scratch(self, saved):
        """The layer's scratch, lent to the forward pass whose residuals go to `saved` until its backward pass
        empties it or it is dropped; buffers of this call's own while an earlier pass's rows wait there, or
        under `torch.inference_mode` (whose tensors later steps could not write). (Compiled, the scratch is
        the call's own already.)"""
        if torch.compiler.is_compiling():
            return self._scratch
        holder = self._cache.get("rows_holder")
        if torch.is_inference_mode_enabled() or (holder is not None and holder()):
            return rows.Scratch()
        self._cache["rows_holder"] = weakref.ref(saved)
        return self._scratch

    def grouped(self, every):
        # int64 ids, which torch's gathers and scatters take (`long()` is then no copy).
        distinct, group = torch.unique(every.long(), return_inverse=True)
        return group, distinct, None

    def gather(self, table, ids, axis=0):
        return table.index_select(axis, ids.long())

    def constant(self, array):
        # Converted once for the layer (the plan keeps its arrays): Keras copies a numpy array it converts.
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return ops.convert_to_tensor(array)
        held = self._cache.setdefault("constants", {})
        if id(array) not in held:
            held[id(array)] = (array, ops.convert_to_tensor(array))
        return held[id(array)][1]

    def table_rows(self, tables, ids):
        ids = ids.long()
        return [
            rows.gathered_rows(t, ids, self._rows_scratch, rows.LOOKUP_SLOTS + i)
            for i, t in enumerate(tables)
        ]

    def segment_sum(self, data, segment_ids, num_segments):
        shape = (num_segments,) + tuple(data.shape[1:])
        sums = self._scratch.empty(shape, rows.SUMS_SLOT, data.dtype, data.device)
        return sums.zero_().index_add_(0, segment_ids, data)

    def write_rows(self, targets, ids, new_rows):
        ids = ids.long()
        for target, new in zip(targets, new_rows):
            table = target.value
            if table.dim() > 1 and table.device.type == "cpu":
                # Copying into rows that are not in the cache stalls on every store; read first, they
                # arrive in parallel (as in the lazy step, which writes the rows it has just gathered).
                rows.gathered_rows(table, ids, self._scratch, rows.READ_SLOT)
            table.index_copy_(0, ids, new.to(table.dtype))

    def sparse_step(self, targets, ids, values, update_rows, *, lazy, accumulate_duplicates, cache):
        if not lazy:
            # Ids past the table are removed where the gradient is read (`densify`).
            gradient = torch.sparse_coo_tensor(ids.long()[None], values, tuple(targets[0].shape))
            neutral.dense_row_update(update_rows, densify(gradient), targets[0], targets[1:])
            return
        rows.sparse_row_update(
            update_rows,
            ids.long(),
            values,
            [t.value for t in targets],
            accumulate_duplicates=accumulate_duplicates,
            scratch=self._scratch,
        )


def trained_lookup(*arguments, cache, **keywords):
    """`neutral.trained_lookup`, evaluated by a `_Lookup` of the layer's `cache`."""
    return neutral.trained_lookup(*arguments, cache=cache, evaluation=_Lookup(cache), **keywords)


class _TrainedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, step, table, stepping, read):
        ctx.stepping = stepping
        ctx.save_for_backward(ids, step)
        found = read(ids, step)
        return found, found.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, row_gradients, loss_scale):
        ids, step = ctx.saved_tensors
        backward, saved, learning_rate, window, cache, name, count = ctx.stepping
        if count is not None:
            _check_one_update_per_step(cache, name, count)
        with torch.no_grad():
            _, _, next_step = backward(
                saved.pop(), row_gradients, loss_scale, ids, step, learning_rate, window
            )
        if count is not None:
            cache["last_update"] = (id(count), count._version)
        return None, next_step, None, None, None


def _check_one_update_per_step(cache, name, iterations):
    """Raise if the table was updated at this value of `iterations` already: a second backward pass before
    the model's optimizer advanced `iterations` (in place: its tensor's version); not checked where the model's
    optimizer may skip steps (`cache["model_skips"]`)."""
    last = cache.pop("last_update", None)
    if last is None or last != (id(iterations), iterations._version) or cache.get("model_skips"):
        return
    raise ValueError(
        f"keras_tpu_optim.layers.Embedding '{name}' with `optimizer` is called twice in one training "
        "step (its table was updated at this step already); each call would update the table by itself. Look "
        "all ids up in one call (concatenate them), or use a layer without `optimizer`. (The same is raised "
        "when the model's optimizer did not advance the layer's `iterations` since the last update: it must "
        "receive the layer's trainable variables.)"
    )


def host_value(x):
    """`x`'s value as a Python int, but under `torch.compile` (None)."""
    return None if torch.compiler.is_compiling() else int(x)


def lookup_trace(iterations):
    """None: torch steps run eagerly."""
    return None
