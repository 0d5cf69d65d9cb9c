"""EmbeddingAdam's per-row update as one pure function (docs/algorithms.md#embeddingadam): `row_update`,
which the optimizer calls on a table's rows and the TPU export hands to JAX SparseCore."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from keras_tpu_optim._math import options as options_math
from keras_tpu_optim._math import stochastic_rounding


@dataclasses.dataclass(frozen=True)
class RowUpdateOptions:
    """The static (trace-time) options of the row update."""

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    sum_inside_sqrt: bool = True
    gradient_clip_min: Optional[float] = None
    gradient_clip_max: Optional[float] = None
    clip_weight_min: Optional[float] = None
    clip_weight_max: Optional[float] = None
    weight_decay_factor: Optional[float] = None
    multiply_weight_decay_factor_by_learning_rate: bool = False
    # "full": v has the table's shape; "rowwise": one v per row, of the mean of g^2 over the row.
    second_moment: str = "full"
    # "global": `learning_rate` is lr_t (t = iterations + 1); "per_row": it is the
    # uncorrected lr, and each row is corrected with its own count of updates.
    bias_correction: str = "global"
    # Lazy EMA of the table (Keras's `use_ema` on a lazily updated table): Keras's
    # `ema_momentum`, and how many of its first EMA updates copy the weights
    # (momentum 0: 1, or `gradient_accumulation_steps`). None: no lazy EMA.
    ema_momentum: Optional[float] = None
    ema_copy_updates: int = 1
    # Ordinary (non-lazy) Adam by catching rows up (`_math.catch_up`): its window, or 0.
    catch_up_window: int = 0
    # How a bfloat16/float16 table or slot stores its float32 result: rounded to nearest, or
    # stochastically (`_math.stochastic_rounding`) from `seed`.
    stochastic_rounding: bool = False
    seed: int = 0


# The options a compiled row update takes as arguments (`options_math`). The betas stay static: the
# per-row bias correction takes their logarithms in float64.
ARGUMENT_OPTIONS = dict.fromkeys(
    "epsilon gradient_clip_min gradient_clip_max clip_weight_min clip_weight_max weight_decay_factor "
    "ema_momentum".split(),
    0.0,
)
split_options = functools.partial(options_math.split_options, stand_ins=ARGUMENT_OPTIONS)
joined_options = options_math.joined_options


def bias_corrected_learning_rate(learning_rate, step, beta_1: float, beta_2: float):
    """`lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`, t = iterations + 1 (also the TPU export's rate), with
    `1 - beta^t` as `-expm1(t * log(beta))`, `log(beta)` in float64."""
    return learning_rate * ops.sqrt(_one_minus_power(beta_2, step)) / _one_minus_power(beta_1, step)


def _one_minus_power(beta: float, step):
    if beta == 0.0:
        return ops.ones_like(step)
    return -ops.expm1(step * math.log(beta))


def clip_between(x, low: Optional[float], high: Optional[float]):
    if low is not None:
        x = ops.maximum(x, low)
    if high is not None:
        x = ops.minimum(x, high)
    return x


def per_row(x, like):
    """A `(rows,)` array shaped to broadcast against `like` (`(rows, *row_shape)`)."""
    return ops.reshape(x, (-1,) + (1,) * (len(like.shape) - 1))


def weight_decay(learning_rate, options: RowUpdateOptions):
    """The fraction of a weight one step decays (None: no decay): `weight_decay_factor`, times the step's
    `learning_rate` with `multiply_weight_decay_factor_by_learning_rate`."""
    decay = options.weight_decay_factor
    if decay is not None and options.multiply_weight_decay_factor_by_learning_rate:
        decay = decay * learning_rate
    return decay


def denominator(velocities, options: RowUpdateOptions):
    """Adam's denominator: `sqrt(v + eps^2)` with `sum_inside_sqrt` (the TPU engine's), else `sqrt(v) + eps`."""
    if options.sum_inside_sqrt:
        return ops.sqrt(velocities + options.epsilon**2)
    return ops.sqrt(velocities) + options.epsilon


def row_update(
    grad, weight, momenta, velocities, learning_rate, options: RowUpdateOptions, row_steps=None
):
    """Adam on float32 rows `[rows, *row_shape]` with TPU-embedding semantics: the updated `(weight, momenta,
    velocities)`, then `row_steps` with `bias_correction="per_row"` (docs/algorithms.md#row-update)."""
    o = options
    counted = o.bias_correction == "per_row"
    if counted:
        if row_steps is None:
            raise ValueError('`bias_correction="per_row"` needs the rows\' `row_steps`.')
        row_steps = row_steps + ops.ones_like(row_steps)
        count = ops.cast(row_steps, "float32")
        learning_rate = per_row(
            bias_corrected_learning_rate(learning_rate, count, o.beta_1, o.beta_2), weight
        )
    grad = clip_between(grad, o.gradient_clip_min, o.gradient_clip_max)
    decay = weight_decay(learning_rate, o)
    if decay is not None:
        weight = weight - decay * weight
    momenta = o.beta_1 * momenta + (1.0 - o.beta_1) * grad
    square = ops.square(grad)
    if o.second_moment == "rowwise" and len(grad.shape) > 1:
        square = ops.mean(square, axis=tuple(range(1, len(grad.shape))))
    velocities = o.beta_2 * velocities + (1.0 - o.beta_2) * square
    divisor = denominator(velocities, o)
    if len(divisor.shape) < len(weight.shape):
        divisor = per_row(divisor, weight)
    weight = weight - learning_rate * momenta / divisor
    weight = clip_between(weight, o.clip_weight_min, o.clip_weight_max)
    if counted:
        return weight, momenta, velocities, row_steps
    return weight, momenta, velocities


def ema_catch_up(weight, average, average_steps, count, options: RowUpdateOptions):
    """The EMA after `count` Keras EMA updates of rows whose weights are constant since their average
    reflected `average_steps` (`[rows]`) updates: `w + momentum^(count - average_steps) * (average - w)`, or
    `w` after a copy (docs/algorithms.md#lazy-ema); rows already at `count` keep their average bit for bit."""
    steps = ops.cast(average_steps, "int32")
    count = ops.cast(count, "int32")
    behind = ops.cast(ops.maximum(count - steps, 0), "float32")
    factor = ops.power(ops.cast(options.ema_momentum, "float32"), behind)
    up_to_date = per_row(steps >= count, weight)
    copied = per_row(steps < options.ema_copy_updates, weight)
    caught_up = weight + per_row(factor, weight) * (average - weight)
    return ops.where(up_to_date, average, ops.where(copied, weight, caught_up))


def ema_rows(old_weight, new_weight, average, average_steps, ema_step, options: RowUpdateOptions):
    """`(average, average_steps)` after Keras's EMA update `ema_step` (0-based) of rows whose weights this
    step changed: caught up with their old weights, then updated as Keras does."""
    ema_step = ops.cast(ema_step, "int32")
    before = ema_catch_up(old_weight, average, average_steps, ema_step, options)
    momentum = ops.where(ema_step < options.ema_copy_updates, 0.0, options.ema_momentum)
    momentum = ops.cast(momentum, "float32")
    average = momentum * before + (1.0 - momentum) * new_weight
    # A row's average reflects at most `ema_step` updates before this one, so this is
    # `ema_step + 1`. Written from the gathered counts, not as a broadcast: a scatter whose values
    # do not depend on the gather from the same slot makes XLA copy the whole `(rows,)` slot to
    # keep the gather's input (on TF, two copies of it a step).
    return average, ops.cast(
        ops.maximum(ops.cast(average_steps, "int32"), ema_step + 1), average_steps.dtype
    )


def touched_row_mask(gradient):
    """`(rows,)` booleans: the rows of a dense gradient with any non-zero (or NaN) entry, as `sum(|g|) != 0`
    (no underflow, carries NaN on every compiler), the rule of every backend."""
    if len(gradient.shape) == 1:
        return ops.not_equal(gradient, ops.zeros((), gradient.dtype))
    magnitudes = ops.sum(ops.abs(ops.reshape(gradient, (gradient.shape[0], -1))), axis=1)
    return ops.not_equal(magnitudes, ops.zeros((), magnitudes.dtype))


def mark_touched(gradient, window, number):
    """An `accumulation_window` slot after a dense gradient: its touched rows get the window's `number`."""
    return ops.where(touched_row_mask(gradient), ops.cast(number, window.dtype), window)


def stored(new_values, dtypes, *, ids, step, variable_index, options: RowUpdateOptions) -> tuple:
    """The float32 rows `new_values` in their variables' `dtypes`: rounded to nearest, or stochastically keyed
    by the seed, `step`, `3 * variable_index + stream` and each element's index (docs/algorithms.md)."""
    out = list(new_values)
    groups = {}
    for stream, (new, dtype) in enumerate(zip(new_values, dtypes)):
        if (
            options.stochastic_rounding
            and stream < 3
            and standardize_dtype(dtype) in ("bfloat16", "float16")
        ):
            groups.setdefault((standardize_dtype(dtype), tuple(new.shape)), []).append(stream)
        else:
            out[stream] = ops.cast(new, dtype)
    for (dtype, shape), streams in groups.items():
        stacked = len(streams) > 1
        rounded = stochastic_rounding.stochastic_round(
            ops.stack([new_values[s] for s in streams]) if stacked else new_values[streams[0]],
            dtype,
            seed=options.seed,
            step=step,
            # One key per stacked value, broadcast against the elements' indices.
            variable_index=(
                3 * ops.cast(variable_index, "int32")
                + ops.convert_to_tensor(np.reshape(streams, (-1,) + (1,) * len(shape)), "int32")
                if stacked
                else 3 * variable_index + streams[0]
            ),
            shape=shape,
            rows=ids,
        )
        for i, stream in enumerate(streams):
            out[stream] = rounded[i] if stacked else rounded
    return tuple(out)


def update_rows_in_float32(
    grad,
    weight,
    momenta,
    velocities,
    *extra_slots,
    learning_rate,
    options,
    ema_step=None,
    step=None,
    variable_index=0,
    ids=None,
):
    """`row_update` on rows of any dtype, in float32, and the lazy EMA's (`ema_step`): the slots after the
    velocities are `row_steps` (per-row bias correction), then `average_steps` and the average (lazy EMA).
    The table and its moments are stored as `stored` says (`step`, `variable_index`, `ids`: its key)."""
    adam_extra = extra_slots[: int(options.bias_correction == "per_row")]
    rows = (ops.cast(x, "float32") for x in (grad, weight, momenta, velocities))
    new_values = row_update(*rows, learning_rate, options, *adam_extra)
    old = (weight, momenta, velocities, *adam_extra)
    new_values = stored(
        new_values,
        [before.dtype for before in old],
        ids=ids,
        step=step,
        variable_index=variable_index,
        options=options,
    )
    if options.ema_momentum is None:
        return new_values
    average_steps, average = extra_slots[len(adam_extra) :]
    # The stored new weights, as Keras's EMA reads them.
    rows = (ops.cast(x, "float32") for x in (weight, new_values[0], average))
    new_average, new_steps = ema_rows(*rows, average_steps, ema_step, options)
    return new_values + (new_steps, ops.cast(new_average, average.dtype))


# Compared and hashed by identity: torch.compile hashes it while its fields are being set.
@dataclasses.dataclass(frozen=True, eq=False)
class RowUpdate:
    """`update_rows_in_float32` with these arguments, which a backend compiling the update reads instead."""

    learning_rate: Any
    options: RowUpdateOptions
    ema_step: Any = None
    # The key of stochastic rounding (`stored`): the optimizer's step and the table's index.
    step: Any = None
    variable_index: Any = 0

    def __call__(self, grad, weight, *slots, ids=None):
        """The new rows `ids` (None: every row, in order) of the table and its slots."""
        return update_rows_in_float32(grad, weight, *slots, **vars(self), ids=ids)

    def split(self) -> tuple:
        """`(structure, arguments)`: the options' structure (`split_options`) and this update's numbers as
        tensors, the arguments of a compiled update, which `joined` puts back together."""
        structure, values = split_options(self.options)
        numbers = {name: ops.convert_to_tensor(value, "float32") for name, value in values.items()}
        ema_step = None if self.ema_step is None else ops.convert_to_tensor(self.ema_step)
        key = tuple(
            ops.cast(0 if x is None else x, "int32") for x in (self.step, self.variable_index)
        )
        return structure, (ops.convert_to_tensor(self.learning_rate), ema_step, numbers, key)

    @classmethod
    def joined(cls, structure, arguments) -> RowUpdate:
        learning_rate, ema_step, numbers, key = arguments
        return cls(learning_rate, joined_options(structure, numbers), ema_step, *key)
