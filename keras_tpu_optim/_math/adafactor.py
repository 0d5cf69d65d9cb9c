"""Adafactor's update rule as small pure functions of float32 arrays.

The neutral formulation: `keras.ops` only, no backend or platform checks. It
is what runs wherever no measured kernel exists, and the reference the
backend kernels are tested against. The formulas are those of
docs/algorithms.md#adafactor; names follow Shazeer & Stern (2018): `rho` the
relative step size, `alpha` the absolute step size, `R`/`C` the row/column
second-moment statistics.

A factored step is a few reductions over the gradient. `Reductions` holds
their neutral forms; a backend may pass a subclass whose forms were measured
faster on a platform (same values to float32 rounding).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from keras import ops

from keras_tpu_optim import _checks
from keras_tpu_optim._math import stochastic_rounding

FACTORED_DIMS = ("last_two", "two_largest")
MOMENTUM_DTYPES = ("float32", "bfloat16")


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
        _checks.check_number("beta_2_decay", self.beta_2_decay, high=0)
        _checks.check_number("epsilon_1", self.epsilon_1, low=0, low_open=True)
        _checks.check_number("epsilon_2", self.epsilon_2, low=0)
        _checks.check_number("clip_threshold", self.clip_threshold, low=0, low_open=True)
        _checks.check_bool("relative_step", self.relative_step)
        _checks.check_number("beta_1", self.beta_1, low=0, high=1, high_open=True, allow_none=True)
        object.__setattr__(
            self,
            "min_dim_size_to_factor",
            _checks.check_int("min_dim_size_to_factor", self.min_dim_size_to_factor, low=1, allow_none=True),
        )
        _checks.check_bool("multiply_by_parameter_scale", self.multiply_by_parameter_scale)
        _checks.check_choice("factored_dims", self.factored_dims, FACTORED_DIMS)
        object.__setattr__(self, "decay_offset", _checks.check_int("decay_offset", self.decay_offset, low=0))
        _checks.check_number("beta_2_cap", self.beta_2_cap, low=0, high=1, allow_none=True)
        _checks.check_choice("momentum_dtype", self.momentum_dtype, MOMENTUM_DTYPES)
        _checks.check_bool("stochastic_rounding", self.stochastic_rounding)
        seed = _checks.check_int("seed", self.seed, low=0)
        if seed >= stochastic_rounding.SEED_LIMIT:
            raise ValueError(f"Argument `seed` must be an int in [0, 2^31). Received: seed={self.seed!r}")
        object.__setattr__(self, "seed", seed)

    def factored_axes(self, shape) -> Optional[tuple[int, int]]:
        """`(a, b)`, the two axes a variable of this shape is factored over (`a < b` not implied), or None.

        The row statistics are means over axis `b` (shape: `shape` without
        `b`), the column statistics means over axis `a`. `"last_two"`:
        `(rank - 2, rank - 1)`. `"two_largest"`: as optax's
        `scale_by_factored_rms`, `b` the largest axis and `a` the second
        largest, ties broken towards the later axis (numpy's `argsort`, stable
        at these sizes). Factored only if the smaller of the two is at least
        `min_dim_size_to_factor`.
        """
        rank = len(shape)
        if rank < 2:
            return None
        if self.factored_dims == "two_largest":
            by_size = sorted(range(rank), key=lambda axis: shape[axis])
            a, b = by_size[-2], by_size[-1]
        else:
            a, b = rank - 2, rank - 1
        if self.min_dim_size_to_factor is not None and min(shape[a], shape[b]) < self.min_dim_size_to_factor:
            return None
        return a, b

    def is_factored(self, shape) -> bool:
        """Whether a variable of this shape keeps row/column statistics only."""
        return self.factored_axes(shape) is not None

    def to_config(self) -> dict:
        return dataclasses.asdict(self)


# The options a compiled step takes as arguments (`split_options`): numbers whose value does not
# shape the computation, so that one compilation serves all their values; each with the value
# that stands in for it in the options a compilation is keyed by.
ARGUMENT_OPTIONS = {
    "beta_2_decay": -0.8,
    "epsilon_1": 1e-30,
    "epsilon_2": 1e-3,
    "clip_threshold": 1.0,
    "beta_1": 0.5,
    "beta_2_cap": 1.0,
}


def split_options(options: AdafactorOptions) -> tuple[AdafactorOptions, dict]:
    """`(structure, values)`: the options with each set `ARGUMENT_OPTIONS` field replaced by its stand-in, and those values.

    `joined_options(structure, values)` gives options equal to `options` (with
    array values, inside a compiled function).
    """
    values = {name: getattr(options, name) for name in ARGUMENT_OPTIONS if getattr(options, name) is not None}
    return dataclasses.replace(options, **{name: ARGUMENT_OPTIONS[name] for name in values}), values


def joined_options(structure: AdafactorOptions, values: dict) -> AdafactorOptions:
    """`structure` with `values` (arrays: not checked again, as the numbers they hold were)."""
    options = copy.copy(structure)
    for name, value in values.items():
        object.__setattr__(options, name, value)
    return options


class Reductions:
    """The reductions of an Adafactor step, in plain `keras.ops`."""

    def mean_square(self, x):
        """`mean(x^2)` over all elements."""
        return ops.mean(ops.square(x))

    def row_mean_of_square(self, x):
        """`mean(x^2, axis=-1)`."""
        return ops.mean(ops.square(x), axis=-1)

    def column_mean_of_square(self, x):
        """`mean(x^2, axis=-2)`."""
        return ops.mean(ops.square(x), axis=-2)

    def row_mean_of_weighted_square(self, x, weights):
        """`mean(x^2 * weights[..., None, :], axis=-1)` for `x` `[..., n, m]`, `weights` `[..., m]`."""
        return ops.mean(ops.square(x) * ops.expand_dims(weights, -2), axis=-1)

    def separately(self, x):
        """`x` (an array or a tuple), computed apart from what follows: a fusion hint, the identity here."""
        return x


NEUTRAL = Reductions()


def relative_step_size(learning_rate, step, relative_step: bool):
    """`rho_t`: the learning rate, capped at `1/sqrt(t)` when `relative_step`."""
    if relative_step:
        return ops.minimum(learning_rate, ops.rsqrt(step))
    return learning_rate


def absolute_step_size(rho, param, epsilon_2, multiply_by_parameter_scale: bool, reductions=NEUTRAL):
    """`alpha_t`: `rho_t` scaled by the parameter's RMS (floored at epsilon_2)."""
    if multiply_by_parameter_scale:
        return ops.maximum(epsilon_2, ops.sqrt(reductions.mean_square(param))) * rho
    return rho


