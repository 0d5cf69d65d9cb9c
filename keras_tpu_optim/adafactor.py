"""Adafactor with sublinear memory, a drop-in for `keras.optimizers.Adafactor`."""

from __future__ import annotations

import dataclasses

import keras

from keras_tpu_optim import _private, _slots
from keras_tpu_optim._backend import backend
from keras_tpu_optim._base import BASE_KEYWORDS, OptimizerBase, VariableState
from keras_tpu_optim._math.adafactor import AdafactorOptions

# What decides the optimizer's state (which slots, of which shapes, dtypes): fixed once it is built.
_OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(AdafactorOptions))
_STATE_DEFINING = frozenset(["factored_dims", "min_dim_size_to_factor", "momentum_dtype"])


@keras.saving.register_keras_serializable(package="keras_tpu_optim")
class Adafactor(OptimizerBase):
    """Optimizer that implements the Adafactor algorithm, in sublinear memory.

    Same signature, defaults and numbers as `keras.optimizers.Adafactor`, but a
    factored variable (rank >= 2) keeps only its row statistics (shape
    `var.shape[:-1]`) and column statistics (`var.shape[:-2] + var.shape[-1:]`),
    never a full-size second-moment buffer: on a BERT-base-sized model the
    optimizer state is about 0.3% of the parameters instead of 100%.
    Statistics are float32 whatever the variable dtype.

    At step `t = iterations + 1`, for a variable `x` with gradient `g`:

    ```
    rho_t   = min(lr, 1/sqrt(t)) if relative_step else lr
    alpha_t = max(epsilon_2, RMS(x)) * rho_t      (rho_t if not multiply_by_parameter_scale)
    G2      = g^2 + epsilon_1
    beta2_t = min(1 - (t - decay_offset)^beta_2_decay, beta_2_cap)
    factored:   R = beta2_t R + (1 - beta2_t) mean(G2, -1)
                C = beta2_t C + (1 - beta2_t) mean(G2, -2)
                u = g * rsqrt(R / mean(R, -1))[..., :, None] * rsqrt(C)[..., None, :]
    unfactored: V = beta2_t V + (1 - beta2_t) G2;   u = g * rsqrt(V)
    delta   = alpha_t * u / max(1, RMS(u) / clip_threshold)
    beta_1:     m = beta_1 m + (1 - beta_1) delta;  x -= m
    otherwise:  x -= delta
    ```

    (Factored over the last two axes, as shown, or the two largest with
    `factored_dims="two_largest"`; a bfloat16/float16 `x` is rounded once,
    to nearest or stochastically.)

    (docs/algorithms.md#adafactor has the details.) Differences from
    `keras.optimizers.Adafactor`: `relative_step=False` turns the `1/sqrt(t)`
    cap off (Keras 3 ignores the flag), and the options `beta_1`,
    `min_dim_size_to_factor`, `multiply_by_parameter_scale`, `factored_dims`,
    `decay_offset`, `beta_2_cap`, `momentum_dtype`, `stochastic_rounding` and
    `seed` (defaults keep Keras's behaviour).

    Args:
        learning_rate: A float, a `keras.optimizers.schedules.LearningRateSchedule`
            instance, or a callable that takes no arguments and returns the
            actual value to use. Defaults to `0.001`.
        beta_2_decay: float, the decay rate of `beta_2`: `beta2_t = 1 - t^beta_2_decay`.
            Defaults to `-0.8`.
        epsilon_1: float, a small offset added to the squared gradient to keep
            the denominator away from 0. Defaults to `1e-30`.
        epsilon_2: float, the floor of the parameter scale, so that small
            parameters still move. Defaults to `1e-3`.
        clip_threshold: float, the threshold of update clipping by RMS (part of
            the algorithm, independent of `clipnorm`, `clipvalue` and
            `global_clipnorm`). Defaults to `1.0`.
        relative_step: bool. If True, the step size is
            `min(learning_rate, 1/sqrt(t))`; if False, it is `learning_rate`.
            Defaults to `True`.
        beta_1: float in [0, 1) or None. If set, keeps an exponential moving
            average of the scaled update (momentum, as in optax and t5x), at
            the cost of a full-size buffer. Defaults to `None` (no momentum).
        min_dim_size_to_factor: int or None. If set, a variable is factored
            only if both of its last two dimensions are at least this size;
            smaller ones keep a full second moment. Defaults to `None`
            (factor every variable of rank >= 2, as Keras does).
        multiply_by_parameter_scale: bool. If True, the step size is scaled by
            `max(epsilon_2, RMS(variable))`. Defaults to `True`.
        factored_dims: `"last_two"` or `"two_largest"`: the axes a variable
            is factored over. `"two_largest"` factors over its two largest
            dimensions, as `optax.scale_by_factored_rms` (same tie-breaking;
            `min_dim_size_to_factor` applies to the smaller of the two); the
            row statistics are the variable's shape without its largest
            dimension, the column statistics without the second largest.
            Defaults to `"last_two"` (Keras's).
        decay_offset: int >= 0. The second-moment decay uses step
            `t - decay_offset` (floored at 1), as optax's `decay_offset`: for
            fine-tuning from a checkpoint whose `iterations` carry on.
            Defaults to `0`.
        beta_2_cap: float in [0, 1] or None. If set,
            `beta2_t = min(1 - t^beta_2_decay, beta_2_cap)` (big_vision's
            `beta2_cap`), so the statistics never freeze. Defaults to `None`.
        momentum_dtype: `"float32"` or `"bfloat16"`: the dtype of the
            `beta_1` momentum slot (arithmetic stays float32; a bfloat16
            slot is stored rounded to nearest). Defaults to `"float32"`.
        stochastic_rounding: bool. If True, a bfloat16/float16 variable's
            float32 result is rounded to its dtype stochastically and without
            bias (float32 variables are unaffected), with random bits hashed
            from `(seed, step, variable index, element index)`: the same bits
            on every backend, nothing to save but the seed. Defaults to
            `False` (round to nearest).
        seed: int in [0, 2^31), the seed of stochastic rounding. Defaults to `0`.
        skip_nonfinite_updates: bool. If True, a step whose gradients hold a
            NaN or an Inf changes nothing (variables, slots, EMA, accumulators,
            `iterations`). Defaults to `False` (a non-finite gradient
            propagates, as with Keras's optimizers).
        {{base_optimizer_keyword_args}}

    Every argument is also an attribute; setting one after construction is
    checked as the constructor checks it and takes effect at the next step (a
    traced train step keeps the values it was traced with, as with Keras's
    optimizers). `factored_dims`, `min_dim_size_to_factor`, `momentum_dtype`
    and whether `beta_1` is None decide the optimizer's state and cannot
    change once it is built (a `ValueError`). `catch_up_moving_averages()` is
    a no-op here (the EMA is never lazy), kept for code that handles both
    optimizers.

    Reference:
        - [Shazeer and Stern, 2018](https://arxiv.org/abs/1804.04235)
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_2_decay=-0.8,
        epsilon_1=1e-30,
        epsilon_2=1e-3,
        clip_threshold=1.0,
        relative_step=True,
        beta_1=None,
        min_dim_size_to_factor=None,
        multiply_by_parameter_scale=True,
        factored_dims="last_two",
        decay_offset=0,
        beta_2_cap=None,
        momentum_dtype="float32",
        stochastic_rounding=False,
        seed=0,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
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
        # Checked before the base class creates variables.
        options = AdafactorOptions(**{key: arguments[key] for key in _OPTION_NAMES})
        super().__init__(**{key: arguments[key] for key in BASE_KEYWORDS}, **kwargs)
        self._set_hyperparameters(options.to_config())

    _HYPERPARAMETERS = _OPTION_NAMES

    def _checked_hyperparameters(self, values):
        self._options = AdafactorOptions(**values)  # checked on creation; what every step reads
        return self._options.to_config()

    def _decides_state(self, name, value):
        return name in _STATE_DEFINING or (
            name == "beta_1" and (value is None) != (self.beta_1 is None)
        )

    def _make_state(self, variable) -> VariableState:
        """Row and column statistics (factored over axes `(a, b)`: without `b`, without `a`) or a full `v`,
        and the momentum if `beta_1`."""
        rank = len(variable.shape)
        axes = self._options.factored_axes(variable.shape)
        if axes is not None:
            row, column = ([i for i in range(rank) if i != dropped] for dropped in reversed(axes))
            slots = (
                _slots.add_slot(self, variable, "row_second_moment", kept_axes=row),
                _slots.add_slot(self, variable, "column_second_moment", kept_axes=column),
            )
        else:
            slots = (_slots.add_slot(self, variable, "second_moment"),)
        if self._options.beta_1 is None:
            return VariableState(slots)
        return VariableState(
            slots, _slots.add_slot(self, variable, "momentum", dtype=self._options.momentum_dtype)
        )

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = _private.variable_index(self, variable)
        backend.adafactor_step(
            gradient,
            variable,
            self._states[index],
            learning_rate=learning_rate,
            step=keras.ops.convert_to_tensor(self.iterations) + 1,
            options=self._options,
            variable_index=index,
            platform=self._platforms[index],
            cache=self._backend_cache,
        )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # The backend steps the variables it evaluates as groups; Keras's loop over `update_step` the rest.
        indices = [_private.variable_index(self, v) for v in trainable_variables]
        left = backend.adafactor_group_steps(
            grads,
            trainable_variables,
            [self._states[i] for i in indices],
            indices=indices,
            platforms=[self._platforms[i] for i in indices],
            learning_rate=learning_rate,
            step=keras.ops.convert_to_tensor(self.iterations) + 1,
            options=self._options,
            cache=self._backend_cache,
        )
        if left:
            super()._backend_update_step(
                [grads[p] for p in left], [trainable_variables[p] for p in left], learning_rate
            )

    def get_config(self):
        return {**super().get_config(), **self._options.to_config()}


Adafactor.__doc__ = Adafactor.__doc__.replace(
    "{{base_optimizer_keyword_args}}", _private.base_optimizer_keyword_args()
)
