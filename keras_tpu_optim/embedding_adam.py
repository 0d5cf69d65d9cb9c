"""Adam for embedding tables, with the semantics of `tf.tpu.experimental.embedding.Adam`."""

from __future__ import annotations

import types

import keras
from keras import ops

from keras_tpu_optim import _checks, _private, _slots
from keras_tpu_optim._backend import backend
from keras_tpu_optim._base import BASE_KEYWORDS, OptimizerBase, VariableState
from keras_tpu_optim._math import embedding_adam as adam_math
from keras_tpu_optim._math import stochastic_rounding

SLOT_NAMES = ("momenta", "velocities")
SECOND_MOMENTS = ("full", "rowwise")
BIAS_CORRECTIONS = ("global", "per_row")
# The role of the per-row slot of the accumulation window (`EmbeddingAdam._accumulates_rows`).
WINDOW_ROLE = "accumulation_window"


def _normalize_clipvalue(clipvalue):
    """A scalar c means (-c, c); a (min, max) pair may have None on either side."""
    if clipvalue is None:
        return None
    if isinstance(clipvalue, (tuple, list)):
        if len(clipvalue) != 2:
            raise ValueError(
                "Argument `clipvalue` must be a scalar or a (min, max) tuple. "
                f"Received: clipvalue={clipvalue!r}"
            )
        low, high = (_checks.check_number("clipvalue", c, allow_none=True) for c in clipvalue)
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"Argument `clipvalue` must have min <= max. Received: clipvalue={clipvalue!r}"
            )
        return (low, high)
    value = _checks.check_number("clipvalue", clipvalue, low=0, low_open=True)
    return (-value, value)


# Our own arguments (those of `tf.tpu.experimental.embedding.Adam`, then ours), plain attributes.
_HYPERPARAMETERS = (
    "beta_1 beta_2 epsilon lazy_adam sum_inside_sqrt use_gradient_accumulation clip_weight_min "
    "clip_weight_max weight_decay_factor multiply_weight_decay_factor_by_learning_rate "
    "slot_variable_creation_fn clipvalue low_dimensional_packing_status max_touched_rows "
    "second_moment bias_correction momentum_dtype velocity_dtype stochastic_rounding seed"
).split()
_ROW_UPDATE_HYPERPARAMETERS = (
    "beta_1 beta_2 epsilon sum_inside_sqrt clip_weight_min clip_weight_max second_moment bias_correction "
    "stochastic_rounding seed"
).split()
# What decides the optimizer's state (which slots, of which shapes and dtypes): fixed once it is built.
_STATE_DEFINING = frozenset(
    "lazy_adam use_gradient_accumulation slot_variable_creation_fn second_moment bias_correction "
    "momentum_dtype velocity_dtype".split()
)
SLOT_DTYPES = ("float32", "bfloat16")


