"""Adafactor's update, written once in `keras.ops` (docs/algorithms.md#adafactor): `preconditioned` reads
the whole variable, `elementwise_update` applies to any part of it; an `Evaluation` decides how each sum
is computed, never what (docs/algorithms.md#platform-specific-evaluation)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import keras
from keras import ops

from keras_tpu_optim import _checks
from keras_tpu_optim._math import options as options_math
from keras_tpu_optim._math import stochastic_rounding


@dataclasses.dataclass(frozen=True)
class AdafactorOptions:
    """Adafactor's static options, checked on creation; used by the class, its config and every kernel."""

    beta_2_decay: float = -0.8
    epsilon_1: float = 1e-30
    epsilon_2: float = 1e-3
    clip_threshold: float = 1.0
    relative_step: bool = True
    beta_1: Optional[float] = None
    min_dim_size_to_factor: Optional[int] = None
    multiply_by_parameter_scale: bool = True
    factored_dims: str = "last_two"
    decay_offset: int = 0
    beta_2_cap: Optional[float] = None
    momentum_dtype: str = "float32"
    stochastic_rounding: bool = False
    seed: int = 0

    def __post_init__(self):
        check, set_ = _checks.check_int, functools.partial(object.__setattr__, self)
        _checks.check_number("beta_2_decay", self.beta_2_decay, high=0)
        _checks.check_number("epsilon_1", self.epsilon_1, low=0, low_open=True)
        _checks.check_number("epsilon_2", self.epsilon_2, low=0)
        _checks.check_number("clip_threshold", self.clip_threshold, low=0, low_open=True)
        _checks.check_bool("relative_step", self.relative_step)
        _checks.check_number("beta_1", self.beta_1, low=0, high=1, high_open=True, allow_none=True)
        size = check("min_dim_size_to_factor", self.min_dim_size_to_factor, low=1, allow_none=True)
        set_("min_dim_size_to_factor", size)
        _checks.check_bool("multiply_by_parameter_scale", self.multiply_by_parameter_scale)
        _checks.check_choice("factored_dims", self.factored_dims, ("last_two", "two_largest"))
        set_("decay_offset", check("decay_offset", self.decay_offset, low=0))
        _checks.check_number("beta_2_cap", self.beta_2_cap, low=0, high=1, allow_none=True)
        _checks.check_choice("momentum_dtype", self.momentum_dtype, ("float32", "bfloat16"))
        _checks.check_bool("stochastic_rounding", self.stochastic_rounding)
        seed = check("seed", self.seed, low=0)
        if seed >= stochastic_rounding.SEED_LIMIT:
            raise ValueError(
                f"Argument `seed` must be an int in [0, 2^31). Received: seed={self.seed!r}"
            )
        set_("seed", seed)

    def factored_axes(self, shape) -> Optional[tuple[int, int]]:
        """`(a, b)`: row statistics are means over axis `b`, column statistics over `a`; None if unfactored
        (docs/algorithms.md#which-variables-are-factored)."""
        rank = len(shape)
        if rank < 2:
            return None
        if self.factored_dims == "two_largest":
            by_size = sorted(range(rank), key=lambda axis: shape[axis])
            a, b = by_size[-2], by_size[-1]
        else:
            a, b = rank - 2, rank - 1
        size = self.min_dim_size_to_factor
        return None if size is not None and min(shape[a], shape[b]) < size else (a, b)

    def to_config(self) -> dict:
        return dataclasses.asdict(self)


# The options a compiled step takes as arguments: numbers that do not shape the computation, so that
# one compilation serves all their values; each with the stand-in its compilation is keyed by.
ARGUMENT_OPTIONS = {
    "beta_2_decay": -0.8,
    "epsilon_1": 1e-30,
    "epsilon_2": 1e-3,
    "clip_threshold": 1.0,
    "beta_1": 0.5,
    "beta_2_cap": 1.0,
}
split_options = functools.partial(options_math.split_options, stand_ins=ARGUMENT_OPTIONS)
joined_options = options_math.joined_options


