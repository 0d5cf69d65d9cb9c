"""Bad input: a clear ValueError naming the problem, and no variable changed.
Non-finite gradients: skipped under LossScaleOptimizer and with
`skip_nonfinite_updates=True`; propagated (as in Keras) by default."""

import numpy as np
import pytest

import keras

import keras_tpu_optim as kto
from _kto_models import compile_model, fit_steps, make_data, make_model, optimizer_state, weights_of

BACKEND = keras.backend.backend()
OPTIMIZERS = [kto.Adafactor, kto.EmbeddingAdam]


def _variables():
    return [
        keras.Variable(np.arange(12, dtype="float32").reshape(3, 4) / 10, name="kernel"),
        keras.Variable(np.ones(4, dtype="float32"), name="bias"),
    ]


def _snapshot(optimizer, variables):
    return [
        keras.ops.convert_to_numpy(v.value).copy()
        for v in list(variables) + list(optimizer.variables)
    ]


def _assert_unchanged(before, optimizer, variables):
    after = _snapshot(optimizer, variables)
    assert len(after) == len(before)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def _grads(value=0.5):
    return [np.full((3, 4), value, "float32"), np.full((4,), value, "float32")]


# ------------------------------------------------------- hyperparameters

COMMON_BAD = [
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"weight_decay": -1.0}, "weight_decay"),
    ({"clipnorm": 0.0}, "clipnorm"),
    ({"global_clipnorm": -1.0}, "global_clipnorm"),
    ({"clipnorm": 1.0, "global_clipnorm": 1.0}, "Only one of"),
    ({"use_ema": True, "ema_momentum": 1.5}, "ema_momentum"),
    ({"use_ema": True, "ema_overwrite_frequency": 0}, "ema_overwrite_frequency"),
    ({"loss_scale_factor": 0.0}, "loss_scale_factor"),
    ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps"),
    ({"skip_nonfinite_updates": "yes"}, "skip_nonfinite_updates"),
    ({"not_an_argument": 1}, "not_an_argument"),
]
ADAFACTOR_BAD = [
    ({"beta_2_decay": 0.5}, "beta_2_decay"),
    ({"epsilon_1": 0.0}, "epsilon_1"),
    ({"epsilon_2": -1.0}, "epsilon_2"),
    ({"clip_threshold": 0.0}, "clip_threshold"),
    ({"relative_step": "no"}, "relative_step"),
    ({"beta_1": 1.0}, "beta_1"),
    ({"min_dim_size_to_factor": 0}, "min_dim_size_to_factor"),
    ({"multiply_by_parameter_scale": None}, "multiply_by_parameter_scale"),
    ({"clipvalue": -1.0}, "clipvalue"),
]
EMBEDDING_ADAM_BAD = [
    ({"beta_1": 1.0}, "beta_1"),
    ({"beta_2": -0.1}, "beta_2"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"lazy_adam": False, "use_gradient_accumulation": False}, "use_gradient_accumulation"),
    ({"clipvalue": 1.0, "use_gradient_accumulation": False}, "clipvalue"),
    ({"clip_weight_min": 1.0, "clip_weight_max": 0.0}, "clip_weight_min"),
    ({"clipvalue": (2.0, 1.0)}, "clipvalue"),
    ({"slot_variable_creation_fn": "zeros"}, "slot_variable_creation_fn"),
    ({"weight_decay": 0.1, "weight_decay_factor": 0.1}, "weight_decay_factor"),
    ({"max_touched_rows": 0}, "max_touched_rows"),
    ({"second_moment": "diagonal"}, "second_moment"),
    ({"second_moment": None}, "second_moment"),
    ({"bias_correction": "row"}, "bias_correction"),
    ({"bias_correction": True}, "bias_correction"),
    ({"momentum_dtype": "float16"}, "momentum_dtype"),
    ({"velocity_dtype": "int8"}, "velocity_dtype"),
    ({"stochastic_rounding": "yes"}, "stochastic_rounding"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**31}, "seed"),
]
BAD = [(kto.Adafactor, k, w) for k, w in COMMON_BAD + ADAFACTOR_BAD] + [
    (kto.EmbeddingAdam, k, w) for k, w in COMMON_BAD + EMBEDDING_ADAM_BAD
]


