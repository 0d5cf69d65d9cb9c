"""The base class both optimizers share: input checks before anything is updated,
safe configs, state that cannot be loaded into the wrong optimizer, and an
optional skip of steps with non-finite gradients."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import keras
import numpy as np
from keras import ops

from keras_tpu_optim import _accumulation, _backend, _checks, _private, _saving, _slots
from keras_tpu_optim._backend import backend


class VariableState(NamedTuple):
    """An optimizer's state for one model variable."""

    slots: tuple
    momentum: Optional[keras.Variable] = None
    # EmbeddingAdam under `gradient_accumulation_steps`: per row, the update whose window last
    # touched it (int32, `(rows,)`); see `EmbeddingAdam._accumulates_rows`.
    window: Optional[keras.Variable] = None


class OptimizerBase(keras.optimizers.Optimizer):
    """What both optimizers add to `keras.optimizers.Optimizer`.

    - Every check runs before any variable changes: hyperparameters in the
      constructor; variable dtypes in `build`; an empty gradient list, a
      gradient whose shape differs from its variable's and a learning rate that
      is not a scalar in `apply`.
    - A callable `learning_rate` is saved by its registered name, so a saved
      model loads with `safe_mode=True`; an unregistered one cannot be saved
      (a ValueError says so) rather than needing `safe_mode=False` to load.
    - The saved optimizer state carries a signature of its variables; loading
      it into one of ours built differently raises a ValueError naming the
      difference (Keras would warn and skip, or assign silently).
    - `skip_nonfinite_updates` (keyword, default False): if True, a step whose
      gradients contain a NaN or an Inf changes nothing at all — model
      variables, slots, EMA, gradient accumulators and `iterations` stay as
      they were (as under `LossScaleOptimizer` and optax's `apply_if_finite`),
      so a learning-rate schedule does not advance either. Implemented with
      `ops.cond`, so it compiles under `jax.jit` and `tf.function`. Off, a
      non-finite gradient propagates into the variables as with any Keras
      optimizer.
    """

    # The subclass's own hyperparameters: plain attributes, as on Keras's optimizers, checked when set.
    _HYPERPARAMETERS: frozenset = frozenset()

    def __init__(self, skip_nonfinite_updates=False, **kwargs):
        _backend.get()  # A backend we do not support: refused here.
        _checks.check_base_arguments(**kwargs)
        _checks.check_layout_map(type(self), kwargs.get("name"))
        super().__init__(**kwargs)
        self.skip_nonfinite_updates = _checks.check_bool(
            "skip_nonfinite_updates", skip_nonfinite_updates
        )

    def __setattr__(self, name, value):
        # A hyperparameter set after construction is checked as the constructor checks it and takes effect at
        # the next step (a traced train step keeps the values it was traced with, as with Keras's optimizers).
        if name in self._HYPERPARAMETERS and self.__dict__.get("_hyperparameters_set"):
            if self.built and value != getattr(self, name) and self._decides_state(name, value):
                raise ValueError(
                    f"{type(self).__name__}.{name} decides the optimizer's state (its slots), which is built: set "
                    f"it before the first step, or use a new optimizer. Received: {name}={value!r}"
                )
            values = {key: getattr(self, key) for key in self._HYPERPARAMETERS}
            values[name] = value
            value = self._checked_hyperparameters(values)[name]
        super().__setattr__(name, value)

    def _set_hyperparameters(self, values: dict) -> None:
        """The constructor's last step: `values` (checked, `_checked_hyperparameters`) become the attributes."""
        for name, value in self._checked_hyperparameters(values).items():
            setattr(self, name, value)
        self._hyperparameters_set = True

    def _checked_hyperparameters(self, values: dict) -> dict:
        """`values` of every hyperparameter, checked together (a `ValueError` naming the argument), normalised."""
        return values

    def _decides_state(self, name: str, value) -> bool:
        """Whether setting hyperparameter `name` to `value` would change the optimizer's state (its slots)."""
        return False

    # ---------------------------------------------------------------- build

    def build(self, var_list):
        """Check the variables, build Keras's state, then each variable's (`_make_state`)."""
        if self.built:
            return
        for variable in var_list:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            if not dtype.startswith(("float", "bfloat")):
                raise ValueError(
                    f"{type(self).__name__} can only optimize floating-point variables; "
                    f"variable '{_slots.variable_path(variable)}' has dtype {dtype}."
                )
        with backend.state_creation_scope():
            self._build_state(var_list)

    def _build_state(self, var_list):
        if self._plans_slots:
            with _slots.planning(self) as planned:
                for variable in var_list:
                    if not _private.overwritten_with_gradient(self, variable):
                        self._make_state(variable)
            _checks.check_slot_layouts(type(self), planned)
        super().build(var_list)
        _slots.record_keras_roles(self)
        self._platforms = [backend.platform_of(v) for v in var_list]
        self._states = [
            None if _private.overwritten_with_gradient(self, v) else self._make_state(v)
            for v in var_list
        ]

    @property
    def _plans_slots(self) -> bool:
        """Whether `_make_state` can run in `_slots.planning` (only `_slots.add_slot` creates state),
        so `build` checks the slots' layouts before creating anything."""
        return True

    def _make_state(self, variable) -> VariableState:
        """Create the optimizer's state for one model variable (subclasses)."""
        raise NotImplementedError

    def _state_of(self, variable) -> VariableState:
        return self._states[_private.variable_index(self, variable)]

    def _accumulation_window(self, variable):
        """The `window` slot of `variable` (`_accumulates_rows`), or None."""
        state = self._state_of(variable)
        return None if state is None else state.window

    def _platform_of(self, variable) -> str:
        """Where `variable` lives (`"cpu"`, `"gpu"`, `"tpu"`, ...), which picks its kernels."""
        return self._platforms[_private.variable_index(self, variable)]

    # ---------------------------------------------------------------- apply

    def apply(self, grads, trainable_variables=None):
        # NumPy gradients work with Keras's optimizers on every backend; make
        # them backend tensors once, so the torch paths see torch tensors.
        grads = [ops.convert_to_tensor(g) if isinstance(g, np.ndarray) else g for g in grads]
        if not grads:
            raise ValueError(
                f"{type(self).__name__}.apply() received an empty list of gradients; "
                "pass one gradient per trainable variable."
            )
        variables = (
            _private.trainable_variables(self)
            if trainable_variables is None
            else list(trainable_variables)
        )
        if len(variables) == len(grads):
            # Every kernel reads its shapes from the gradient: give it the variable's (checked).
            grads = [
                None
                if g is None
                else backend.checked_gradient(g, v, functools.partial(self._mismatch, v))
                for g, v in zip(grads, variables)
            ]
        self._check_learning_rate_is_scalar()
        if self.loss_scale_factor is not None:
            # Keras unscales with `g / scale`, which tf.IndexedSlices does not
            # support; unscale here, sparse gradients included, instead.
            grads = [
                None if g is None else backend.unscale(g, self.loss_scale_factor) for g in grads
            ]
            loss_scale_factor, self.loss_scale_factor = self.loss_scale_factor, None
            try:
                return self._apply_unscaled(grads, trainable_variables, variables)
            finally:
                self.loss_scale_factor = loss_scale_factor
        return self._apply_unscaled(grads, trainable_variables, variables)

    def _mismatch(self, variable, shape) -> str:
        return (
            f"{type(self).__name__}: the gradient for variable '{_slots.variable_path(variable)}' "
            f"has shape {shape}, but the variable has shape {tuple(variable.shape)}."
        )

    def _apply_unscaled(self, grads, trainable_variables, variables):
        if not self.skip_nonfinite_updates:
            return super().apply(grads, trainable_variables)

        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        finite = self._all_finite(grads)
        state = _private.trainable_variables(self) + list(self.variables)
        backend.apply_if(
            finite, lambda: super(OptimizerBase, self).apply(grads, trainable_variables), state
        )
        return None

    @property
    def _accumulates_rows(self) -> bool:
        """Whether `gradient_accumulation_steps` accumulates the rows of sparse gradients in place (subclasses)."""
        return False

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Keras's hook (_private.ACCUMULATION_HOOK). Replaced only under `gradient_accumulation_steps`, where
        # Keras's would accumulate sparse rows densely or compile both branches eagerly (`_accumulation`).
        _accumulation.apply_gradients(
            self, grads, trainable_variables, super()._backend_apply_gradients
        )

    def _all_finite(self, grads):
        """A scalar boolean tensor: every entry of every gradient is finite."""
        checks = [ops.all(ops.isfinite(backend.gradient_values(g))) for g in grads if g is not None]
        if not checks:
            return ops.convert_to_tensor(True)
        return ops.all(ops.stack(checks))

    def _check_learning_rate_is_scalar(self):
        learning_rate = self.learning_rate
        shape = tuple(getattr(learning_rate, "shape", ()))
        if shape:
            raise ValueError(
                f"{type(self).__name__}: the learning rate must be a scalar, but "
                f"{_private.raw_learning_rate(self)!r} returned a value of shape {shape}."
            )

    def finalize_variable_values(self, var_list):
        """With EMA, install the averages as the model's weights (as Keras does) — as copies.

        Keras assigns each average's own array: on JAX the model variable and its
        average then share one buffer, and the next `fit` (whose jitted step
        donates both) fails with "Attempt to donate the same buffer twice".
        """
        if not self.use_ema:
            return
        self.catch_up_moving_averages()
        averages = _private.moving_averages(self)
        if len(var_list) != len(averages):
            return super().finalize_variable_values(var_list)  # Keras's error.
        for variable, average in zip(var_list, averages):
            if average is not None:
                variable.assign(ops.copy(average.value))

    # ---------------------------------------------------------------- config

    def get_config(self):
        learning_rate = _private.raw_learning_rate(self)
        is_function = (
            callable(learning_rate)
            and not isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule)
            and not isinstance(learning_rate, keras.Variable)
        )
        if is_function:
            # Keras would save the function's bytecode, loadable only with
            # safe_mode=False: save its registered name, or refuse.
            name = _checks.serialize_callable("learning_rate", learning_rate)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras's lambda warning, about what we replace.
                config = super().get_config()
            config["learning_rate"] = name
        else:
            config = super().get_config()
        config["skip_nonfinite_updates"] = self.skip_nonfinite_updates
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if isinstance(config.get("learning_rate"), str):
            config["learning_rate"] = _checks.deserialize_callable(
                "learning_rate", config["learning_rate"], custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)

    # ---------------------------------------------------------------- state

    def catch_up_moving_averages(self):
        """Bring every stored EMA up to date (subclasses that update it lazily); a no-op here."""
        return

    def _optional_state_roles(self) -> frozenset:
        """Roles of state a saved state may lack and `_fill_missing_state` can derive (subclasses)."""
        return frozenset()

    def _fill_missing_state(self, variables) -> None:
        """Set state variables a loaded state lacked (their roles are in `_optional_state_roles`)."""
        raise NotImplementedError

    def save_own_variables(self, store):
        self.catch_up_moving_averages()
        for variable in self.variables:
            # A jax.Array split across processes cannot be written by one process.
            if not getattr(variable.value, "is_fully_addressable", True):
                raise RuntimeError(
                    f"Cannot save the state of {type(self).__name__} '{self.name}' into one file: "
                    f"'{variable.path}' is split across processes and this process holds only its "
                    "part. Checkpoint with keras.callbacks.OrbaxCheckpoint (every process writes its "
                    "part) and resume with keras_tpu_optim.load_checkpoint(model, directory); see "
                    "the README, 'Scaling out'."
                )
        super().save_own_variables(store)
        store[_saving.STATE_SIGNATURE_KEY] = _saving.encode(_saving.describe_state(self))

    def load_own_variables(self, store):
        keys = set(store.keys())
        signature = (
            _saving.decode(store[_saving.STATE_SIGNATURE_KEY])
            if _saving.STATE_SIGNATURE_KEY in keys
            else None
        )
        if signature is None:
            # Not our state (e.g. a model trained with keras.optimizers.Adam and
            # fine-tuned with ours): as Keras does for another optimizer's
            # state, warn and start fresh — never assign it position by position.
            if keys:
                warnings.warn(
                    f"Skipping variable loading for optimizer '{self.name}': the saved optimizer "
                    f"state ({len(keys)} variables) was not written by a keras_tpu_optim "
                    f"optimizer, so it cannot be {type(self).__name__}'s. The optimizer starts fresh.",
                    stacklevel=2,
                )
            return
        this_class = keras.saving.get_registered_name(type(self))
        if signature["class"] != this_class:
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}': the saved state is "
                f"{signature['class']}'s, not {this_class}'s. The optimizer starts fresh.",
                stacklevel=2,
            )
            return
        current = _saving.describe_state(self)
        # State this version derives when the saved one lacks it (e.g. written before it existed).
        saved_roles = {entry["role"] for entry in signature["variables"]}
        missing = [
            i
            for i, entry in enumerate(current["variables"])
            if entry["role"] in self._optional_state_roles() and entry["role"] not in saved_roles
        ]
        kept = [i for i in range(len(current["variables"])) if i not in missing]
        matched = dict(current, variables=[current["variables"][i] for i in kept])
        pairs, differences = _saving.match_variables(signature, matched)
        if differences and not self.built:
            # Saved slots, none here yet. (State without slots, e.g. an unbuilt optimizer's
            # iterations, loads as Keras's does.)
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}', because it has not "
                "been called/built yet. Build it (optimizer.build(model.trainable_variables)) "
                "before loading to restore its state.",
                stacklevel=2,
            )
            return
        if differences:
            raise _saving.mismatch_error(self, signature, current, differences)
        variables = self.variables
        for saved_position, current_position in pairs:
            variables[kept[current_position]].assign(store[str(saved_position)])
        if missing:
            self._fill_missing_state([variables[i] for i in missing])