class Evaluation:
    """How the sums of a step are computed: the neutral form, whole arrays; `batch_dims` leading axes (0 or 1)
    index stacked variables, whose sums and scalars are then `[k]`."""

    batch_dims = 0

    def square_sums(self, x, axes):
        """`sum(x^2, axis)` for each axis of `axes` (an int, or None: the variable's every axis)."""
        square = ops.square(x)
        return tuple(self.sum(square, axis) for axis in axes)

    def square_means(self, x, axes):
        """`mean(x^2, axis)` for each int axis of `axes`."""
        sums = self.square_sums(x, axes)
        return tuple(total / _size(x, (axis,)) for total, axis in zip(sums, axes))

    def weighted_square_sum(self, x, weights, axis):
        return self.sum(ops.square(x) * weights, axis)

    def at_least(self, x, low):
        """`max(x, low)` for a constant `low`."""
        return ops.maximum(x, low)

    def at_most(self, x, high):
        """`min(x, high)` for a constant `high`."""
        return ops.minimum(x, high)

    def sum(self, x, axis):
        """Over the variable the last axis first: a reduction to a scalar runs on one thread on some
        compilers, one to rows does not."""
        if axis is not None:
            return ops.sum(x, axis=axis)
        axes = tuple(range(self.batch_dims, len(x.shape)))
        if len(axes) >= 2:
            x, axes = ops.sum(x, axis=-1), axes[:-1]
        return ops.sum(x, axis=axes) if axes else x

    def root_mean_square(self, x, numel):
        """`sqrt(sum(x^2) / numel)` over the variable."""
        (square_sum,) = self.square_sums(x, (None,))
        return ops.sqrt(square_sum / numel)

    def separately(self, x):
        """`x` (an array or a tuple) computed apart from what follows: a fusion hint, here the identity."""
        return x


NEUTRAL = Evaluation()


def clip_factor(update_square_sum, numel, clip_threshold, evaluation):
    """`1 / max(1, RMS(u) / d)`, the update clipping of the paper (section 6), of `u`'s `numel` elements:
    `min(1, d sqrt(numel) / sqrt(sum(u^2)))` (a sum of zero clips nothing)."""
    return evaluation.at_most(ops.rsqrt(update_square_sum) * (clip_threshold * numel**0.5), 1.0)


class Preconditioned(NamedTuple):
    """The new statistics, and the factors whose product with the gradient is the clipped, scaled update."""

    slots: tuple
    factors: tuple


def _size(x, axes):
    """Elements along `axes`: a float32 scalar where a dimension is unknown (TF under `tf.distribute`)."""
    shape, size = ops.shape(x), 1
    for axis in axes:
        size = size * shape[axis]
    return float(size) if isinstance(size, int) else ops.cast(size, "float32")


class StepScalars(NamedTuple):
    """A step's scalars, the same for every variable: the step size `rho`, `beta2_t` and `1 - beta2_t`."""

    rho: Any
    beta2: Any
    one_minus_beta2: Any


def step_scalars(learning_rate, step, options: AdafactorOptions) -> StepScalars:
    """The `StepScalars` of step `step` (`iterations + 1`), from float32 `learning_rate` and `step`."""
    o = options
    rho = ops.minimum(learning_rate, ops.rsqrt(step)) if o.relative_step else learning_rate
    # beta2_t = min(1 - t^beta_2_decay, beta_2_cap), t floored at 1 before `decay_offset` (where
    # optax's schedule is not finite).
    t = ops.maximum(step - float(o.decay_offset), 1.0) if o.decay_offset else step
    decay = t**o.beta_2_decay
    if o.beta_2_cap is None:
        return StepScalars(rho, 1.0 - decay, decay)
    beta2_t = ops.minimum(1.0 - decay, o.beta_2_cap)
    return StepScalars(rho, beta2_t, 1.0 - beta2_t)


def _per_variable(scalar, ndim: int, batch_dims: int):
    """A per-variable scalar (`[k]` stacked) shaped to broadcast against arrays of `ndim` axes."""
    return ops.reshape(scalar, (-1,) + (1,) * (ndim - 1)) if batch_dims else scalar


