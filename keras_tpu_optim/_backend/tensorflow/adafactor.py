"""Adafactor on TensorFlow: CPU-measured reductions, and the step compiled with XLA where nothing else compiles it.

On CPU, TF's XLA backend writes `x^2` to memory before reducing it and runs
reductions on one thread, but fuses a square into a matrix-vector product
(run multithreaded) and into additions. `CpuReductions` therefore computes
row means as products with a vector of ones, and column means after folding
the rows onto an eighth of them. These forms were measured on CPU only:
other platforms use the neutral reductions.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._backend.tensorflow import adafactor_kernel
from keras_tpu_optim._backend.tensorflow._compile import compiled_function, compiling_helps, native_variable
from keras_tpu_optim._backend.tensorflow.gradients import densify
from keras_tpu_optim._math import adafactor as adafactor_math

_FOLDS = 8


def _ones_like_row(x):
    """A `[..., m]` vector of ones XLA cannot fold into a constant (which it would turn back into a reduction).

    Exactly 1 unless `x`'s first row holds a NaN, when every mean is NaN anyway.
    """
    return ops.sign(ops.abs(x[..., 0, :]) + 1.0)


def _row_mean_by_product(x_squared, weights):
    """`mean(x_squared * weights[..., None, :], -1)` as a matrix-vector product."""
    product = ops.matmul(x_squared, ops.expand_dims(weights, -1))
    # The static width may be unknown (tf.distribute replica updates).
    return ops.squeeze(product, -1) / ops.cast(ops.shape(x_squared)[-1], x_squared.dtype)


class CpuReductions(adafactor_math.Reductions):
    """Matrix-vector row means and folded column means (see the module docstring)."""

    def mean_square(self, x):
        if len(x.shape) < 2:
            return super().mean_square(x)
        # Rows first: a reduction to a scalar runs on one thread.
        return ops.mean(_row_mean_by_product(ops.square(x), _ones_like_row(x)))

    def row_mean_of_square(self, x):
        return _row_mean_by_product(ops.square(x), _ones_like_row(x))

    def row_mean_of_weighted_square(self, x, weights):
        return _row_mean_by_product(ops.square(x), weights)

    def column_mean_of_square(self, x):
        rows = x.shape[-2]
        if rows is None or rows < 2 * _FOLDS:
            return super().column_mean_of_square(x)
        # Eight row blocks added onto one: the square fuses into the additions,
        # and the reduction left reads an eighth of the rows.
        height = rows // _FOLDS
        folded = ops.square(x[..., :height, :])
        for block in range(1, _FOLDS):
            folded = folded + ops.square(x[..., block * height : (block + 1) * height, :])
        total = ops.sum(folded, axis=-2)
        if rows % _FOLDS:
            total = total + ops.sum(ops.square(x[..., _FOLDS * height :, :]), axis=-2)
        return total / rows


CPU_REDUCTIONS = CpuReductions()


def adafactor_reductions(platform: str) -> adafactor_math.Reductions:
    """The reductions for a variable on `platform`: the CPU-measured forms on CPU, the neutral ones elsewhere."""
    return CPU_REDUCTIONS if platform == "cpu" else adafactor_math.NEUTRAL


def adafactor_step(optimizer, gradient, variable, learning_rate):
    """One step, by the kernel measured for where it runs.

    Under XLA (`jit_compile=True`), under a `tf.distribute` strategy (its
    replica and mirrored variables stay on TF's own path) or in a stateless
    scope: the neutral step, with the platform's reductions. Otherwise (Keras's
    TF trainer without XLA, eager TF): a float32 variable on CPU takes the
    block kernel (`adafactor_kernel`, no XLA: measured for memory); a variable
    on another platform, or of another dtype, its step compiled on its own with
    XLA (for bfloat16 weights the kernel was slower than XLA, and with
    stochastic rounding, whose integer hash XLA fuses, slower and larger:
    CHANGELOG has the figures).
    """
    gradient = densify(gradient)
    platform = optimizer._platform_of(variable)
    reductions = adafactor_reductions(platform)
    if _private.in_stateless_scope() or not compiling_helps():
        neutral.adafactor_step(optimizer, gradient, variable, learning_rate, reductions)
        return
    state = optimizer._state_of(variable)
    step = optimizer.iterations + 1
    variable_index = _private.variable_index(optimizer, variable)
    # The options' numbers are arguments: one trace serves every value of them.
    structure, option_values = adafactor_math.split_options(optimizer._options)
    if platform == "cpu" and keras.backend.standardize_dtype(variable.dtype) == "float32":
        update = compiled_function(
            optimizer, ("adafactor_blocks", structure), lambda: _blocked_update(structure), xla=False
        )
    else:
        update = compiled_function(
            optimizer, ("adafactor", structure, reductions), lambda: _assigning_update(structure, reductions)
        )
    with adafactor_kernel.after_previous_step() as done:
        done.append(
            update(
                tf.convert_to_tensor(gradient),
                native_variable(variable),
                tuple(native_variable(s) for s in state.slots),
                None if state.momentum is None else native_variable(state.momentum),
                tf.convert_to_tensor(learning_rate),
                tf.convert_to_tensor(step),
                # A tensor, so that one trace serves every variable of a shape.
                tf.constant(variable_index, tf.int32),
                {name: tf.constant(value, tf.float32) for name, value in option_values.items()},
            )
        )


def _blocked_update(structure):
    def update(grad, variable, slots, momentum, learning_rate, step, variable_index, option_values):
        options = adafactor_math.joined_options(structure, option_values)
        assignments = adafactor_kernel.adafactor_step(
            grad, variable, slots, momentum,
            learning_rate=learning_rate, step=step, options=options, variable_index=variable_index,
        )
        with tf.control_dependencies(assignments):
            return tf.zeros([])  # done: the caller orders the next variable's step after it

    return update



def _assigning_update(structure, reductions):
    def update(grad, variable, slots, momentum, learning_rate, step, variable_index, option_values):
        options = adafactor_math.joined_options(structure, option_values)
        delta, new_slots, new_momentum = neutral.adafactor_results(
            grad, variable, tuple(tf.convert_to_tensor(s) for s in slots),
            None if momentum is None else tf.convert_to_tensor(momentum),
            learning_rate=learning_rate, step=step, options=options, reductions=reductions,
        )
        neutral.assign_update(
            variable, delta, slots, new_slots, momentum, new_momentum,
            assign=lambda target, value: target.assign(value),
            assign_sub=lambda target, value: target.assign_sub(value),
            round_to=neutral.variable_rounding(options, step, variable_index, variable.shape),
        )

    return update