@pytest.mark.parametrize(
    "cls, kwargs, named",
    BAD,
    ids=[f"{c.__name__}-{'-'.join(map(str, k))}-{i}" for i, (c, k, _) in enumerate(BAD)],
)
def test_invalid_hyperparameter_names_the_argument(cls, kwargs, named):
    with pytest.raises(ValueError, match=named):
        cls(**kwargs)


# ------------------------------------------------------------ variables


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_non_float_variable_is_refused_before_any_slot_exists(cls):
    variables = [
        keras.Variable(np.ones((3, 4), "float32"), name="ok"),
        keras.Variable(np.ones(4, "int32"), name="ids", trainable=False),
    ]
    optimizer = cls()
    with pytest.raises(ValueError, match=r"floating-point.*'ids'.*int32"):
        optimizer.build(variables)
    assert not optimizer.built and len(optimizer.variables) == 2  # iteration, learning_rate
    with pytest.raises(ValueError, match="floating-point"):
        cls().apply([np.ones((3, 4), "float32"), np.ones(4, "int32")], variables)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_gradient_of_the_wrong_shape_changes_nothing(cls):
    variables = _variables()
    optimizer = cls(learning_rate=0.1)
    optimizer.apply(_grads(), variables)
    before = _snapshot(optimizer, variables)
    bad = [np.full((3, 4), 0.5, "float32"), np.full((5,), 0.5, "float32")]
    with pytest.raises(ValueError, match=r"gradient for variable 'bias' has shape \(5,\).*\(4,\)"):
        optimizer.apply(bad, variables)
    _assert_unchanged(before, optimizer, variables)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_empty_gradient_list_is_an_error(cls):
    variables = _variables()
    optimizer = cls()
    optimizer.build(variables)
    before = _snapshot(optimizer, variables)
    with pytest.raises(ValueError, match="empty list of gradients"):
        optimizer.apply([], variables)
    _assert_unchanged(before, optimizer, variables)


class VectorSchedule(keras.optimizers.schedules.LearningRateSchedule):
    def __call__(self, step):
        return keras.ops.ones((4,)) * 0.1

    def get_config(self):
        return {}


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_schedule_returning_a_non_scalar_is_an_error(cls):
    variables = _variables()
    optimizer = cls(learning_rate=VectorSchedule())
    optimizer.build(variables)
    before = _snapshot(optimizer, variables)
    with pytest.raises(ValueError, match=r"learning rate must be a scalar.*shape \(4,\)"):
        optimizer.apply(_grads(), variables)
    _assert_unchanged(before, optimizer, variables)


# ------------------------------------------------------------ non-finite


