"""Ordinary (non-lazy) Adam at the cost of the rows looked up: a row's skipped steps applied in closed form
when it is next read (docs/algorithms.md#ordinary-adam-at-the-cost-of-the-rows-looked-up)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from keras import ops


# `embedding_adam` imports this module (read at call time).
from keras_tpu_optim._math import embedding_adam as adam_math

# Largest number of series terms tried, and the error allowed to the truncated series, relative to the sum.
_MAX_TERMS = 10
_SERIES_TOLERANCE = 2.0**-26


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of the catch-up: the window, the number of series terms, and float32 constants
    `increments[1 + n, d]` (the `n`-th term's factor of a step `d` steps on) and `powers[i, d] = beta_i^d`."""

    window: int
    terms: int
    increments: np.ndarray
    powers: np.ndarray


@functools.lru_cache(maxsize=None)
def series(beta_1: float, beta_2: float, sum_inside_sqrt: bool):
    """`(terms, coefficients, base, ratio)`: the fewest series terms that reach float32 accuracy for every
    `v`, or None when no number up to `_MAX_TERMS` does (then every row is stepped every step)."""
    if beta_2 == 0.0:
        return None
    ratio = beta_1 / math.sqrt(beta_2)
    base = 1.0 / beta_2 if sum_inside_sqrt else 1.0 / math.sqrt(beta_2)
    power = -0.5 if sum_inside_sqrt else -1.0
    coefficients = [1.0]
    for n in range(1, _MAX_TERMS):
        coefficients.append(coefficients[-1] * (power - n + 1) / n)
    if ratio == 0.0:
        return 1, tuple(coefficients[:1]), base, ratio
    if ratio >= 1.0:
        return None
    j = np.arange(1, int(120 / -math.log(ratio)) + 2, dtype=np.float64)
    weights = ratio**j
    u = np.linspace(0.0, 1.0, 129)[:, None] * np.expm1(j * math.log(base))
    exact = np.sum(weights * (1.0 + u) ** power, axis=1)
    partial = np.zeros_like(u)
    for n, c in enumerate(coefficients):
        with np.errstate(over="ignore", invalid="ignore"):
            partial = partial + c * u**n
            error = np.sum(
                weights * np.abs(np.nan_to_num(partial - (1.0 + u) ** power, nan=np.inf)), axis=1
            )
        if np.all(error <= _SERIES_TOLERANCE * exact):
            return n + 1, tuple(coefficients[: n + 1]), base, ratio
    return None


def window_size(rows: int, row_size: int, terms: int) -> int:
    """The window: a power of two balancing its per-step shift (`(terms + 1) * window` numbers) against the
    rows swept per step (`rows / window`, three numbers per entry)."""
    balance = math.sqrt(3.0 * rows * row_size / (terms + 1))
    return int(min(1 << 16, max(64, 1 << max(0, math.ceil(math.log2(max(balance, 1.0)))))))


@functools.lru_cache(maxsize=None)
def plan(beta_1: float, beta_2: float, sum_inside_sqrt: bool, window: int) -> Plan:
    found = series(beta_1, beta_2, sum_inside_sqrt)
    terms, coefficients, base, ratio = found
    d = np.arange(window + 1, dtype=np.float64)
    increments = np.zeros((terms + 1, window + 1), np.float64)
    if ratio > 0.0:
        log_ratio = d[1:] * math.log(ratio)
        grown = np.expm1(np.minimum(d[1:] * math.log(base), 700.0))
        for n, c in enumerate(coefficients):
            with np.errstate(divide="ignore", over="ignore"):
                term = np.exp(np.maximum(log_ratio + n * np.log(grown), -800.0))
            increments[1 + n, 1:] = c * np.where(log_ratio < -110.0, 0.0, term)
    with np.errstate(divide="ignore"):
        powers = np.stack([np.power(beta, d) for beta in (beta_1, beta_2)])
    return Plan(window, terms, increments.astype(np.float32), powers.astype(np.float32))


