"""The base class both optimizers share: checks before anything is updated, safe configs, a
checked saved state, and an optional skip of non-finite steps."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import keras
import numpy as np
from keras import ops

from keras_tpu_optim import _accumulation, _backend, _checks, _private, _saving, _slots
from keras_tpu_optim._backend import backend


# The keywords of Keras's base optimizer (and ours) that both optimizers pass on to `OptimizerBase`.
BASE_KEYWORDS = (
    "learning_rate name weight_decay clipnorm clipvalue global_clipnorm use_ema ema_momentum "
    "ema_overwrite_frequency loss_scale_factor gradient_accumulation_steps skip_nonfinite_updates"
).split()


class VariableState(NamedTuple):
    """An optimizer's state for one model variable; `window`: see `EmbeddingAdam._accumulates_rows`."""

    slots: tuple
    momentum: Optional[keras.Variable] = None
    window: Optional[keras.Variable] = None


class OptimizerBase(keras.optimizers.Optimizer):
    """What both optimizers add to `keras.optimizers.Optimizer`: every check before any variable changes; a
    callable `learning_rate` saved by its registered name (loads with `safe_mode=True`); a saved state
    signature checked on load; `skip_nonfinite_updates` (a step with a NaN/Inf gradient changes nothing)."""

    # The subclass's own hyperparameters: plain attributes, as on Keras's optimizers, checked when set by its
    # `_checked_hyperparameters(values)`; its `_decides_state(name, value)`: whether that changes the slots.
    _HYPERPARAMETERS: frozenset = frozenset()
    # Roles of state a saved state may lack: the subclass's `_fill_missing_state` derives them.
    _OPTIONAL_STATE_ROLES: frozenset = frozenset()
    # Whether `_make_state` can run in `_slots.planning`, to check the layouts before creating anything.
    _plans_slots = True
    # Whether `gradient_accumulation_steps` accumulates the rows of sparse gradients in place (subclasses).
    _accumulates_rows = False

    def __init__(self, skip_nonfinite_updates=False, **kwargs):
        _backend.get()  # A backend we do not support: refused here.
        _checks.check_base_arguments(**kwargs)
        _checks.check_layout_map(type(self), kwargs.get("name"))
        super().__init__(**kwargs)
        # What the backend keeps for this optimizer (compiled functions, buffers), out of Keras's tracking.
        self.__dict__["_backend_cache"] = {}
        self.skip_nonfinite_updates = _checks.check_bool(
            "skip_nonfinite_updates", skip_nonfinite_updates
        )

    def __setattr__(self, name, value):
        # A hyperparameter set after construction is checked as the constructor checks it.
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
        """The constructor's last step: the checked `values` become the attributes."""
        for name, value in self._checked_hyperparameters(values).items():
            setattr(self, name, value)
        self._hyperparameters_set = True

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
        stateful = [not _private.overwritten_with_gradient(self, v) for v in var_list]
        with backend.state_creation_scope():
            if self._plans_slots:
                with _slots.planning(self) as planned:
                    for variable, has_state in zip(var_list, stateful):
                        if has_state:
                            self._make_state(variable)
                _checks.check_slot_layouts(type(self), planned)
            super().build(var_list)
            _slots.record_keras_roles(self)
            self._platforms = [backend.platform_of(v) for v in var_list]
            self._states = [self._make_state(v) if s else None for v, s in zip(var_list, stateful)]

    def _state_of(self, variable) -> VariableState:
        return self._states[_private.variable_index(self, variable)]

    def _accumulation_window(self, variable):
        """The `window` slot of `variable` (`_accumulates_rows`), or None."""
        return getattr(self._state_of(variable), "window", None)

    def apply(self, grads, trainable_variables=None):
        # NumPy gradients work with Keras's optimizers: made tensors once, so torch paths see torch tensors.
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
        shape = tuple(getattr(self.learning_rate, "shape", ()))
        if shape:
            raise ValueError(
                f"{type(self).__name__}: the learning rate must be a scalar, but "
                f"{_private.raw_learning_rate(self)!r} returned a value of shape {shape}."
            )
        if self.loss_scale_factor is not None:
            # Keras unscales with `g / scale`, which tf.IndexedSlices does not support; a gradient that
            # overwrites its variable (a layer's trained table, its step count) is not scaled.
            kept = (
                [_private.overwritten_with_gradient(self, v) for v in variables]
                if len(variables) == len(grads)
                else [False] * len(grads)
            )
            grads = [
                g if g is None or keep else backend.unscale(g, self.loss_scale_factor)
                for g, keep in zip(grads, kept)
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
        checks = [ops.all(ops.isfinite(backend.gradient_values(g))) for g in grads if g is not None]
        finite = ops.all(ops.stack(checks)) if checks else ops.convert_to_tensor(True)
        state = _private.trainable_variables(self) + list(self.variables)
        backend.apply_if(
            finite, lambda: super(OptimizerBase, self).apply(grads, trainable_variables), state
        )
        return None

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Keras's hook (_private.ACCUMULATION_HOOK), replaced under `gradient_accumulation_steps` only.
        _accumulation.apply_gradients(
            self, grads, trainable_variables, super()._backend_apply_gradients
        )

    def finalize_variable_values(self, var_list):
        """With EMA, install copies of the averages as the weights: Keras's own arrays would share a buffer
        with the averages on JAX, which the next `fit`'s jitted step cannot donate twice."""
        if not self.use_ema:
            return
        self.catch_up_moving_averages()
        averages = _private.moving_averages(self)
        if len(var_list) != len(averages):
            return super().finalize_variable_values(var_list)  # Keras's error.
        for variable, average in zip(var_list, averages):
            if average is not None:
                variable.assign(ops.copy(average.value))

    def get_config(self):
        learning_rate = _private.raw_learning_rate(self)
        schedule = keras.optimizers.schedules.LearningRateSchedule
        if callable(learning_rate) and not isinstance(learning_rate, (schedule, keras.Variable)):
            # Keras would save its bytecode (safe_mode=False only): its registered name, or refuse.
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

    def catch_up_moving_averages(self):
        """Bring every stored EMA up to date (subclasses that update it lazily); a no-op here."""
        return

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
        keys, key = set(store.keys()), _saving.STATE_SIGNATURE_KEY
        signature = _saving.decode(store[key]) if key in keys else None
        if signature is None:
            # Not ours (e.g. keras.optimizers.Adam's): warn and start fresh, as Keras does for another's.
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
        lacking = self._OPTIONAL_STATE_ROLES - {entry["role"] for entry in signature["variables"]}
        missing = [i for i, entry in enumerate(current["variables"]) if entry["role"] in lacking]
        kept = [i for i in range(len(current["variables"])) if i not in missing]
        matched = dict(current, variables=[current["variables"][i] for i in kept])
        pairs, differences = _saving.match_variables(signature, matched)
        if differences and not self.built:
            # Saved slots, none here yet (state without slots loads as Keras's does).
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
