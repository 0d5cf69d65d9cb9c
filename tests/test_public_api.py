"""The public API is the documented API: names, signatures, and hyperparameters that take effect when set.

References: Keras's own optimizer for the inherited names, the constructors'
signatures and docstrings for ours, the numpy references for the numbers.
"""

import inspect

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from tests.reference.numpy_adafactor import NumpyAdafactor
from tests.reference.numpy_embedding_adam import NumpyEmbeddingAdam

# Beyond the constructor's arguments (each one an attribute, as on Keras's optimizers).
DOCUMENTED_METHODS = {
    kto.EmbeddingAdam: {"catch_up_moving_averages"},
    kto.Adafactor: {"catch_up_moving_averages"},
}


def public_names(obj):
    return {name for name in dir(obj) if not name.startswith("_")}


@pytest.mark.parametrize("cls", [kto.EmbeddingAdam, kto.Adafactor], ids=lambda c: c.__name__)
def test_public_names_beyond_keras_are_the_documented_arguments_and_methods(cls):
    variable = keras.Variable(np.ones((8, 4), "float32"))
    keras_optimizer = keras.optimizers.Optimizer(learning_rate=0.1)
    keras_optimizer.build([keras.Variable(np.ones((8, 4), "float32"))])
    ours = cls()
    ours.build([variable])
    arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    assert public_names(ours) - public_names(keras_optimizer) == (
        arguments | DOCUMENTED_METHODS[cls]
    ) - public_names(keras_optimizer)
    assert arguments <= public_names(ours)  # every argument reads back as an attribute
    doc = cls.__doc__
    for name in arguments | DOCUMENTED_METHODS[cls]:
        assert name in doc, f"{cls.__name__}'s docstring does not document {name}"
    assert inspect.signature(cls.__init__).parameters["skip_nonfinite_updates"].default is False


def test_package_exports_what_its_docstring_lists():
    assert set(kto.__all__) == {
        "Adafactor",
        "EmbeddingAdam",
        "layers",
        "load_checkpoint",
        "tpu",
        "__version__",
    }
    for name in kto.__all__[:-1]:
        assert f"`{name}" in kto.__doc__ or f"keras_tpu_optim.{name}" in kto.__doc__, name


def test_adafactor_hyperparameters_set_after_a_step_take_effect_at_the_next():
    rng = np.random.default_rng(3)
    init = rng.normal(size=(6, 5)).astype("float32")
    grads = [rng.normal(size=(6, 5)).astype("float32") for _ in range(3)]
    variable = keras.Variable(init)
    ours, reference = kto.Adafactor(0.05, beta_1=0.9), NumpyAdafactor(0.05, beta_1=0.9)
    params = [init.astype(np.float64)]
    for step, gradient in enumerate(grads):
        if step == 1:
            for optimizer in (ours, reference):
                optimizer.clip_threshold, optimizer.epsilon_2, optimizer.beta_2_decay = (
                    0.05,
                    0.3,
                    -0.5,
                )
                optimizer.beta_1, optimizer.relative_step = 0.5, False
        ours.apply([keras.ops.convert_to_tensor(gradient)], [variable])
        params = reference.step(params, [gradient.astype(np.float64)])
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(variable), params[0], rtol=2e-5, atol=1e-6
        )
    assert ours.clip_threshold == 0.05 and ours.get_config()["clip_threshold"] == 0.05


def test_embedding_adam_hyperparameters_set_after_a_step_take_effect_at_the_next():
    rng = np.random.default_rng(4)
    init = rng.normal(size=(10, 4)).astype("float32")
    table = keras.Variable(init)
    ours, reference = kto.EmbeddingAdam(0.05), NumpyEmbeddingAdam(init, 0.05)
    for step in range(3):
        gradient = rng.normal(size=(10, 4)).astype("float32")
        gradient[rng.permutation(10)[:4]] = 0.0  # untouched rows
        if step == 1:
            ours.epsilon, ours.clip_weight_max, ours.weight_decay_factor, ours.clipvalue = (
                0.3,
                0.2,
                0.1,
                0.4,
            )
            reference.row_options.update(epsilon=0.3, clip_weight_max=0.2, weight_decay_factor=0.1)
            reference.clipvalue = 0.4
        ours.apply([keras.ops.convert_to_tensor(gradient)], [table])
        reference.apply_dense(gradient)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(table), reference.weights, rtol=2e-5, atol=1e-6
        )
    assert ours.get_config()["epsilon"] == 0.3


def test_a_hyperparameter_set_is_checked_and_one_that_decides_the_state_is_fixed_once_built():
    adafactor, embedding_adam = kto.Adafactor(), kto.EmbeddingAdam()
    with pytest.raises(ValueError, match="clip_threshold"):
        adafactor.clip_threshold = -1.0
    with pytest.raises(ValueError, match="epsilon"):
        embedding_adam.epsilon = 0.0
    with pytest.raises(ValueError, match="weight_decay_factor"):
        embedding_adam.weight_decay_factor = -0.5
    assert (
        adafactor.clip_threshold == 1.0 and embedding_adam.epsilon == 1e-7
    )  # unchanged by a refused value
    adafactor.factored_dims, embedding_adam.second_moment = (
        "two_largest",
        "rowwise",
    )  # not built yet: allowed
    adafactor.build([keras.Variable(np.ones((4, 3), "float32"))])
    embedding_adam.build([keras.Variable(np.ones((4, 3), "float32"))])
    assert adafactor._state_of(adafactor._trainable_variables[0]).slots[0].shape == (
        3,
    )  # two_largest: rows of 4
    for optimizer, name, value in [
        (adafactor, "factored_dims", "last_two"),
        (adafactor, "beta_1", 0.9),
        (adafactor, "momentum_dtype", "bfloat16"),
        (embedding_adam, "lazy_adam", False),
        (embedding_adam, "second_moment", "full"),
        (embedding_adam, "bias_correction", "per_row"),
    ]:
        with pytest.raises(ValueError, match=f"{name}.*built"):
            setattr(optimizer, name, value)
    adafactor.epsilon_1 = 1e-20  # a number: still settable
    assert adafactor.epsilon_1 == 1e-20


def test_steps_check_no_hyperparameter_again():
    """Hyperparameters are checked when set, once: a step reads them, and checks nothing again."""
    variable = keras.Variable(np.ones((6, 4), "float32"))
    for optimizer, name in (
        (kto.Adafactor(0.01, beta_1=0.5), "epsilon_1"),
        (kto.EmbeddingAdam(0.01, clipvalue=1.0, clipnorm=2.0), "epsilon"),
    ):
        checks = []
        checked = optimizer._checked_hyperparameters
        optimizer._checked_hyperparameters = lambda values: checks.append(values) or checked(values)
        optimizer.build([variable])
        for _ in range(2):
            optimizer.apply([keras.ops.ones((6, 4))], [variable])
        assert checks == []
        setattr(optimizer, name, 1e-6)
        assert len(checks) == 1 and getattr(optimizer, name) == 1e-6