def _loss_scaled_apply(optimizer, grads, variables):
    """LossScaleOptimizer's apply on TF/torch; on JAX its stateless_apply under jax.jit
    (how JAX trains: Keras's eager LossScaleOptimizer.apply leaks tracers there)."""
    if BACKEND != "jax":
        return optimizer.apply(grads, variables)
    import jax

    if not optimizer.built:
        optimizer.build(variables)
    new_variables, new_state = jax.jit(optimizer.stateless_apply)(
        [v.value for v in optimizer.variables], grads, [v.value for v in variables]
    )
    for variable, value in zip(
        list(variables) + list(optimizer.variables), list(new_variables) + list(new_state)
    ):
        variable.assign(value)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_loss_scale_optimizer_skips_a_non_finite_step(cls, bad_value):
    variables = _variables()
    optimizer = keras.optimizers.LossScaleOptimizer(cls(learning_rate=0.1), initial_scale=8.0)
    _loss_scaled_apply(optimizer, _grads(), variables)
    before = _snapshot(optimizer.inner_optimizer, variables)
    grads = _grads()
    grads[0][1, 2] = bad_value
    _loss_scaled_apply(optimizer, grads, variables)
    _assert_unchanged(before, optimizer.inner_optimizer, variables)
    assert float(optimizer.dynamic_scale) == 4.0  # Halved, as Keras does.
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_skip_nonfinite_updates_skips_the_whole_step(cls):
    variables = _variables()
    optimizer = cls(
        learning_rate=0.1, skip_nonfinite_updates=True, use_ema=True, gradient_accumulation_steps=2
    )
    reference_variables = _variables()
    reference = cls(learning_rate=0.1, use_ema=True, gradient_accumulation_steps=2)

    optimizer.apply(_grads(0.5), variables)
    reference.apply(_grads(0.5), reference_variables)
    before = _snapshot(optimizer, variables)
    for bad_value in (np.nan, np.inf, -np.inf):
        grads = _grads(0.25)
        grads[1][3] = bad_value
        optimizer.apply(grads, variables)
        _assert_unchanged(
            before, optimizer, variables
        )  # variables, slots, EMA, accumulators, iterations
    # Then it carries on exactly as if the bad steps never happened.
    for value in (0.25, -0.5, 0.125):
        optimizer.apply(_grads(value), variables)
        reference.apply(_grads(value), reference_variables)
    for a, b in zip(_snapshot(optimizer, variables), _snapshot(reference, reference_variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_by_default_non_finite_gradients_propagate_like_keras(cls):
    variables = _variables()
    optimizer = cls(learning_rate=0.1)
    grads = _grads()
    grads[0][0, 0] = np.nan
    optimizer.apply(grads, variables)
    assert np.isnan(keras.ops.convert_to_numpy(variables[0].value)).any()
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize(
    "kind, cls",
    [("mlp", kto.Adafactor), ("recommender", kto.EmbeddingAdam)],
    ids=["adafactor", "embedding_adam"],
)
def test_skip_nonfinite_updates_inside_compiled_fit(kind, cls):
    """In fit (tf.function / jax.jit / torch): a batch with a NaN target is skipped
    entirely, so the run equals the run without that batch, bit for bit."""
    x, y = make_data(kind, 48)
    poisoned_y = np.concatenate([y[:16], np.full_like(y[:16], np.nan), y[16:]])
    poisoned_x = np.concatenate([x[:16], x[:16], x[16:]])
    skipping = compile_model(
        make_model(kind), kind, cls(learning_rate=0.05, skip_nonfinite_updates=True)
    )
    fit_steps(skipping, poisoned_x, poisoned_y, 16)
    clean = compile_model(make_model(kind), kind, cls(learning_rate=0.05))
    fit_steps(clean, x, y, 16)
    assert int(skipping.optimizer.iterations) == int(clean.optimizer.iterations) == 3
    for a, b in zip(
        weights_of(skipping) + optimizer_state(skipping.optimizer),
        weights_of(clean) + optimizer_state(clean.optimizer),
    ):
        np.testing.assert_array_equal(a, b)


def _sparse_gradient(ids, values, shape):
    """The backend's sparse gradient: a `tf.IndexedSlices`, a torch sparse COO tensor, a JAX BCOO."""
    ids, values = np.asarray(ids, "int32"), np.asarray(values, "float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.IndexedSlices(tf.constant(values), tf.constant(ids), tf.constant(shape))
    if BACKEND == "torch":
        import torch

        return torch.sparse_coo_tensor(
            torch.tensor(ids[None], dtype=torch.long), torch.tensor(values), shape
        )
    from jax.experimental import sparse

    return sparse.BCOO((values, ids[:, None]), shape=shape)


SPARSE_MODES = ["eager", "function", "jit_compile"] if BACKEND == "tensorflow" else ["eager"]


@pytest.mark.parametrize("mode", SPARSE_MODES)
@pytest.mark.parametrize("lazy_adam", [True, False], ids=["lazy", "not_lazy"])
@pytest.mark.parametrize("bad_id", [-1, 3, 2**30])
def test_sparse_gradient_ids_out_of_range_train_nothing(bad_id, lazy_adam, mode):
    """A sparse gradient's entries whose ids are outside the table train nothing (the layers' rule): the step
    is the step of the valid entries alone, to the bit, on every backend's sparse gradient and TF's modes."""

    def stepped(ids, values):
        table = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4) / 10, name="table")
        optimizer = kto.EmbeddingAdam(learning_rate=0.1, lazy_adam=lazy_adam)
        optimizer.build([table])
        gradient = _sparse_gradient(ids, values, (3, 4))
        if mode == "eager":
            optimizer.apply([gradient], [table])
        else:
            import tensorflow as tf

            tf.function(
                lambda: optimizer.apply([gradient], [table]), jit_compile=mode == "jit_compile"
            )()
        return _snapshot(optimizer, [table])

    values = np.arange(12, dtype="float32").reshape(3, 4) - 5
    for got, want in zip(stepped([1, bad_id, 1], values), stepped([1, 1], values[[0, 2]])):
        np.testing.assert_array_equal(got, want)
