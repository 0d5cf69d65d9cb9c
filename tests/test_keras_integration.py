"""Both optimizers in the three ways Keras users train: compile+fit, a hand-written
training step, and with loss scaling / mixed precision, EMA and gradient accumulation.

References: fit against a hand-written loop (Keras guides' style), Keras's own
LossScaleOptimizer/EMA/accumulation semantics re-done by hand in numpy around a
plain optimizer.
"""

import numpy as np
import pytest

import keras

import keras_tpu_optim as kto
from _kto_models import (
    batches_of,
    compile_model,
    custom_training_loop,
    fit_steps,
    gradient_fn,
    loss_object,
    make_data,
    make_model,
    weights_of,
)

BACKEND = keras.backend.backend()
# The transformer's compile is slow on a small CPU: it is trained once, by fit;
# the other checks use the smallest model with factored and unfactored variables.
FIT_CASES = [
    ("transformer", kto.Adafactor, {"learning_rate": 0.1}),
    ("recommender", kto.EmbeddingAdam, {"learning_rate": 0.05}),
]
CASES = [
    ("mlp", kto.Adafactor, {"learning_rate": 0.1}),
    ("recommender", kto.EmbeddingAdam, {"learning_rate": 0.05}),
]
CASE_IDS = ["adafactor", "embedding_adam"]


def _loss(kind):
    return loss_object("xent" if kind == "transformer" else "mse")


@pytest.fixture
def float16_policy():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture
def bfloat16_policy():
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


@pytest.mark.parametrize(
    "kind, cls, kwargs", FIT_CASES, ids=["adafactor-transformer", "embedding_adam-recommender"]
)
def test_fit_loss_falls(kind, cls, kwargs):
    x, y = make_data(kind, 256)
    model = compile_model(make_model(kind), kind, cls(**kwargs))
    history = model.fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses
    if kind == "recommender":
        # Lazy: rows of the big table no batch touched keep their initial values.
        table = keras.ops.convert_to_numpy(model.get_layer("users").embeddings)
        initial = keras.ops.convert_to_numpy(make_model(kind).get_layer("users").embeddings)
        untouched = np.setdiff1d(np.arange(table.shape[0]), x[:, 0])
        np.testing.assert_array_equal(table[untouched], initial[untouched])


@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale_optimizer"])
@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_custom_training_step_matches_fit(kind, cls, kwargs, loss_scale):
    x, y = make_data(kind, 96)

    def optimizer():
        inner = cls(**kwargs)
        return (
            keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**10)
            if loss_scale
            else inner
        )

    fitted = compile_model(make_model(kind), kind, optimizer())
    fit_steps(fitted, x, y, batch_size=32)

    by_hand = make_model(kind)
    hand_optimizer = optimizer()
    custom_training_loop(by_hand, hand_optimizer, _loss(kind), batches_of(x, y, 32))

    assert int(hand_optimizer.iterations) == int(fitted.optimizer.iterations) == 3
    for got, want in zip(weights_of(by_hand), weights_of(fitted)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    initial = weights_of(make_model(kind))
    assert any(not np.array_equal(a, b) for a, b in zip(weights_of(by_hand), initial))


@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_loss_scale_optimizer_is_exact_in_float32(kind, cls, kwargs):
    """Power-of-two loss scaling is exact: LossScaleOptimizer(ours) == ours, step for step."""
    x, y = make_data(kind, 96)
    plain = compile_model(make_model(kind), kind, cls(**kwargs))
    fit_steps(plain, x, y, batch_size=32)
    scaled = compile_model(
        make_model(kind),
        kind,
        keras.optimizers.LossScaleOptimizer(cls(**kwargs), initial_scale=2.0**8),
    )
    fit_steps(scaled, x, y, batch_size=32)
    for got, want in zip(weights_of(scaled), weights_of(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit_lso", "auto_scale_loss"])
@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_mixed_float16_with_loss_scaling(kind, cls, kwargs, auto, float16_policy):
    x, y = make_data(kind, 256)
    model = make_model(kind)
    optimizer = cls(**kwargs) if auto else keras.optimizers.LossScaleOptimizer(cls(**kwargs))
    compile_model(model, kind, optimizer, auto_scale_loss=auto)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, cls)
    history = model.fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
    for variable in model.trainable_variables:
        assert keras.backend.standardize_dtype(variable.dtype) == "float32"
    # Statistics stay float32 whatever the compute dtype.
    for variable in model.optimizer.inner_optimizer.variables[2:]:
        assert keras.backend.standardize_dtype(variable.dtype) == "float32"


@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_mixed_bfloat16(kind, cls, kwargs, bfloat16_policy):
    x, y = make_data(kind, 256)
    model = compile_model(make_model(kind), kind, cls(**kwargs))
    history = model.fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


def _train_by_hand(kind, cls, kwargs, x, y, batch_size, *, ema=None, accumulate=None):
    """The run fit does with `use_ema`/`gradient_accumulation_steps`, re-done in numpy
    around a plain optimizer (the semantics of keras BaseOptimizer's docs)."""
    model = make_model(kind)
    optimizer = cls(**kwargs)
    variables = model.trainable_variables
    compute_gradients = gradient_fn(model, _loss(kind))
    average = None
    accumulated = None
    micro_steps = 0
    for step, (xb, yb) in enumerate(batches_of(x, y, batch_size)):
        grads = compute_gradients(xb, yb)
        grads = [
            np.array(keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(g))) for g in grads
        ]
        if accumulate:
            accumulated = (
                grads if accumulated is None else [a + g for a, g in zip(accumulated, grads)]
            )
            micro_steps += 1
            if micro_steps < accumulate:
                continue
            grads = [a / np.float32(accumulate) for a in accumulated]
            accumulated, micro_steps = None, 0
        optimizer.apply(grads, variables)
        if ema:
            momentum, frequency = ema
            current = [keras.ops.convert_to_numpy(v.value) for v in variables]
            if average is None:
                average = current
            else:
                average = [
                    np.float32(momentum) * a + np.float32(1 - momentum) * w
                    for a, w in zip(average, current)
                ]
            if frequency and (step + 1) % frequency == 0:
                for v, a in zip(variables, average):
                    v.assign(a)
    if ema:  # fit ends with finalize_variable_values: the averages become the weights.
        for v, a in zip(variables, average):
            v.assign(a)
    return weights_of(model)


@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_ema_through_fit_matches_hand_run(kind, cls, kwargs):
    x, y = make_data(kind, 5 * 16)
    model = compile_model(
        make_model(kind),
        kind,
        cls(**kwargs, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=2),
    )
    fit_steps(model, x, y, batch_size=16)
    want = _train_by_hand(kind, cls, kwargs, x, y, 16, ema=(0.8, 2))
    for got, expected in zip(weights_of(model), want):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind, cls, kwargs", CASES, ids=CASE_IDS)
def test_gradient_accumulation_through_fit_matches_hand_run(kind, cls, kwargs):
    x, y = make_data(kind, 5 * 16)  # 5 micro-steps: 2 updates and one pending accumulation.
    model = compile_model(make_model(kind), kind, cls(**kwargs, gradient_accumulation_steps=2))
    fit_steps(model, x, y, batch_size=16)
    want = _train_by_hand(kind, cls, kwargs, x, y, 16, accumulate=2)
    assert int(model.optimizer.iterations) == 2
    for got, expected in zip(weights_of(model), want):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