def preconditioned(
    grad,
    param,
    slots,
    *,
    learning_rate=None,
    step=None,
    options: AdafactorOptions,
    factored_axes=None,
    evaluation=NEUTRAL,
    scalars=None,
) -> Preconditioned:
    """The first phase of a step on float32 `grad` and `param`: `slots` `(row, column)` factored over
    `factored_axes` (None: the last two) or `(v,)`; `step` is `iterations + 1`, `scalars` its `step_scalars`."""
    o, ev = options, evaluation
    batch = ev.batch_dims
    ndim = len(grad.shape)
    numel = _size(grad, range(batch, ndim))
    rho, beta2_t, one_minus_beta2_t = scalars or step_scalars(learning_rate, step, o)
    alpha = rho
    if o.multiply_by_parameter_scale:
        alpha = ev.at_least(ev.root_mean_square(param, numel), o.epsilon_2) * rho
    if len(slots) == 1:
        (v,) = slots
        square = ops.square(grad)
        v = beta2_t * v + one_minus_beta2_t * (square + o.epsilon_1)
        # sum(u^2) = sum(g^2 / v): the update is not formed to be reduced.
        scale = alpha * clip_factor(ev.sum(square / v, None), numel, o.clip_threshold, ev)
        return Preconditioned((v,), (ops.rsqrt(v), _per_variable(scale, ndim, batch)))
    a, b = (
        (ndim - 2, ndim - 1) if factored_axes is None else (axis + batch for axis in factored_axes)
    )
    row, column = slots
    row_mean, column_mean = ev.square_means(grad, (b, a))
    row = beta2_t * row + one_minus_beta2_t * (row_mean + o.epsilon_1)
    column = beta2_t * column + one_minus_beta2_t * (column_mean + o.epsilon_1)
    # 1 / sqrt(V) for V = (R / mean(R)) outer C, never materialised: r = 1 / sqrt(R / mean(R)).
    normalized_row = row / ops.mean(row, axis=a - (b < a), keepdims=True)
    row_factor = ops.rsqrt(normalized_row)
    column_factor = ops.expand_dims(ops.rsqrt(column), a)
    grad, row_factor, column_factor = ev.separately((grad, row_factor, column_factor))
    # sum(u^2) = sum(r^2 * sum_b(g^2 c^2)): the update is not formed to be reduced.
    weighted = ev.weighted_square_sum(grad, ops.square(column_factor), b)
    update_square_sum = ev.sum(weighted / normalized_row, None)
    scale = alpha * clip_factor(update_square_sum, numel, o.clip_threshold, ev)
    # The scalars ride on the row factor: two full-size products, not three.
    row_factor = ops.expand_dims(row_factor * _per_variable(scale, ndim - 1, batch), b)
    return Preconditioned((row, column), (row_factor, column_factor))


def elementwise_update(grad, factors, momentum, options: AdafactorOptions):
    """The second phase, elementwise: `(delta, new_momentum)` of any part of a variable from the same part of
    its float32 gradient, factors and momentum (None without `beta_1`)."""
    delta = grad
    for factor in factors:
        delta = delta * factor
    if options.beta_1 is not None:
        # Momentum of the scaled update, as optax/t5x: no bias correction. A bfloat16 slot is read into
        # float32; the caller stores it rounded, and the step uses the float32 value (optax's `dtype_momentum`).
        momentum = options.beta_1 * ops.cast(momentum, "float32") + (1.0 - options.beta_1) * delta
        delta = momentum
    return delta, momentum


def adafactor_update(grad, param, slots, momentum, *, options, **preconditioned_arguments):
    """One whole step: `(delta, new_slots, new_momentum)`; `param - delta` is the new parameter."""
    result = preconditioned(grad, param, slots, options=options, **preconditioned_arguments)
    delta, momentum = elementwise_update(grad, result.factors, momentum, options)
    return delta, result.slots, momentum


def float32_update(
    grad, param, slots, momentum, *, learning_rate, step, options, evaluation=NEUTRAL
):
    """`adafactor_update` of a variable of any dtype: read in float32, factored as its shape says."""
    return adafactor_update(
        ops.cast(grad, "float32"),
        ops.cast(param, "float32"),
        tuple(slots),
        momentum,
        learning_rate=ops.cast(learning_rate, "float32"),
        step=ops.cast(step, "float32"),
        options=options,
        factored_axes=options.factored_axes(param.shape),
        evaluation=evaluation,
    )


def rounding(options: AdafactorOptions, step, variable_index, shape, first_row=0):
    """How a float32 result is cast to a variable's dtype: `ops.cast`, or stochastic rounding keyed by the
    seed, `step` and the variable's index (`shape`, `first_row`: as `stochastic_round`'s)."""
    if not options.stochastic_rounding:
        return ops.cast
    return functools.partial(
        stochastic_rounding.stochastic_round,
        seed=options.seed,
        step=step,
        variable_index=variable_index,
        shape=None if shape is None else tuple(shape),
        first_row=first_row,
    )


def write_back(
    variable, delta, momentum, new_momentum, *, rounding, assign, assign_sub=None, value=None
):
    """Store a step's results: the momentum in its slot's dtype; a float32 variable minus `delta` (by `assign_sub`
    where given), any other rounded once by `rounding`; a group's are lists of one dtype each."""
    if momentum is not None:
        assign(momentum, ops.cast(new_momentum, _dtype(momentum)))
    if assign_sub is not None and keras.backend.standardize_dtype(_dtype(variable)) == "float32":
        assign_sub(variable, delta)
    else:
        assign(variable, subtracted(variable if value is None else value(), delta, rounding))


def _dtype(x):
    return x[0].dtype if isinstance(x, list) else x.dtype


def subtracted(value, delta, round_to=ops.cast):
    """`value - delta` in `value`'s dtype: in float32, rounded once by `round_to(x, dtype)` for other dtypes."""
    if keras.backend.standardize_dtype(value.dtype) == "float32":
        return value - delta
    return round_to(ops.cast(value, "float32") - delta, value.dtype)