def second_moment_decay(step, beta_2_decay, decay_offset=0, beta_2_cap=None):
    """`beta2_t = min(1 - (t - decay_offset)^beta_2_decay, beta_2_cap)`.

    `t - decay_offset` is floored at 1: before the offset (where optax's
    schedule is not finite) the decay is that of the first step.
    """
    if decay_offset:
        step = ops.maximum(step - float(decay_offset), 1.0)
    beta2_t = 1.0 - ops.power(step, beta_2_decay)
    if beta_2_cap is not None:
        beta2_t = ops.minimum(beta2_t, beta_2_cap)
    return beta2_t


def factored_second_moment(grad, row, column, beta2_t, epsilon_1, reductions=NEUTRAL):
    """New row (`mean(G2, -1)`) and column (`mean(G2, -2)`) statistics, `G2 = g^2 + epsilon_1`."""
    row_mean = reductions.row_mean_of_square(grad) + epsilon_1
    column_mean = reductions.column_mean_of_square(reductions.separately(grad)) + epsilon_1
    row = beta2_t * row + (1.0 - beta2_t) * row_mean
    column = beta2_t * column + (1.0 - beta2_t) * column_mean
    return row, column


def factored_preconditioner(grad, row, column, reductions=NEUTRAL):
    """The factors of `1 / sqrt(V)`, `V = (R / mean(R)) outer C`, never materialising V.

    Returns `(row_factor, column_factor, update_mean_square)`: the update is
    `grad * row_factor[..., :, None] * column_factor[..., None, :]`, and
    `update_mean_square` is `mean(update^2)` computed from the factors,
    `mean_i(r_i^2 * mean_j(g_ij^2 c_j^2))`, so that the update need not be
    written to memory to be reduced.
    """
    row_factor = ops.rsqrt(row / ops.mean(row, axis=-1, keepdims=True))
    column_factor = ops.rsqrt(column)
    grad, row_factor, column_factor = reductions.separately((grad, row_factor, column_factor))
    row_mean_square = reductions.row_mean_of_weighted_square(grad, ops.square(column_factor))
    update_mean_square = ops.mean(ops.square(row_factor) * row_mean_square)
    return row_factor, column_factor, update_mean_square