class Evaluation:
    """How the catch-up's gathers, its plan's constants and the sums of duplicate ids' gradients are evaluated:
    in `keras.ops` here; a backend's lookup evaluation (`_backend.neutral.LookupEvaluation`) in its own way."""

    gather = staticmethod(ops.take)  # `(x, indices, axis=0)`
    constant = staticmethod(ops.convert_to_tensor)  # a numpy array of the plan
    segment_sum = staticmethod(ops.segment_sum)


NEUTRAL = Evaluation()


def options_plan(options) -> Plan:
    return plan(options.beta_1, options.beta_2, options.sum_inside_sqrt, options.catch_up_window)


def advanced_window(window, learning_rate, step, options, evaluation=NEUTRAL):
    """The window after step `step + 1`: shifted, its decay kept as a sum of logarithms and subtracted from the
    sums, plus the step's terms (docs/algorithms.md#ordinary-adam-at-the-cost-of-the-rows-looked-up)."""
    plan_ = options_plan(options)
    # Step `step + 1`'s bias-corrected rate (`learning_rate` is uncorrected with per-row correction).
    rate = ops.cast(learning_rate, "float32")
    if options.bias_correction == "per_row":
        rate = adam_math.bias_corrected_learning_rate(
            rate, ops.cast(step, "float32") + 1.0, options.beta_1, options.beta_2
        )
    decay = adam_math.weight_decay(rate, options)
    kept = window[:, :-1]
    if decay is not None:
        logs, sums = kept[:1], kept[1:]
        kept = ops.concatenate([logs + ops.log1p(-decay), sums - decay * sums])
    shifted = ops.concatenate([ops.zeros((plan_.terms + 1, 1)), kept], axis=1)
    shifted += rate * evaluation.constant(plan_.increments)
    return shifted


def caught_up(weight, momenta, velocities, row_steps, step, window, options, evaluation=NEUTRAL):
    """Float32 rows `(weight, momenta, velocities)` brought from their `row_steps` to `step` (at most the
    window behind) by Adam's steps with a zero gradient; weight clipping is applied once, at the end. A
    current row (`E = 1`, `C = 0`) keeps its bits.

    The rows are updated in place where tensors are mutable (torch), as are the products made here, sparing
    the step a row-sized allocation each: callers pass rows of their own (gathered, or copied)."""
    plan_ = options_plan(options)
    behind = ops.cast(ops.cast(step, "float32") - ops.cast(row_steps, "float32"), "int32")
    behind = ops.clip(behind, 0, plan_.window)
    # Each row's `log E` and `C_n`, then `beta_i^d`: `picked[k]` and `decays[i]` broadcast against the rows.
    rows_axes = (...,) + (None,) * (len(weight.shape) - 1)
    picked = evaluation.gather(window, behind, axis=1)[rows_axes]
    decays = evaluation.gather(evaluation.constant(plan_.powers), behind, axis=1)[rows_axes]
    # The step is `m / denominator` times the series in `z`: `eps / (sqrt(v) + eps)`, or
    # `eps^2 / (v + eps^2)` inside the square root.
    divisor = adam_math.denominator(velocities, options)
    z = ops.divide(options.epsilon, divisor)
    if options.sum_inside_sqrt:
        z *= z
    rowwise = len(velocities.shape) < len(weight.shape)  # one `v` a row
    if rowwise:
        z, divisor = adam_math.per_row(z, weight), adam_math.per_row(divisor, weight)
    moved = picked[plan_.terms]
    if plan_.terms > 1:  # Horner's rule
        moved = z * moved
        moved += picked[plan_.terms - 1]
        for n in range(plan_.terms - 3, -1, -1):
            moved *= z
            moved += picked[1 + n]
    if options.weight_decay_factor is not None:  # else `E = 1`
        weight *= ops.exp(picked[0])
    if plan_.terms > 1 and not rowwise:
        moved *= momenta  # the series' own product, of the rows' shape
    else:
        moved = momenta * moved
    moved /= divisor
    weight -= moved
    weight = adam_math.clip_between(weight, options.clip_weight_min, options.clip_weight_max)
    decay_2 = adam_math.per_row(decays[1], velocities) if rowwise else decays[1]
    momenta *= decays[0]
    velocities *= decay_2
    return weight, momenta, velocities