def _check_arguments(values: dict, weight_decay):
    """Every argument check of `EmbeddingAdam`: in the constructor and when a hyperparameter is set."""
    a = types.SimpleNamespace(**values)
    _checks.check_number("beta_1", a.beta_1, low=0, high=1, high_open=True)
    _checks.check_number("beta_2", a.beta_2, low=0, high=1, high_open=True)
    _checks.check_number("epsilon", a.epsilon, low=0, low_open=True)
    for flag in (
        "lazy_adam sum_inside_sqrt use_gradient_accumulation low_dimensional_packing_status".split()
    ):
        _checks.check_bool(flag, values[flag])
    _checks.check_bool(
        "multiply_weight_decay_factor_by_learning_rate",
        a.multiply_weight_decay_factor_by_learning_rate,
        allow_none=True,
    )
    if not a.use_gradient_accumulation and not a.lazy_adam:
        raise ValueError(
            "When disabling lazy Adam (`lazy_adam=False`), gradient accumulation must be "
            "used: set `use_gradient_accumulation=True`."
        )
    if _normalize_clipvalue(a.clipvalue) is not None and not a.use_gradient_accumulation:
        raise ValueError(
            "Argument `clipvalue` requires `use_gradient_accumulation=True` (gradients are "
            f"clipped after duplicate ids are summed). Received: clipvalue={a.clipvalue!r}"
        )
    low = _checks.check_number("clip_weight_min", a.clip_weight_min, allow_none=True)
    high = _checks.check_number("clip_weight_max", a.clip_weight_max, allow_none=True)
    if low is not None and high is not None and low > high:
        raise ValueError(
            "Argument `clip_weight_min` must be <= `clip_weight_max`. Received: "
            f"clip_weight_min={low}, clip_weight_max={high}"
        )
    _checks.check_number("weight_decay_factor", a.weight_decay_factor, low=0, allow_none=True)
    if weight_decay is not None and a.weight_decay_factor is not None:
        raise ValueError(
            "Arguments `weight_decay` and `weight_decay_factor` cannot both be set: "
            "`weight_decay=x` means `weight_decay_factor=x` with "
            "`multiply_weight_decay_factor_by_learning_rate=True`."
        )
    if a.slot_variable_creation_fn is not None and not callable(a.slot_variable_creation_fn):
        raise ValueError(
            "Argument `slot_variable_creation_fn` must be callable. "
            f"Received: slot_variable_creation_fn={a.slot_variable_creation_fn!r}"
        )
    _checks.check_int("max_touched_rows", a.max_touched_rows, low=1, allow_none=True)
    _checks.check_choice("second_moment", a.second_moment, SECOND_MOMENTS)
    _checks.check_choice("bias_correction", a.bias_correction, BIAS_CORRECTIONS)
    _checks.check_choice("momentum_dtype", a.momentum_dtype, SLOT_DTYPES)
    _checks.check_choice("velocity_dtype", a.velocity_dtype, SLOT_DTYPES)
    _checks.check_bool("stochastic_rounding", a.stochastic_rounding)
    if _checks.check_int("seed", a.seed, low=0) >= stochastic_rounding.SEED_LIMIT:
        raise ValueError(f"Argument `seed` must be an int in [0, 2^31). Received: seed={a.seed!r}")


