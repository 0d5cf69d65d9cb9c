"""Adafactor on TensorFlow: its CPU evaluations, and where a step runs compiled, inline or in blocks
(docs/algorithms.md#platform-specific-evaluation, "Adafactor on TF in blocks")."""

from __future__ import annotations

import contextlib
import functools
import weakref

import keras
import tensorflow as tf
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import neutral
from keras_tpu_optim._math import blocks
from keras_tpu_optim._backend.tensorflow._compile import (
    compiled_function,
    compiling_helps,
    native_variable,
)
from keras_tpu_optim._backend.tensorflow.gradients import densify
from keras_tpu_optim._math import adafactor as adafactor_math

_FOLDS = 8


def _ones_like_row(x):
    """A `[..., m]` vector of ones XLA cannot fold into a constant (which it would turn back into a reduction):
    exactly 1 unless `x`'s first row holds a NaN, when every sum is NaN anyway."""
    return ops.sign(ops.abs(x[..., 0, :]) + 1.0)


def _last_axis_sum(x_squared, weights):
    """`sum(x_squared * weights[..., None, :], -1)` as a matrix-vector product."""
    return ops.squeeze(ops.matmul(x_squared, ops.expand_dims(weights, -1)), -1)


class CpuEvaluation(adafactor_math.Evaluation):
    """Matrix-vector sums over the last axis, folded sums over the next-to-last (module docstring)."""

    def square_sums(self, x, axes):
        square, ndim = ops.square(x), len(x.shape)
        sums = []
        for axis in axes:
            if ndim >= 2 and axis == ndim - 2 and (x.shape[-2] or 0) >= 2 * _FOLDS:
                sums.append(self._folded_square_sum(x))
            elif ndim >= 2 and axis in (None, ndim - 1):
                row_sums = _last_axis_sum(square, _ones_like_row(x))
                sums.append(row_sums if axis == ndim - 1 else super().sum(row_sums, None))
            else:
                sums.append(super().sum(square, axis))
        return tuple(sums)

    def _folded_square_sum(self, x):
        rows = x.shape[-2]
        # Eight row blocks added onto one: the square fuses into the additions, and the reduction left
        # reads an eighth of the rows.
        height = rows // _FOLDS
        folded = ops.square(x[..., :height, :])
        for block in range(1, _FOLDS):
            folded = folded + ops.square(x[..., block * height : (block + 1) * height, :])
        total = ops.sum(folded, axis=-2)
        if rows % _FOLDS:
            total = total + ops.sum(ops.square(x[..., _FOLDS * height :, :]), axis=-2)
        return total

    def weighted_square_sum(self, x, weights, axis):
        ndim = len(x.shape)
        if ndim >= 2 and axis == ndim - 1 and len(weights.shape) == ndim and weights.shape[-2] == 1:
            return _last_axis_sum(ops.square(x), ops.squeeze(weights, -2))
        return super().weighted_square_sum(x, weights, axis)


CPU_EVALUATION = CpuEvaluation()


class GraphCpuEvaluation(CpuEvaluation):
    """Without XLA, where each op runs as written: a block's column sums as a transposed matrix-vector
    product (a fold would write its eight squares), and the parameter's sum of squares as a dot
    product (no `x^2` written)."""

    def square_sums(self, x, axes):
        if len(x.shape) < 2:
            return super().square_sums(x, axes)
        square, sums = None, []
        for axis in axes:
            if axis is None:
                flat = tf.reshape(x, [-1])
                sums.append(tf.tensordot(flat, flat, 1))
                continue
            square = ops.square(x) if square is None else square
            if axis == len(x.shape) - 2:
                sums.append(tf.linalg.matvec(square, tf.ones(tf.shape(x)[-2:-1]), transpose_a=True))
            elif axis == len(x.shape) - 1:
                sums.append(_last_axis_sum(square, _ones_like_row(x)))
            else:
                sums.append(ops.sum(square, axis=axis))
        return tuple(sums)


GRAPH_CPU_EVALUATION = GraphCpuEvaluation()


def adafactor_evaluation(platform: str) -> adafactor_math.Evaluation:
    """How a step of a variable on `platform` is evaluated: the CPU forms on CPU, the neutral ones elsewhere."""
    return CPU_EVALUATION if platform == "cpu" else adafactor_math.NEUTRAL


def adafactor_step(gradient, variable, state, *, platform, cache, **numbers):
    """One step, evaluated as measured for where it runs (module docstring): inline under XLA, `tf.distribute`
    or a stateless scope; else a float32 CPU variable in blocks without XLA, any other compiled with XLA."""
    gradient, evaluation = densify(gradient), adafactor_evaluation(platform)
    if _private.in_stateless_scope() or not compiling_helps():
        neutral.adafactor_step(
            gradient, variable, state.slots, state.momentum, evaluation=evaluation, **numbers
        )
        return
    # The options' numbers are arguments: one trace serves every value of them.
    structure, option_values = adafactor_math.split_options(numbers["options"])
    blocked = platform == "cpu" and keras.backend.standardize_dtype(variable.dtype) == "float32"
    evaluation = None if blocked else evaluation
    update = compiled_function(
        cache,
        ("adafactor", structure, evaluation),
        lambda: functools.partial(assigning_step, structure=structure, evaluation=evaluation),
        xla=not blocked,
    )
    with after_previous_step() as done:
        done.append(
            update(
                tf.convert_to_tensor(gradient),
                native_variable(variable),
                tuple(native_variable(s) for s in state.slots),
                None if state.momentum is None else native_variable(state.momentum),
                tf.convert_to_tensor(numbers["learning_rate"]),
                tf.convert_to_tensor(numbers["step"]),
                # A tensor, so that one trace serves every variable of a shape.
                tf.constant(numbers["variable_index"], tf.int32),
                {name: tf.constant(value, tf.float32) for name, value in option_values.items()},
            )
        )


def assigning_step(
    grad,
    variable,
    slots,
    momentum,
    learning_rate,
    step,
    variable_index,
    option_values,
    *,
    structure,
    evaluation=None,
    chunk_elements=blocks.CHUNK_ELEMENTS,
):
    """One step of `tf.Variable`s through their assignments (`evaluation` None: in blocks of `chunk_elements`);
    returns a tensor ready once they are done."""
    if evaluation is None:
        evaluation = blocks.Blocked(
            tuple(variable.shape), GRAPH_CPU_EVALUATION, tf.control_dependencies, chunk_elements
        )
    # Each variable's own assignment: the compiled function returns once they have run (its stateful ops
    # are its control outputs).
    neutral.adafactor_step(
        grad,
        variable,
        slots,
        momentum,
        **neutral.step_numbers((learning_rate, step, variable_index, option_values), structure),
        evaluation=evaluation,
        assign=tf.compat.v1.assign,
        assign_sub=tf.compat.v1.assign_sub,
    )
    return tf.zeros([])


# The last step built in each graph: the next variable's step is ordered after it.
_last_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def after_previous_step():
    """Order the ops built inside after the last step built in this graph (eagerly a no-op); yields a list
    for this step's final ops."""
    if tf.executing_eagerly():
        yield []
        return
    graph = tf.compat.v1.get_default_graph()
    previous = _last_step.get(graph)
    final_ops = []
    with tf.control_dependencies([] if previous is None else [previous]):
        yield final_ops
    final_ops = [op for op in final_ops if op is not None]
    if final_ops:
        _last_step[graph] = tf.group(*final_ops)
