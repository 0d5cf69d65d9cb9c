"""The base class both optimizers share: input checks before anything is updated."""

from __future__ import annotations

import keras


def _static_shape(gradient, variable):
    """The gradient's shape as a tuple (None for unknown dims), sparse gradients included."""
    values = getattr(gradient, "values", None)
    if values is not None and hasattr(gradient, "indices") and not callable(values):
        # tf.IndexedSlices: rows along axis 0, the rest must match.
        return (variable.shape[0],) + tuple(values.shape[1:])
    return tuple(gradient.shape)


class OptimizerBase(keras.optimizers.Optimizer):
    """Adds what Keras leaves unchecked: every check runs before any variable changes."""

    def build(self, var_list):
        for variable in var_list:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            if not dtype.startswith(("float", "bfloat")):
                raise ValueError(
                    f"{type(self).__name__} can only optimize floating-point variables; "
                    f"variable '{variable.path}' has dtype {dtype}."
                )
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            raise ValueError(
                f"{type(self).__name__}.apply() received an empty list of gradients; "
                "pass one gradient per trainable variable."
            )
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        if variables is not None and len(variables) == len(grads):
            for gradient, variable in zip(grads, variables):
                if gradient is None:
                    continue
                shape = _static_shape(gradient, variable)
                if len(shape) != len(variable.shape) or any(
                    g is not None and g != v for g, v in zip(shape, variable.shape)
                ):
                    raise ValueError(
                        f"{type(self).__name__}: the gradient for variable '{variable.path}' "
                        f"has shape {shape}, but the variable has shape {tuple(variable.shape)}."
                    )
        return super().apply(grads, trainable_variables)
