"""EmbeddingAdam in numpy, written from docs/algorithms.md#embeddingadam (not from the package's code).

For every updated row r at step t (1-based)::

    g_r   = clip(g_r, clipvalue)                       (after any clipnorm)
    lr_t  = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)   (lr: the schedule's value at this step)
    w_r  -= wd * (lr_t if multiply_by_lr else 1) * w_r (if weight_decay_factor)
    m_r   = beta_1 m_r + (1 - beta_1) g_r
    v_r   = beta_2 v_r + (1 - beta_2) g_r^2
    w_r  -= lr_t * m_r / sqrt(v_r + epsilon^2)         if sum_inside_sqrt
    w_r  -= lr_t * m_r / (sqrt(v_r) + epsilon)         otherwise
    w_r   = clip(w_r, clip_weight_min, clip_weight_max)

Options beyond the TPU engine's (docs/algorithms.md#embeddingadam):

- `second_moment="rowwise"`: one v per row, `v_r = beta_2 v_r + (1 - beta_2) * mean_j(g_rj^2)`;
  the row's momenta are divided by `sqrt(v_r + epsilon^2)` (or `sqrt(v_r) + epsilon`).
- `bias_correction="per_row"`: row r's update uses its own count c_r of updates (this one
  included) in place of t: `lr_c = lr * sqrt(1 - beta_2^c) / (1 - beta_1^c)`, also in the decay.

Lazy: only rows present in the gradient are updated (a sparse gradient's
indices; for a dense gradient, the rows with any non-zero entry). Not lazy:
every row. Duplicate indices are summed first with gradient accumulation; without
it, each occurrence is computed from the pre-step row and the last one wins.

The arithmetic is float64; the weights are stored in `weight_dtype` after each
step (a float32 computation cast back once, as docs/algorithms.md promises for low-precision
tables, differs from this by at most one rounding of the stored weight).
"""

from __future__ import annotations

import numpy as np


def bias_corrected_learning_rate(learning_rate, step, beta_1, beta_2):
    """lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t), t the 1-based step."""
    return learning_rate * np.sqrt(1.0 - beta_2**step) / (1.0 - beta_1**step)


def clip_gradient(gradient, clipvalue):
    """A scalar c clips to [-c, c]; a (min, max) pair may leave either side open (None)."""
    if clipvalue is None:
        return gradient
    if isinstance(clipvalue, (tuple, list)):
        low, high = clipvalue
    else:
        low, high = -clipvalue, clipvalue
    if low is not None:
        gradient = np.maximum(gradient, low)
    if high is not None:
        gradient = np.minimum(gradient, high)
    return gradient


def clip_by_norm(gradient, clipnorm):
    """Keras's `clipnorm`: scale the whole gradient down to norm `clipnorm` if it is larger."""
    norm = np.sqrt(np.sum(np.square(gradient, dtype=np.float64)))
    if norm <= clipnorm:
        return gradient
    return gradient * (clipnorm / norm)


def adam_row(
    gradient,
    weight,
    momenta,
    velocities,
    lr_t,
    *,
    beta_1,
    beta_2,
    epsilon,
    sum_inside_sqrt,
    clip_weight_min,
    clip_weight_max,
    weight_decay_factor,
    multiply_by_learning_rate,
    second_moment="full",
    dtype=np.float64,
):
    """One row (or a stack of rows) of docs/algorithms.md#embeddingadam, after gradient clipping, computed
    in `dtype` (the arguments are cast to it).

    For a stack of rows `lr_t` may hold one rate per row. With
    `second_moment="rowwise"` `velocities` holds one value per row.
    """
    gradient = np.asarray(gradient, dtype)
    lr_t = np.asarray(lr_t, dtype)
    weight, momenta, velocities = (np.asarray(x, dtype) for x in (weight, momenta, velocities))
    if lr_t.ndim:  # one rate per row of a stack
        lr_t = lr_t.reshape(lr_t.shape + (1,) * (gradient.ndim - 1))
    if weight_decay_factor is not None:
        decay = weight_decay_factor * (lr_t if multiply_by_learning_rate else 1.0)
        weight = weight - decay * weight
    momenta = beta_1 * momenta + (1.0 - beta_1) * gradient
    rowwise = second_moment == "rowwise"
    # A single row has no row axis; a stack of rows has it first. Rowwise v: one number per row.
    row_axes = tuple(range(np.ndim(velocities), gradient.ndim)) if rowwise else ()
    square = np.square(gradient)
    if row_axes:
        square = square.mean(axis=row_axes)
    velocities = beta_2 * velocities + (1.0 - beta_2) * square
    v = np.reshape(velocities, np.shape(velocities) + (1,) * len(row_axes))
    if sum_inside_sqrt:
        weight = weight - lr_t * momenta / np.sqrt(v + epsilon**2)
    else:
        weight = weight - lr_t * momenta / (np.sqrt(v) + epsilon)
    if clip_weight_min is not None:
        weight = np.maximum(weight, clip_weight_min)
    if clip_weight_max is not None:
        weight = np.minimum(weight, clip_weight_max)
    return weight, momenta, velocities