def swept_rows(step, rows: int, options):
    """The rows this step sweeps: a contiguous run (the last one wrapping to the first rows), so that each of
    `rows` is swept every `window` steps."""
    chunk = -(-rows // options.catch_up_window)
    turns = -(-rows // chunk)
    start = ops.cast(step, "int32") % turns * chunk
    return (start + ops.arange(chunk, dtype="int32")) % rows


def read_rows(tables, ids, step, window, options):
    """The weights at `ids` as ordinary Adam has them at `step`: `tables` is `(weight, momenta, velocities,
    row_steps)`, the rows gathered (as `ops.take`) and caught up."""
    weight, momenta, velocities, row_steps = (ops.take(t, ids, axis=0) for t in tables[:4])
    shape = weight.shape

    def flat(x):
        return ops.reshape(x, (-1,) + tuple(x.shape[len(ids.shape) :]))

    rows = (ops.cast(flat(x), "float32") for x in (weight, momenta, velocities))
    result = caught_up(*rows, flat(row_steps), step, window, options)[0]
    return ops.cast(ops.reshape(result, shape), weight.dtype)


def read_ids(ids, step, rows: int, options):
    """The ids a training lookup reads: this step's swept rows (first: a looked-up id keeps its gradient),
    then the lookup's, flattened."""
    flat = ops.reshape(ids, (-1,))
    swept = ops.cast(swept_rows(step, rows, options), flat.dtype)
    return ops.concatenate([swept, flat], axis=0)


def looked_up(tables, ids, group, distinct, slot, step, window, options, evaluation):
    """The forward pass of a training lookup: `(rows, residuals)`, the weights at `ids` as ordinary Adam has
    them at `step`, and what `stepped_rows` takes. `tables` are the rows `distinct` (`sparse_rows.distinct_ids`
    of `read_ids(ids, ...)` numbered by `group`; `slot` None: one per group) of `(weight, momenta, velocities,
    row_steps)`, each caught up once."""
    weight, momenta, velocities, row_steps = tables
    rows = (ops.cast(x, "float32") for x in (weight, momenta, velocities))
    rows = caught_up(*rows, row_steps, step, window, options, evaluation)
    # The lookup's ids are the last of `every` (`read_ids`); their count from the shape (`ops.size` would be
    # read back from a device).
    count = math.prod(ops.shape(ids))
    found = evaluation.gather(rows[0], group[ops.shape(group)[0] - count :])
    found = ops.cast(ops.reshape(found, ops.shape(ids) + tuple(weight.shape[1:])), weight.dtype)
    return found, (distinct, group, slot, rows + (row_steps,))


def stepped_rows(residuals, row_gradients, learning_rate, step, options, evaluation):
    """The backward pass of `looked_up`: `(distinct, new rows)`, the distinct rows' `(weight, momenta,
    velocities, row_steps)` after step `step + 1` (float32), for the backend to scatter. Duplicate ids'
    gradients are summed; swept rows take a zero gradient."""
    distinct, group, slot, (*rows, row_steps) = residuals
    row_shape = tuple(rows[0].shape[1:])
    values = ops.reshape(ops.cast(row_gradients, "float32"), (-1,) + row_shape)
    # The swept rows (the first entries of `group`) have no gradient: their sums stay zero.
    swept = ops.shape(group)[0] - ops.shape(values)[0]
    # Without `slot`, one entry per group; with it, static shapes: as many as ids, picked by `slot`.
    segments = ops.shape(distinct)[0]
    sums = evaluation.segment_sum(values, group[swept:], num_segments=segments)
    if slot is not None:
        sums = ops.take(sums, slot, axis=0)
    # Every row is current at `step` now. Written from the gathered counts, not as a broadcast: XLA copies a
    # whole slot to keep a gather's input when the scatter into it does not depend on the gather.
    steps = ops.maximum(ops.cast(row_steps, "float32"), ops.cast(step, "float32"))
    new = adam_math.row_update(sums, *rows, learning_rate, options, row_steps=steps)
    if options.bias_correction != "per_row":
        new = new + (steps + 1.0,)
    return distinct, new
