"""Every evaluation of Adafactor's one formula gives the neutral evaluation's numbers.

A platform changes how the sums of `_math.adafactor`'s formula are evaluated, never the formula:
blocks of the leading axis, variables stacked on a leading axis, a backend's CPU forms, torch's
and TF's steps written in place. Each runs here on the inputs of the neutral whole-array
evaluation (which tests/test_adafactor.py checks against numpy, optax and Keras), 1-D, 2-D and
3-D, factored and unfactored, with momentum and bf16 stochastic rounding; so a change to the
formula is one change, and reaches every platform.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from keras_tpu_optim import _backend
from keras_tpu_optim._math import blocks
from keras_tpu_optim._math import adafactor as adafactor_math

BACKEND = keras.backend.backend()


class _Batched(adafactor_math.Evaluation):
    """Variables of one shape stacked on a leading axis (as the torch grouped step evaluates them)."""

    batch_dims = 1


SHAPES = [(70,), (37, 5), (6, 16, 3)]
OPTIONS = {
    "default": {},
    "momentum": dict(beta_1=0.9, decay_offset=1, beta_2_cap=0.9),
    "two_largest_bf16_momentum": dict(
        factored_dims="two_largest", beta_1=0.5, momentum_dtype="bfloat16"
    ),
    "unfactored_no_param_scale": dict(min_dim_size_to_factor=6, multiply_by_parameter_scale=False),
    "stochastic_rounding": dict(stochastic_rounding=True, seed=5, beta_1=0.9),
}
STEPS = 3


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    param = rng.normal(size=shape).astype(np.float32)
    grads = [
        (10.0 ** rng.uniform(-1, 1) * rng.normal(size=shape)).astype(np.float32)
        for _ in range(STEPS)
    ]
    return param, grads


def _zero_state(shape, options):
    axes = options.factored_axes(shape)
    if axes is None:
        slots = [np.zeros(shape, np.float32)]
    else:
        a, b = axes
        slots = [
            np.zeros([d for i, d in enumerate(shape) if i != b], np.float32),
            np.zeros([d for i, d in enumerate(shape) if i != a], np.float32),
        ]
    return slots, (None if options.beta_1 is None else np.zeros(shape, np.float32))


def _formula_steps(param, grads, options, evaluation, batch=False):
    """Steps of `adafactor_update` with `evaluation` on float32 arrays; the float32 values after each."""
    shape = param.shape[1:] if batch else param.shape
    slots, momentum = _zero_state(shape, options)
    if batch:
        slots = [np.stack([s] * param.shape[0]) for s in slots]
        momentum = None if momentum is None else np.stack([momentum] * param.shape[0])
    values = [ops.convert_to_tensor(param)]
    slots = [ops.convert_to_tensor(s) for s in slots]
    momentum = None if momentum is None else ops.convert_to_tensor(momentum)
    history = []
    for t, grad in enumerate(grads):
        delta, slots, momentum = adafactor_math.adafactor_update(
            ops.convert_to_tensor(grad),
            values[-1],
            tuple(slots),
            momentum,
            learning_rate=ops.convert_to_tensor(0.3),
            step=ops.convert_to_tensor(float(t + 1)),
            options=options,
            factored_axes=options.factored_axes(shape),
            evaluation=evaluation,
        )
        if momentum is not None and options.momentum_dtype == "bfloat16":
            momentum_stored = ops.cast(ops.cast(momentum, "bfloat16"), "float32")
        else:
            momentum_stored = momentum
        values.append(values[-1] - delta)
        history.append([ops.convert_to_numpy(x) for x in (values[-1], *slots)])
        momentum = momentum_stored
    return history


def _evaluations(shape):
    evaluations = {
        "blocks_of_one_row": blocks.Blocked(shape, chunk_elements=1),
        "blocks_of_40": blocks.Blocked(shape, chunk_elements=40),
    }
    if BACKEND == "jax":
        evaluations["jax_cpu"] = _backend.get().CPU_EVALUATION
    if BACKEND == "tensorflow":
        from keras_tpu_optim._backend.tensorflow import adafactor as tf_adafactor

        evaluations["tensorflow_cpu"] = tf_adafactor.adafactor_evaluation("cpu")
        evaluations["tensorflow_cpu_in_blocks"] = blocks.Blocked(
            shape, tf_adafactor.CPU_EVALUATION, chunk_elements=40
        )
        evaluations["tensorflow_graph_cpu_in_blocks"] = blocks.Blocked(
            shape, tf_adafactor.GRAPH_CPU_EVALUATION, chunk_elements=40
        )
    if BACKEND == "torch":
        from keras_tpu_optim._backend.torch import adafactor as torch_adafactor

        evaluations["torch_norms_in_blocks"] = blocks.Blocked(
            shape, torch_adafactor.TorchEvaluation(), chunk_elements=40
        )
    return evaluations


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rank_{len(s)}")
def test_each_evaluation_gives_the_neutral_numbers(shape, name):
    options = adafactor_math.AdafactorOptions(**OPTIONS[name])
    param, grads = _data(shape, seed=len(shape))
    neutral_history = _formula_steps(param, grads, options, adafactor_math.NEUTRAL)
    for label, evaluation in _evaluations(shape).items():
        for step, (want, got) in enumerate(
            zip(neutral_history, _formula_steps(param, grads, options, evaluation))
        ):
            for x, y in zip(want, got):
                np.testing.assert_allclose(
                    y, x, rtol=2e-5, atol=1e-6, err_msg=f"{label}, step {step + 1}"
                )
    # Stacked with another variable of the shape: each keeps its own sums and scalars.
    other, other_grads = _data(shape, seed=9)
    stacked = _formula_steps(
        np.stack([param, other]),
        [np.stack(g) for g in zip(grads, other_grads)],
        options,
        _Batched(),
        batch=True,
    )
    other_history = _formula_steps(other, other_grads, options, adafactor_math.NEUTRAL)
    for step, (want, want_other, got) in enumerate(zip(neutral_history, other_history, stacked)):
        for x, x_other, y in zip(want, want_other, got):
            np.testing.assert_allclose(
                y[0], x, rtol=2e-5, atol=1e-6, err_msg=f"stacked, step {step + 1}"
            )
            np.testing.assert_allclose(
                y[1], x_other, rtol=2e-5, atol=1e-6, err_msg=f"stacked, step {step + 1}"
            )
    assert not np.allclose(neutral_history[-1][0], param)


def _neutral_variable(param, grads, options, dtype, variable_index):
    """The whole neutral step as the optimizers apply it: the variable rounded once per step to `dtype`."""
    shape = param.shape
    slots, momentum = _zero_state(shape, options)
    value = ops.cast(ops.convert_to_tensor(param), dtype)
    slots = tuple(ops.convert_to_tensor(s) for s in slots)
    momentum = (
        None
        if momentum is None
        else ops.cast(ops.convert_to_tensor(momentum), options.momentum_dtype)
    )
    for t, grad in enumerate(grads):
        step = ops.convert_to_tensor(t + 1)
        delta, slots, new_momentum = adafactor_math.float32_update(
            ops.cast(ops.convert_to_tensor(grad), dtype),
            value,
            slots,
            momentum,
            learning_rate=0.3,
            step=step,
            options=options,
            evaluation=adafactor_math.NEUTRAL,
        )
        momentum = None if momentum is None else ops.cast(new_momentum, options.momentum_dtype)
        value = adafactor_math.subtracted(
            value, delta, adafactor_math.rounding(options, step, variable_index, shape)
        )
    return ops.convert_to_numpy(ops.cast(value, "float32"))


def _in_place_steps(param, grads, options, dtype, variable_index):
    """The backend's own in-place steps (torch: in blocks and grouped; TF: in blocks), by label."""
    shape = param.shape
    results = {}
    if BACKEND == "torch":
        import torch

        from keras_tpu_optim._backend.torch import adafactor as torch_adafactor

        torch_dtype = getattr(torch, dtype)
        for label in ("blocked", "grouped"):
            slots, momentum = _zero_state(shape, options)
            value = torch.tensor(param).to(torch_dtype)
            slots = tuple(torch.tensor(s) for s in slots)
            momentum = (
                None
                if momentum is None
                else torch.tensor(momentum).to(getattr(torch, options.momentum_dtype))
            )
            for t, grad in enumerate(grads):
                kwargs = dict(
                    learning_rate=torch.tensor(0.3), step=torch.tensor(t + 1), options=options
                )
                grad = torch.tensor(grad).to(torch_dtype)
                if label == "blocked":
                    torch_adafactor.blocked_step(
                        grad,
                        value,
                        slots,
                        momentum,
                        variable_index=variable_index,
                        chunk_elements=40,
                        **kwargs,
                    )
                else:
                    member = torch_adafactor.Member(value, grad, slots, momentum)
                    axes = options.factored_axes(shape) if len(slots) == 2 else None
                    scalars = adafactor_math.step_scalars(
                        kwargs["learning_rate"], kwargs["step"].to(torch.float32), options
                    )
                    torch_adafactor.grouped_step(
                        [member],
                        step=kwargs["step"],
                        scalars=scalars,
                        options=options,
                        axes=axes,
                        indices=torch.tensor([variable_index]),
                    )
            results[label] = value.to(torch.float32).numpy()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        from keras_tpu_optim._backend.tensorflow import adafactor as tf_adafactor

        slots, momentum = _zero_state(shape, options)
        value = tf.Variable(tf.cast(param, dtype))
        slots = tuple(tf.Variable(s) for s in slots)
        momentum = (
            None if momentum is None else tf.Variable(tf.cast(momentum, options.momentum_dtype))
        )
        for t, grad in enumerate(grads):
            structure, option_values = adafactor_math.split_options(options)
            tf_adafactor.assigning_step(
                tf.cast(grad, dtype),
                value,
                slots,
                momentum,
                tf.constant(0.3),
                tf.constant(t + 1),
                variable_index,
                option_values,
                structure=structure,
                chunk_elements=40,
            )
        results["blocked"] = tf.cast(value, tf.float32).numpy()
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["momentum", "two_largest_bf16_momentum", "stochastic_rounding"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rank_{len(s)}")
def test_in_place_steps_give_the_neutral_step(shape, name, dtype):
    if BACKEND == "jax":
        pytest.skip(
            "JAX has no in-place step: its state is immutable, each step the neutral evaluation's"
        )
    options = adafactor_math.AdafactorOptions(**OPTIONS[name])
    param, grads = _data(shape, seed=3)
    want = _neutral_variable(param, grads, options, dtype, variable_index=4)
    results = _in_place_steps(param, grads, options, dtype, variable_index=4)
    assert results
    for label, got in results.items():
        if dtype == "float32":
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=label)
        else:
            # The same roundings (random bits included); float32 sums in another order may move a value across
            # a rounding threshold.
            assert np.mean(got == want) > 0.99, label
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=label)
    assert not np.allclose(want, param, rtol=1e-3)