@keras.saving.register_keras_serializable(package="keras_tpu_optim")
class EmbeddingAdam(OptimizerBase):
    """Adam for embedding tables: lazy, sparse-fast, TPU-embedding semantics.

    The arguments, defaults and validation of
    `tf.tpu.experimental.embedding.Adam`, as a Keras 3 optimizer that runs on
    TensorFlow, JAX and PyTorch and exports to the TPU embedding engines
    (`keras_tpu_optim.tpu.to_tpu_embedding`) with the same numbers.

    With `lazy_adam=True` (the default) only the rows present in the gradient
    change: the indices of a sparse gradient (`tf.IndexedSlices`, a torch
    sparse tensor), or the rows of a dense gradient with any non-zero entry.
    Untouched rows keep their weights and slots bit for bit, and the cost of a
    step follows the rows touched, not the size of the table. A "row" is a
    slice along axis 0 (an element of a rank-1 variable).

    At step `t`, for each updated row, with `lr_t = lr * sqrt(1 - beta_2^t) /
    (1 - beta_1^t)`:

    ```
    g  = clip(g, clipvalue)
    w -= weight_decay_factor * (lr_t if multiply_weight_decay_factor_by_learning_rate else 1) * w
    m  = beta_1 * m + (1 - beta_1) * g
    v  = beta_2 * v + (1 - beta_2) * g^2
    w -= lr_t * m / sqrt(v + epsilon^2)      # sum_inside_sqrt=True
    w -= lr_t * m / (sqrt(v) + epsilon)      # sum_inside_sqrt=False (TF Addons LazyAdam)
    w  = clip(w, clip_weight_min, clip_weight_max)
    ```

    With `second_moment="rowwise"` a row keeps one `v` (the slot has shape
    `(rows,)`): `v = beta_2 * v + (1 - beta_2) * mean(g^2 over the row)`, and
    the row's momenta are divided by `sqrt(v + epsilon^2)` (or
    `sqrt(v) + epsilon`). With `bias_correction="per_row"` a row's update uses
    its own count `c` of updates (this one included, kept in an int32
    `row_steps` slot) in place of `t`.

    Args:
        learning_rate: A float, a `keras.optimizers.schedules.LearningRateSchedule`
            instance, or a callable that takes no arguments and returns the
            actual value to use. Defaults to `0.001`.
        beta_1: float in [0, 1), the decay of the first-moment estimates.
            Defaults to `0.9`.
        beta_2: float in [0, 1), the decay of the second-moment estimates.
            Defaults to `0.999`.
        epsilon: float > 0, a small constant for numerical stability.
            Defaults to `1e-7`.
        lazy_adam: bool. Update only the rows present in the gradient (True)
            or every row, as ordinary Adam (False). Defaults to `True`.
        sum_inside_sqrt: bool. Divide by `sqrt(v + epsilon^2)` (True) instead of
            `sqrt(v) + epsilon` (False). Defaults to `True`.
        use_gradient_accumulation: bool. Sum the gradients of duplicate ids
            before the update (True). If False the summing pass is skipped and
            the last occurrence's update wins: faster, less exact (the TPU
            meaning). Defaults to `True`.
        clip_weight_min: float or None, the minimum weight after the update;
            None means -infinity.
        clip_weight_max: float or None, the maximum weight after the update;
            None means +infinity.
        weight_decay_factor: float or None, the weight decay applied to the
            updated rows before the Adam step; None means no decay.
        multiply_weight_decay_factor_by_learning_rate: bool or None. If True,
            the decay is multiplied by the current (bias-corrected) learning
            rate `lr_t`.
        slot_variable_creation_fn: None, or a callable
            `(variable, slot_names, initializers) -> {slot_name: keras.Variable}`
            that creates the `"momenta"` and `"velocities"` slots (of the
            variable's shape) itself. To save a model using it, register it
            with `keras.saving.register_keras_serializable`.
        clipvalue: None, a positive scalar `c` (clip gradients to `[-c, c]`), or
            a `(min, max)` tuple where either side may be None (unbounded).
            Applied after any `clipnorm`/`global_clipnorm` and after duplicate
            ids are summed.
        low_dimensional_packing_status: bool, the TPU's packing of tables of
            dimension 1, 2 and 4. No numerical effect off TPU; carried into the
            TPU configuration and serialized. Defaults to `False`.
        second_moment: `"full"` (the default: `v` has the table's shape) or
            `"rowwise"` (one `v` per row, of the mean of `g^2` over the row;
            the state is `1 + 1/dim` times the table instead of 2 times). A
            rank-1 table's rows are single elements, so both are the same.
        bias_correction: `"global"` (the default, the TPU engines' semantics:
            `t` is the optimizer's step) or `"per_row"` (`t` is the number of
            updates the row has had, this one included; adds an int32
            `row_steps` slot of shape `(rows,)`). With `lazy_adam=False`
            every row is updated every step, so both are the same.
        momentum_dtype, velocity_dtype: `"float32"` (the default) or
            `"bfloat16"`: the dtype of the `momenta` and `velocities` slots. The
            update is computed in float32 and stored rounded (below).
        stochastic_rounding: bool. If True, a bfloat16/float16 table or slot
            stores its float32 result rounded stochastically, without bias,
            instead of to nearest, so updates smaller than its spacing still
            add up on average. The random bits come from `(seed, step, table
            index, slot, element index)`: the same bits on every backend and
            path, nothing to save but the seed. Defaults to `False`.
        seed: int in [0, 2^31), the seed of stochastic rounding. Defaults to `0`.
        max_touched_rows: int or None, the static row capacity of one
            gather/update/scatter round for dense gradients on JAX (shapes
            must be static under `jax.jit`). A step that touches more rows
            takes more rounds, with the same numbers. None:
            `min(rows, 4096)`. Ignored by TF and torch.
        weight_decay: float or None, the Keras keyword. Means
            `weight_decay_factor=weight_decay` with
            `multiply_weight_decay_factor_by_learning_rate=True`, applied lazily
            to the updated rows only (Keras's own decay touches every row every
            step); `exclude_from_weight_decay` is honoured. Cannot be combined
            with `weight_decay_factor`.
        clipnorm, global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency,
        loss_scale_factor, gradient_accumulation_steps, name: as for every Keras
            optimizer. With `lazy_adam=True` the EMA is kept lazily, at
            O(rows touched) a step with Keras's numbers (call
            `catch_up_moving_averages()` before reading the averages directly).
        skip_nonfinite_updates: bool. If True, a step whose gradients hold a
            NaN or an Inf changes nothing (variables, slots, EMA, accumulators,
            `iterations`). Defaults to `False` (a non-finite gradient
            propagates, as with Keras's optimizers).

    Every argument is also an attribute; setting one after construction is
    checked as the constructor checks it and takes effect at the next step.
    `lazy_adam`, `use_gradient_accumulation`, `slot_variable_creation_fn`,
    `second_moment`, `bias_correction`, `momentum_dtype` and `velocity_dtype`
    decide the optimizer's state and cannot change once it is built (a
    `ValueError`).
    """

    def __init__(
        self,
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
        slot_variable_creation_fn=None,
        clipvalue=None,
        low_dimensional_packing_status=False,
        max_touched_rows=None,
        second_moment="full",
        bias_correction="global",
        momentum_dtype="float32",
        velocity_dtype="float32",
        stochastic_rounding=False,
        seed=0,
        weight_decay=None,
        clipnorm=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        skip_nonfinite_updates=False,
        name=None,
        **kwargs,
    ):
        arguments = locals()
        hyperparameters = {key: arguments[key] for key in _HYPERPARAMETERS}
        # Validate everything before the base class creates variables.
        _check_arguments(hyperparameters, weight_decay)
        base = {key: arguments[key] for key in BASE_KEYWORDS}
        # `clipvalue` is ours, not Keras's: clipped per row, after duplicates are summed.
        super().__init__(**dict(base, clipvalue=None), **kwargs)
        self._set_hyperparameters(hyperparameters)

    _HYPERPARAMETERS = frozenset(_HYPERPARAMETERS)
    _OPTIONAL_STATE_ROLES = frozenset({"average_steps", WINDOW_ROLE})

    def _checked_hyperparameters(self, values):
        _check_arguments(values, getattr(self, "weight_decay", None))
        return values

    def _decides_state(self, name, value):
        return name in _STATE_DEFINING

    def _table_state_plan(self) -> tuple:
        """The state kept beside a table, in the order `row_update` takes it:
        `(name, the table's axes it keeps (None: all), dtype)`. The optimizer's slots for a table, and the
        state `kto.layers.Embedding` creates beside its own."""
        plan = (
            ("momenta", None, self.momentum_dtype),
            ("velocities", (0,) if self.second_moment == "rowwise" else None, self.velocity_dtype),
        )
        if self.bias_correction == "per_row":
            plan += (("row_steps", (0,), "int32"),)
        return plan

    @property
    def _plans_slots(self) -> bool:
        # A `slot_variable_creation_fn` makes its own variables, with its own layouts.
        return self.slot_variable_creation_fn is None

    def _make_state(self, variable) -> VariableState:
        """A table's slots, in the order `row_update` reads them."""
        plan, slots = self._table_state_plan(), ()
        if self.slot_variable_creation_fn is not None:  # it makes `momenta` and `velocities`
            plan, slots = plan[2:], self._create_slots_with_user_fn(variable)
        slots += tuple(
            _slots.add_slot(self, variable, name, kept_axes=axes, dtype=dtype)
            for name, axes, dtype in plan
        )

        def per_row(role):
            return _slots.add_slot(self, variable, role, kept_axes=(0,), dtype="int32")

        if self._lazy_ema:
            slots += (per_row("average_steps"),)
        return VariableState(slots, window=per_row(WINDOW_ROLE) if self._accumulates_rows else None)

    @property
    def _accumulates_rows(self) -> bool:
        """With `lazy_adam`, `gradient_accumulation_steps` adds sparse rows in place and updates only the
        window's rows (listed by the int32 `accumulation_window` slot), not Keras's dense table a micro-step."""
        return bool(self.lazy_adam and self.gradient_accumulation_steps)

    @property
    def _lazy_ema(self) -> bool:
        """With `lazy_adam`, an untouched row's average follows in closed form, so it is caught up only when
        the row is touched or the averages are read (int32 `average_steps` slot: its EMA updates)."""
        return bool(self.use_ema and self.lazy_adam)

    def _lazy_averages(self):
        """`(variable, average, average_steps)` of every table whose EMA is kept lazily."""
        if not self._lazy_ema or not self.built:
            return []
        states = zip(
            _private.trainable_variables(self), self._states, _private.moving_averages(self)
        )
        return [(v, a, s.slots[-1]) for v, s, a in states if s is not None and a is not None]

    def _row_slots(self, variable) -> tuple:
        """The slots the row paths gather with the table, in the order `row_update` reads them."""
        slots = self._state_of(variable).slots
        if self._lazy_ema:
            slots += (_private.moving_averages(self)[_private.variable_index(self, variable)],)
        return slots

    def _catch_up(self, count, condition=None):
        """Catch every row of every lazily averaged table up to `count` EMA updates (where `condition` holds)."""
        options = self._row_update_options()
        for variable, average, steps in self._lazy_averages():

            def caught_up(variable=variable, average=average, steps=steps):
                weight, mean = (ops.cast(v.value, "float32") for v in (variable, average))
                value = adam_math.ema_catch_up(weight, mean, steps.value, count, options)
                new_steps = ops.maximum(steps.value, ops.cast(count, steps.dtype))
                return ops.cast(value, average.dtype), new_steps

            if condition is None:
                new_average, new_steps = caught_up()
            else:
                new_average, new_steps = backend.cond(
                    condition, caught_up, lambda a=average, s=steps: (a.value, s.value)
                )
            average.assign(new_average)
            steps.assign(new_steps)

    def catch_up_moving_averages(self):
        """Bring every row's stored EMA up to date with the steps taken so far.

        Reading the EMA through Keras (`ema_overwrite_frequency`,
        `finalize_variable_values` at the end of `fit`, saving) does this
        itself; call it before reading `optimizer.variables` directly (e.g.
        `keras.callbacks.SwapEMAWeights`). Costs one pass over the tables.
        """
        self._catch_up(ops.cast(_private.raw_iterations(self), "int32"))

    def _update_model_variables_moving_average(self, trainable_variables):
        # Keras's hook (_private.EMA_HOOKS): its own EMA step, but the row update keeps the lazy averages.
        lazy = [average for _, average, _ in self._lazy_averages()]
        if not lazy:
            return super()._update_model_variables_moving_average(trainable_variables)
        with _private.moving_averages_left_out(self, lazy):
            super()._update_model_variables_moving_average(trainable_variables)
        if self.ema_overwrite_frequency:
            # Keras installs the averages after this step: bring every row up to date first.
            due = ops.equal((self.iterations + 1) % self.ema_overwrite_frequency, 0)
            self._catch_up(ops.cast(_private.raw_iterations(self), "int32") + 1, due)

    def _overwrite_model_variables_with_average_value(self, trainable_variables):
        # Keras's hook (_private.EMA_HOOKS). Inside `apply` every row is already caught up (above).
        self.catch_up_moving_averages()
        return super()._overwrite_model_variables_with_average_value(trainable_variables)

    def _fill_missing_state(self, variables) -> None:
        for variable in variables:
            owner, role = _slots.role_of(self, variable)
            if role == WINDOW_ROLE:
                # Saved under dense accumulation: the accumulator's non-zero rows (Keras's mean skips the rest).
                accumulator = ops.convert_to_tensor(_private.gradient_accumulators(self)[owner])
                window = ops.zeros((accumulator.shape[0],), "int32")
                number = ops.cast(self.iterations + 1, "int32")
                variable.assign(adam_math.mark_touched(accumulator, window, number))
            else:
                # State saved before the EMA was lazy: its averages were updated at every step.
                count = ops.cast(_private.raw_iterations(self), variable.dtype)
                variable.assign(ops.broadcast_to(count, variable.shape))

    def _create_slots_with_user_fn(self, var):
        initializers = [keras.initializers.Zeros() for _ in SLOT_NAMES]
        slots = self.slot_variable_creation_fn(var, list(SLOT_NAMES), initializers)
        if not isinstance(slots, dict) or set(slots) != set(SLOT_NAMES):
            raise ValueError(
                "`slot_variable_creation_fn` must return a dict with exactly the keys "
                f"{list(SLOT_NAMES)}; it returned {slots!r}."
            )
        for name, axes, _ in self._table_state_plan()[:2]:
            slot = slots[name]
            axes = axes or range(len(var.shape))
            shape = tuple(var.shape[i] for i in axes)
            if not isinstance(slot, keras.Variable) or tuple(slot.shape) != shape:
                raise ValueError(
                    f"`slot_variable_creation_fn` must return keras.Variables of shape {shape} for slot "
                    f"'{name}' (the table's shape, or `(rows,)` for `velocities` with "
                    f"`second_moment=\"rowwise\"`); slot '{name}' is {slot!r}."
                )
            if not _private.is_tracked(self, slot):
                _private.track_variable(self, slot)
        return tuple(slots[name] for name in SLOT_NAMES)

    def _clip_gradients(self, grads):
        # Keras's clipnorm/global_clipnorm only: our clipvalue acts per touched row, after duplicates are summed.
        if (self.clipnorm or 0) > 0 or (self.global_clipnorm or 0) > 0:
            return super()._clip_gradients(grads)
        return grads

    def _apply_weight_decay(self, variables):
        # Keras's decay would touch every row every step; ours is lazy (update_step).
        return

    def _row_update_options(self, variable=None) -> adam_math.RowUpdateOptions:
        """The static options of the row update; `variable` (None: the TPU export) for `exclude_from_weight_decay`."""
        decay = self.weight_decay_factor
        multiply = bool(self.multiply_weight_decay_factor_by_learning_rate)
        if self.weight_decay is not None and (
            variable is None or _private.uses_weight_decay(self, variable)
        ):
            decay, multiply = self.weight_decay, True
        low, high = _normalize_clipvalue(self.clipvalue) or (None, None)
        return adam_math.RowUpdateOptions(
            **{name: getattr(self, name) for name in _ROW_UPDATE_HYPERPARAMETERS},
            gradient_clip_min=low,
            gradient_clip_max=high,
            weight_decay_factor=decay,
            multiply_weight_decay_factor_by_learning_rate=multiply,
            ema_momentum=self.ema_momentum if self._lazy_ema else None,
            ema_copy_updates=self.gradient_accumulation_steps or 1,
        )

    def _row_learning_rate(self, step, learning_rate=None):
        """The row update's float32 rate after `step` applied updates (also the TPU engines'): bias-corrected for
        `t = step + 1`, uncorrected with `bias_correction="per_row"` (`learning_rate`: Keras's reading)."""
        if learning_rate is None:
            learning_rate = _private.learning_rate_at(self, step)
        learning_rate = ops.cast(learning_rate, "float32")
        if self.bias_correction == "per_row":
            return learning_rate
        return adam_math.bias_corrected_learning_rate(
            learning_rate, ops.cast(step, "float32") + 1.0, self.beta_1, self.beta_2
        )

    def update_step(self, gradient, variable, learning_rate):
        """Update the rows of `variable` present in `gradient` (all rows if not lazy)."""
        learning_rate = self._row_learning_rate(self.iterations, learning_rate)
        # Keras updates the averages once per `apply` (micro-step): this step's EMA update is numbered so.
        ema_step = ops.cast(_private.raw_iterations(self), "int32") if self.use_ema else None
        # The key of stochastic rounding, read only where it rounds.
        rounding = {}
        if self.stochastic_rounding:
            rounding = dict(
                step=ops.cast(self.iterations, "int32"),
                variable_index=_private.variable_index(self, variable),
            )
        backend.embedding_adam_step(
            gradient,
            variable,
            self._row_slots(variable),
            adam_math.RowUpdate(
                learning_rate, self._row_update_options(variable), ema_step, **rounding
            ),
            lazy=self.lazy_adam,
            accumulate_duplicates=self.use_gradient_accumulation,
            max_touched_rows=self.max_touched_rows,
            cache=self._backend_cache,
        )

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _HYPERPARAMETERS})
        config["slot_variable_creation_fn"] = _checks.serialize_callable(
            "slot_variable_creation_fn", self.slot_variable_creation_fn
        )
        if isinstance(self.clipvalue, (tuple, list)):
            config["clipvalue"] = list(self.clipvalue)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["slot_variable_creation_fn"] = _checks.deserialize_callable(
            "slot_variable_creation_fn", config.get("slot_variable_creation_fn"), custom_objects
        )
        if isinstance(config.get("clipvalue"), list):
            config["clipvalue"] = tuple(config["clipvalue"])
        return super().from_config(config, custom_objects=custom_objects)