class NumpyEmbeddingAdam:
    """A stateful reference: holds the table, its momenta and velocities, and the step count.

    `learning_rate` is a float or a function of the 0-based step index (the
    value Keras passes a `LearningRateSchedule`: its `iterations` before the step).
    """

    def __init__(
        self,
        weights,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        lazy_adam=True,
        sum_inside_sqrt=True,
        use_gradient_accumulation=True,
        clip_weight_min=None,
        clip_weight_max=None,
        weight_decay_factor=None,
        multiply_weight_decay_factor_by_learning_rate=None,
        clipvalue=None,
        clipnorm=None,
        weight_dtype=None,
        second_moment="full",
        bias_correction="global",
        compute_dtype=np.float64,
    ):
        self.weight_dtype = (
            np.dtype(weight_dtype) if weight_dtype is not None else np.asarray(weights).dtype
        )
        self.weights = np.array(weights, dtype=self.weight_dtype)
        self.compute_dtype = np.dtype(compute_dtype)
        self.momenta = np.zeros(self.weights.shape, self.compute_dtype)
        rows = self.weights.shape[0]
        self.velocities = np.zeros(
            (rows,) if second_moment == "rowwise" else self.weights.shape, self.compute_dtype
        )
        self.row_steps = np.zeros((rows,), np.int64)  # updates applied to each row
        self.bias_correction = bias_correction
        self.iterations = 0
        self.learning_rate = learning_rate
        self.lazy_adam = lazy_adam
        self.use_gradient_accumulation = use_gradient_accumulation
        self.clipvalue = clipvalue
        self.clipnorm = clipnorm
        self.row_options = dict(
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            sum_inside_sqrt=sum_inside_sqrt,
            clip_weight_min=clip_weight_min,
            clip_weight_max=clip_weight_max,
            weight_decay_factor=weight_decay_factor,
            multiply_by_learning_rate=bool(multiply_weight_decay_factor_by_learning_rate),
            second_moment=second_moment,
        )

    def _lr_t(self, rows=None):
        """The bias-corrected rate of this step: for `rows` (an array), one per row under per-row correction."""
        lr = (
            self.learning_rate(self.iterations)
            if callable(self.learning_rate)
            else self.learning_rate
        )
        options = self.row_options
        if self.bias_correction == "per_row":
            counts = self.row_steps[rows] + 1  # this update included
            return bias_corrected_learning_rate(
                lr, counts.astype(np.float64), options["beta_1"], options["beta_2"]
            )
        return bias_corrected_learning_rate(
            lr, self.iterations + 1, options["beta_1"], options["beta_2"]
        )

    def _update(self, rows, row_gradients):
        """Update `rows` (unique, sorted or not) with their (already combined) gradients."""
        rows = np.asarray(rows, np.int64)
        lr_t = self._lr_t(rows)
        weight = self.weights.astype(self.compute_dtype)
        new_w, new_m, new_v = adam_row(
            clip_gradient(row_gradients, self.clipvalue),
            weight[rows],
            self.momenta[rows],
            self.velocities[rows],
            lr_t,
            **self.row_options,
            dtype=self.compute_dtype,
        )
        weight[rows] = new_w
        self.momenta[rows] = new_m
        self.velocities[rows] = new_v
        self.row_steps[rows] += 1
        self.weights = weight.astype(self.weight_dtype)
        self.iterations += 1

    def apply_dense(self, gradient):
        """A dense gradient: touched rows are those with any non-zero entry (all rows if not lazy)."""
        gradient = np.asarray(gradient, np.float64)
        if self.clipnorm is not None:
            gradient = clip_by_norm(gradient, self.clipnorm)
        if self.lazy_adam:
            nonzero = gradient != 0
            touched = (
                nonzero
                if gradient.ndim == 1
                else nonzero.reshape(gradient.shape[0], -1).any(axis=1)
            )
            rows = np.flatnonzero(touched)
        else:
            rows = np.arange(gradient.shape[0])
        self._update(rows, gradient[rows])

    def apply_sparse(self, indices, values):
        """A sparse gradient: rows `indices[i]` get `values[i]`; duplicates per the accumulation mode."""
        indices = np.asarray(indices).reshape(-1)
        values = np.asarray(values, np.float64)
        if not self.lazy_adam:
            dense = np.zeros(self.weights.shape, np.float64)
            np.add.at(dense, indices, values)
            self.apply_dense_all_rows(dense)
            return
        if self.use_gradient_accumulation:
            rows = np.unique(indices)
            summed = np.zeros((len(rows),) + values.shape[1:], np.float64)
            np.add.at(summed, np.searchsorted(rows, indices), values)
            self._update(rows, summed)
            return
        # No accumulation: each occurrence is computed from the pre-step row; the last one wins.
        old_w = self.weights.astype(np.float64)
        new_weight, new_m, new_v = old_w.copy(), self.momenta.copy(), self.velocities.copy()
        for position, row in enumerate(indices):
            lr_t = self._lr_t(np.asarray(row))
            w, m, v = adam_row(
                clip_gradient(values[position], self.clipvalue),
                old_w[row],
                self.momenta[row],
                self.velocities[row],
                lr_t,
                **self.row_options,
            )
            new_weight[row], new_m[row], new_v[row] = w, m, v
        self.weights = new_weight.astype(self.weight_dtype)
        self.momenta, self.velocities = new_m, new_v
        self.row_steps[np.unique(indices)] += 1
        self.iterations += 1

    def apply_rows(self, rows, gradient):
        """Update exactly `rows` (lazily) with the dense `gradient`'s rows, after Keras's clipnorm of the whole."""
        gradient = np.asarray(gradient, np.float64)
        if self.clipnorm is not None:
            gradient = clip_by_norm(gradient, self.clipnorm)
        rows = np.unique(np.asarray(rows, np.int64))
        self._update(rows, gradient[rows])

    def apply_dense_all_rows(self, gradient):
        """Ordinary (non-lazy) Adam on every row."""
        gradient = np.asarray(gradient, np.float64)
        self._update(np.arange(gradient.shape[0]), gradient)