class FactoredLayout:
    """Moves a factored variable's axes `(a, b)` to `(-2, -1)`, and its statistics to match.

    The row statistics (axis `b` reduced) keep the variable's other axes in
    their order, `a` among them; the math wants `a` last. Likewise the column
    statistics (axis `a` reduced) want `b` last. The identity for the last two
    axes.
    """

    def __init__(self, rank: int, axes=None):
        a, b = (rank - 2, rank - 1) if axes is None else axes
        self.identity = (a, b) == (rank - 2, rank - 1)
        self.a, self.b = a, b
        self.a_in_row = a - (b < a)
        self.b_in_column = b - (a < b)

    def tensor_to_last(self, x):
        return x if self.identity else ops.moveaxis(x, (self.a, self.b), (-2, -1))

    def tensor_from_last(self, x):
        return x if self.identity else ops.moveaxis(x, (-2, -1), (self.a, self.b))

    def statistics_to_last(self, row, column):
        if self.identity:
            return row, column
        return ops.moveaxis(row, self.a_in_row, -1), ops.moveaxis(column, self.b_in_column, -1)

    def statistics_from_last(self, row, column):
        if self.identity:
            return row, column
        return ops.moveaxis(row, -1, self.a_in_row), ops.moveaxis(column, -1, self.b_in_column)


def unfactored_second_moment(grad_sq, second_moment, beta2_t):
    return beta2_t * second_moment + (1.0 - beta2_t) * grad_sq


def clip_factor(update_mean_square, clip_threshold):
    """`1 / max(1, RMS(u) / d)`: the update clipping of the paper (section 6), given `mean(u^2)`."""
    return 1.0 / ops.maximum(1.0, ops.sqrt(update_mean_square) / clip_threshold)


def adafactor_update(
    grad,
    param,
    second_moment_slots,
    momentum,
    *,
    learning_rate,
    step,
    options: AdafactorOptions,
    reductions: Reductions = NEUTRAL,
    factored_axes=None,
):
    """One Adafactor step for one variable, all arrays float32.

    Args:
        grad: the gradient.
        param: the parameter value (read for its RMS only).
        second_moment_slots: `(row, column)` for a factored variable, `(v,)`
            otherwise.
        momentum: the first-moment slot, or None when `options.beta_1` is None.
        learning_rate, step: scalars; `step` is `iterations + 1`.
        options: the static options.
        reductions: the forms of the reductions (`NEUTRAL`, or a backend's).
        factored_axes: `options.factored_axes(variable.shape)` for a factored
            variable (None: the last two axes). Other axes than the last two
            are moved last around the computation (`move_factored_axes_last`);
            the statistics keep their own layout.

    Returns:
        `(delta, second_moment_slots, momentum)`: `param - delta` is the new
        parameter; the slots are the new statistics.
    """
    o = options
    rho = relative_step_size(learning_rate, step, o.relative_step)
    alpha = absolute_step_size(rho, param, o.epsilon_2, o.multiply_by_parameter_scale, reductions)
    beta2_t = second_moment_decay(step, o.beta_2_decay, o.decay_offset, o.beta_2_cap)
    if len(second_moment_slots) == 2:
        move = FactoredLayout(len(grad.shape), factored_axes)
        grad_last = move.tensor_to_last(grad)
        row, column = move.statistics_to_last(*second_moment_slots)
        row, column = factored_second_moment(grad_last, row, column, beta2_t, o.epsilon_1, reductions)
        row_factor, column_factor, update_mean_square = factored_preconditioner(grad_last, row, column, reductions)
        # The scalars ride on the row factor: two full-size products, not four.
        scale = alpha * clip_factor(update_mean_square, o.clip_threshold)
        delta = grad_last * ops.expand_dims(row_factor * scale, -1) * ops.expand_dims(column_factor, -2)
        delta = move.tensor_from_last(delta)
        second_moment_slots = move.statistics_from_last(row, column)
    else:
        (v,) = second_moment_slots
        v = unfactored_second_moment(ops.square(grad) + o.epsilon_1, v, beta2_t)
        second_moment_slots = (v,)
        update = grad * ops.rsqrt(v)
        delta = update * (alpha * clip_factor(reductions.mean_square(update), o.clip_threshold))
    if o.beta_1 is not None:
        # Momentum of the scaled update, as optax/t5x: no bias correction. A
        # bfloat16 slot is read into float32; the caller stores it rounded,
        # and the step uses the float32 value (as optax's `dtype_momentum`).
        momentum = o.beta_1 * ops.cast(momentum, "float32") + (1.0 - o.beta_1) * delta
        delta = momentum
    return delta, second_moment_slots, momentum
