"""Adafactor on TF without XLA (CPU): the statistics in blocks, one variable at a time, in TF's own ops.

Keras's TF trainer runs `fit` without XLA on a machine without an
accelerator. TF's executor then keeps every op's output until its last
consumer has run, and runs whatever is ready: the neutral step's full-size
intermediates (`g^2`, the update, its square) of every variable can be alive
at once. Compiling each variable's step with XLA instead bounds them, but
each XLA compilation keeps its own code and compiler heap in the process,
one per variable shape, however small the model.

Here the reductions (the row and column statistics, RMS(update), the
parameter's RMS) read the gradient a block of its leading axis at a time
(`blocks.CHUNK_ELEMENTS`), each block ordered after the previous one, so that
their intermediates are block-sized; the update itself is one chain of
elementwise products, which TF computes in the gradient's buffer when nothing
else holds it. In a graph, each variable's step is ordered after the previous
variable's (`after_previous_step`), so that one variable's temporaries exist
at a time, as with an eager step.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import tensorflow as tf

from keras_tpu_optim._backend import blocks, neutral
from keras_tpu_optim._math import adafactor as adafactor_math

# The last step built in each graph: the next variable's step is ordered after it.
_last_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def after_previous_step():
    """Order the ops built inside after the last step built in this graph; record this step's ops.

    Yields a list; the step appends its final ops (the assignments). Eager
    ops run in program order already: a no-op there.
    """
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


def _after(dependency):
    """Build the next ops after `dependency` (a tensor, or None: no ordering)."""
    return tf.control_dependencies([] if dependency is None else [dependency])


def _part(x, span, rows: int, has_leading_axis: bool = True):
    """Block `span` of x's leading axis; x itself if it has none (`has_leading_axis` False, or a size-1 axis that broadcasts)."""
    if span is None or not has_leading_axis or x.shape.rank == 0 or x.shape[0] != rows or span == (0, rows):
        return x
    start, length = span
    return x[start : start + length]


def _block_sums(x, spans, rows, block_sums):
    """Per block of x (float32), `block_sums(block)` (a tuple of tensors), each block built after the previous one's."""
    results, previous = [], None
    for span in spans:
        with _after(previous):
            sums = block_sums(tf.cast(_part(x, span, rows), tf.float32), span)
        results.append(sums)
        previous = sums[0]
    return results


def _square_sum(x):
    """`sum(x^2)` as a dot product of x with itself: no `x^2` written (faster on CPU: the benchmark's TF rows)."""
    flat = tf.reshape(x, [-1])
    return tf.tensordot(flat, flat, 1)