class KerasEma:
    """Keras's `use_ema`, from its documentation and base-optimizer contract, around a reference optimizer.

    At every `apply` (micro-step `s` under `gradient_accumulation_steps=N`),
    after the update: with `iterations = s // N` (updates before this one),
    `average = mu * average + (1 - mu) * w` for EVERY row, `mu = 0` when
    `iterations == 0` (the first update copies `w`) and `ema_momentum` after;
    the average starts at zeros. With `ema_overwrite_frequency=f`, when
    `(iterations + 1) % f == 0` the weights are then overwritten by the average.
    `finalize()` (the end of `fit`) installs the average as the weights.
    """

    def __init__(self, reference, momentum, overwrite_frequency=None, accumulation_steps=None):
        self.reference = reference
        self.momentum = momentum
        self.overwrite_frequency = overwrite_frequency
        self.accumulation_steps = accumulation_steps or 1
        self.average = np.zeros(reference.weights.shape, np.float64)
        self.micro_steps = 0

    def after_apply(self):
        """Call after each `apply` of the wrapped reference (or each micro-batch)."""
        iterations = self.micro_steps // self.accumulation_steps
        mu = 0.0 if iterations == 0 else self.momentum
        weights = self.reference.weights.astype(np.float64)
        self.average = mu * self.average + (1.0 - mu) * weights
        if self.overwrite_frequency and (iterations + 1) % self.overwrite_frequency == 0:
            self.reference.weights = self.average.astype(self.reference.weight_dtype)
        self.micro_steps += 1

    def finalize(self):
        self.reference.weights = self.average.astype(self.reference.weight_dtype)


class KerasAccumulation:
    """Keras's `gradient_accumulation_steps=N` around a lazy reference, from docs/algorithms.md.

    Every micro-batch's gradient is added into a table-sized sum (duplicate ids
    summed) and the rows it names are recorded (a sparse gradient's indices, a
    dense gradient's rows with any non-zero entry). At every N-th micro-batch
    the mean `sum / N` (Keras's `clipnorm` applies to it) updates every row
    named in any of the N micro-batches, one update of the reference; the sum
    and the rows are then cleared. In between nothing else changes.
    """

    def __init__(self, reference, steps):
        self.reference = reference
        self.steps = steps
        self.sum = np.zeros(reference.weights.shape, np.float64)
        self.rows = set()
        self.micro_steps = 0

    def apply_sparse(self, indices, values):
        """One micro-batch of a sparse gradient; True if it ended a window (an update)."""
        indices = np.asarray(indices).reshape(-1)
        np.add.at(self.sum, indices, np.asarray(values, np.float64))
        self.rows.update(int(i) for i in indices)
        return self._step()

    def apply_dense(self, gradient):
        """One micro-batch of a dense gradient; True if it ended a window (an update)."""
        gradient = np.asarray(gradient, np.float64)
        self.sum += gradient
        nonzero = (gradient != 0).reshape(gradient.shape[0], -1).any(axis=1)
        self.rows.update(int(i) for i in np.flatnonzero(nonzero))
        return self._step()

    def _step(self):
        self.micro_steps += 1
        if self.micro_steps % self.steps:
            return False
        self.reference.apply_rows(sorted(self.rows), self.sum / self.steps)
        self.sum[:] = 0.0
        self.rows = set()
        return True