def _total(values):
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def adafactor_step(
    grad,
    variable,
    second_moment_slots,
    momentum,
    *,
    learning_rate,
    step,
    options: adafactor_math.AdafactorOptions,
    variable_index=0,
    chunk_elements: int = blocks.CHUNK_ELEMENTS,
):
    """One Adafactor step for one `tf.Variable`, through its assignments; returns them (graph) or [] (eager).

    `second_moment_slots` is `(row, column)` for a factored variable, else
    `(v,)` (float32 `tf.Variable`s); `momentum` a float32 or bfloat16
    `tf.Variable`, or None. `step` is `iterations + 1` (an integer tensor),
    `variable_index` keys stochastic rounding's random bits. A variable of
    another dtype than float32 is updated in float32 and rounded once.

    Factored variables: the statistics, then RMS(update), each a pass over the
    blocks of the leading axis (`chunk_elements` elements each); then the
    update, `g * row_factor * column_factor`, at full size. Unfactored
    variables (vectors, and matrices with `min_dim_size_to_factor`) take the
    neutral step, whole: their `v` slot is as big as they are anyway.
    """
    o = options
    shape = tuple(variable.shape)
    rows = shape[0] if shape else 1
    spans = blocks.spans(shape, chunk_elements)
    numel = max(1, math.prod(shape))
    learning_rate = tf.cast(learning_rate, tf.float32)
    step_float = tf.cast(step, tf.float32)
    rho = adafactor_math.relative_step_size(learning_rate, step_float, o.relative_step)
    beta2_t = adafactor_math.second_moment_decay(step_float, o.beta_2_decay, o.decay_offset, o.beta_2_cap)
    alpha = rho
    if o.multiply_by_parameter_scale:
        sums = _block_sums(variable.read_value(), spans, rows, lambda x, span: (_square_sum(x),))
        mean_square = _total([s[0] for s in sums]) / numel
        alpha = tf.maximum(o.epsilon_2, tf.sqrt(mean_square)) * rho

    axes = o.factored_axes(shape)
    if axes is None:
        (v,) = second_moment_slots
        g = tf.cast(grad, tf.float32)
        new_v = adafactor_math.unfactored_second_moment(tf.square(g) + o.epsilon_1, v.read_value(), beta2_t)
        update = g * tf.math.rsqrt(new_v)
        update_mean_square = tf.reduce_mean(tf.square(update))
        delta = update * (alpha * adafactor_math.clip_factor(update_mean_square, o.clip_threshold))
        new_slots = (new_v,)
    else:
        a, b = axes
        a_in_row = a - (b < a)
        last_two = (a, b) == (len(shape) - 2, len(shape) - 1)

        def statistic_sums(g, span):
            """The block's sums of g^2 over axis b (rows' statistics) and over axis a (columns')."""
            square = tf.square(g)
            if last_two:  # Matrix-vector products with ones: measured faster than TF's reductions on CPU.
                return (
                    tf.linalg.matvec(square, tf.ones([square.shape[-1]])),
                    tf.linalg.matvec(square, tf.ones([square.shape[-2]]), transpose_a=True),
                )
            return tf.reduce_sum(square, axis=b), tf.reduce_sum(square, axis=a)

        sums = _block_sums(grad, spans, rows, statistic_sums)
        # A sum over the leading axis (the blocks' axis) adds the blocks; any other is one per block.
        row_sum = _total([s[0] for s in sums]) if b == 0 else tf.concat([s[0] for s in sums], axis=0)
        column_sum = _total([s[1] for s in sums]) if a == 0 else tf.concat([s[1] for s in sums], axis=0)
        row, column = second_moment_slots
        new_row = beta2_t * row.read_value() + (1.0 - beta2_t) * (row_sum / shape[b] + o.epsilon_1)
        new_column = beta2_t * column.read_value() + (1.0 - beta2_t) * (column_sum / shape[a] + o.epsilon_1)
        row_factor = tf.math.rsqrt(new_row / tf.reduce_mean(new_row, axis=a_in_row, keepdims=True))
        column_factor = tf.math.rsqrt(new_column)

        if last_two:
            # mean(u^2) = mean_i(r_i^2 * sum_j(g_ij^2 c_j^2)) / m: the update is never formed here.
            row_factor_sq, column_factor_sq = tf.square(row_factor), tf.square(column_factor)

            def update_square_sum(g, span):
                weighted = tf.linalg.matvec(tf.square(g), _part(column_factor_sq, span, rows, a != 0))
                return (tf.reduce_sum(_part(row_factor_sq, span, rows, b != 0) * weighted),)

        else:
            row_factor_full, column_factor_full = tf.expand_dims(row_factor, b), tf.expand_dims(column_factor, a)

            def update_square_sum(g, span):
                update = g * _part(row_factor_full, span, rows, b != 0)
                update = update * _part(column_factor_full, span, rows, a != 0)
                return (_square_sum(update),)

        square_sums = _block_sums(grad, spans, rows, update_square_sum)
        update_mean_square = _total([s[0] for s in square_sums]) / numel
        scale = alpha * adafactor_math.clip_factor(update_mean_square, o.clip_threshold)
        # The scalars ride on the row factor: two full-size products, in the gradient's buffer where TF can.
        delta = tf.cast(grad, tf.float32) * tf.expand_dims(row_factor * scale, b) * tf.expand_dims(column_factor, a)
        new_slots = (new_row, new_column)

    new_momentum = None
    if o.beta_1 is not None:
        new_momentum = o.beta_1 * tf.cast(momentum.read_value(), tf.float32) + (1.0 - o.beta_1) * delta
        delta = new_momentum
    assignments = []

    def assign(target, value):
        assignments.append(target.assign(value, read_value=False))

    def assign_sub(target, value):
        assignments.append(target.assign_sub(value, read_value=False))

    neutral.assign_update(
        variable, delta, second_moment_slots, new_slots, momentum, new_momentum,
        assign=assign, assign_sub=assign_sub,
        round_to=neutral.variable_rounding(o, step, variable_index, shape),
    )
    return [op for op in assignments if op is not None]

