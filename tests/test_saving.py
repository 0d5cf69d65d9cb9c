"""Saving: configs and variables round-trip, safe loading, and state that does not fit
this optimizer. (Exact resume in a fresh process and cross-backend files: integration/.)

References: the uninterrupted run (bit for bit, same backend), Keras's own
behaviour for other optimizers' state, and the values before saving.
"""

import json
import warnings
import zipfile

import numpy as np
import pytest

import keras

import keras_tpu_optim as kto
from _kto_models import compile_model, fit_steps, make_data, make_model, optimizer_state, weights_of

BACKEND = keras.backend.backend()
# Keras 3.15's `optimizers.get("name")` deserializes the name, so a registered name
# ("keras_tpu_optim>Adafactor") finds our class; 3.16's looks among Keras's own optimizers only.
KERAS_GETS_REGISTERED_NAMES = tuple(int(part) for part in keras.__version__.split(".")[:2]) < (
    3,
    16,
)


def _trained(kind, optimizer, steps=3, batch_size=16):
    x, y = make_data(kind, steps * batch_size)
    model = compile_model(make_model(kind), kind, optimizer)
    fit_steps(model, x, y, batch_size)
    return model


def _with_state(kind, optimizer, seed=0):
    """A compiled model whose optimizer is built and holds state unlike a fresh one's (every variable set to
    other values, as training would), without tracing a train step: for tests of what loading that state does."""
    model = compile_model(make_model(kind), kind, optimizer)
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(seed)
    for variable in optimizer.variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        integral = "int" in dtype
        values = (
            rng.integers(1, 4, variable.shape)
            if integral
            else rng.uniform(0.5, 1.5, variable.shape)
        )
        variable.assign(keras.ops.cast(values.astype("int32" if integral else "float32"), dtype))
    return model


# ------------------------------------------------- config and variables


ROUND_TRIP_CASES = [
    (
        "mlp",
        lambda: kto.Adafactor(
            learning_rate=0.05,
            beta_1=0.9,
            min_dim_size_to_factor=2,
            relative_step=False,
            clipnorm=1.0,
            use_ema=True,
            ema_overwrite_frequency=2,
            skip_nonfinite_updates=True,
        ),
    ),
    (
        "recommender",
        lambda: kto.EmbeddingAdam(
            learning_rate=0.01,
            sum_inside_sqrt=False,
            clipvalue=(-1.0, None),
            weight_decay_factor=0.01,
            multiply_weight_decay_factor_by_learning_rate=True,
            clip_weight_min=-5.0,
            low_dimensional_packing_status=True,
            gradient_accumulation_steps=2,
            skip_nonfinite_updates=True,
        ),
    ),
    ("mlp", lambda: keras.optimizers.LossScaleOptimizer(kto.Adafactor(0.05))),
    (
        "mlp",
        lambda: kto.Adafactor(
            learning_rate=0.05,
            beta_1=0.9,
            momentum_dtype="bfloat16",
            factored_dims="two_largest",
            decay_offset=1,
            beta_2_cap=0.9,
            stochastic_rounding=True,
            seed=5,
        ),
    ),
    (
        "recommender",
        lambda: kto.EmbeddingAdam(
            learning_rate=0.01,
            second_moment="rowwise",
            bias_correction="per_row",
            weight_decay=0.01,
            clipvalue=0.5,
            skip_nonfinite_updates=True,
        ),
    ),
]


@pytest.mark.parametrize(
    "kind, make",
    ROUND_TRIP_CASES,
    ids=[
        "adafactor",
        "embedding_adam",
        "loss_scaled_adafactor",
        "adafactor_options",
        "embedding_adam_rowwise_per_row",
    ],
)
def test_load_model_restores_config_and_every_variable(kind, make, tmp_path):
    model = _trained(kind, make())
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)  # default safe_mode=True
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    saved, restored = optimizer_state(model.optimizer), optimizer_state(loaded.optimizer)
    assert len(saved) == len(restored) > 2
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights_of(model), weights_of(loaded)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", [kto.Adafactor, kto.EmbeddingAdam])
def test_serialize_deserialize_and_lookup_by_registered_name(cls):
    name = f"keras_tpu_optim>{cls.__name__}"
    assert keras.saving.get_registered_name(cls) == name
    assert keras.saving.get_registered_object(name) is cls
    if KERAS_GETS_REGISTERED_NAMES:
        looked_up = keras.optimizers.get(name)
    else:
        # If this fails, Keras looks registered names up again: assert it as on 3.15.
        with pytest.raises(ValueError, match="Could not interpret optimizer identifier"):
            keras.optimizers.get(name)
        looked_up = keras.optimizers.get({"class_name": name, "config": {}})
    assert type(looked_up) is cls
    # Unnamed instances are auto-named as Keras's are ("adafactor", "adafactor_1", ...).
    assert looked_up.get_config() == dict(cls().get_config(), name=looked_up.name)

    optimizer = cls(learning_rate=0.02, clipnorm=2.0, skip_nonfinite_updates=True)
    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == name
    restored = keras.optimizers.deserialize(json.loads(json.dumps(serialized)))
    assert type(restored) is cls and restored.get_config() == optimizer.get_config()
    assert restored.skip_nonfinite_updates is True
    assert keras.optimizers.get(serialized).get_config() == optimizer.get_config()


@pytest.mark.parametrize(
    "options",
    [
        {"second_moment": "rowwise"},
        {"bias_correction": "per_row"},
        {
            "second_moment": "rowwise",
            "bias_correction": "per_row",
            "weight_decay": 0.01,
            "clipvalue": 0.5,
        },
    ],
    ids=["rowwise", "per_row", "both"],
)
def test_embedding_adam_new_state_saves_loads_and_resumes_exactly(options, tmp_path):
    """Save in the middle, load, continue: the same numbers as the uninterrupted run (row_steps, rowwise v)."""
    x, y = make_data("recommender", 6 * 16)
    make = lambda: kto.EmbeddingAdam(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5), **options
    )
    uninterrupted = compile_model(make_model("recommender"), "recommender", make())
    fit_steps(uninterrupted, x[:48], y[:48], 16)
    path = str(tmp_path / "m.keras")
    uninterrupted.save(path)
    fit_steps(uninterrupted, x[48:], y[48:], 16)

    resumed = keras.saving.load_model(path)
    names = [v.name for v in resumed.optimizer.variables]
    if options.get("bias_correction") == "per_row":
        steps = [v for v in resumed.optimizer.variables if v.name.endswith("row_steps")]
        assert len(steps) == 2 and all(
            keras.backend.standardize_dtype(v.dtype) == "int32" for v in steps
        ), names
        assert int(np.max(keras.ops.convert_to_numpy(steps[0]))) > 0
    fit_steps(resumed, x[48:], y[48:], 16)
    for a, b in zip(optimizer_state(uninterrupted.optimizer), optimizer_state(resumed.optimizer)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights_of(uninterrupted), weights_of(resumed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "options",
    [{}, {"second_moment": "rowwise", "bias_correction": "per_row"}],
    ids=["defaults", "rowwise_per_row"],
)
def test_embedding_adam_lazy_ema_saves_loads_and_resumes_exactly(options, tmp_path):
    """Lazy EMA: save in the middle (every row caught up), load, continue: the uninterrupted run's numbers."""
    x, y = make_data("recommender", 6 * 16)
    make = lambda: kto.EmbeddingAdam(
        0.02, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=4, **options
    )
    uninterrupted = compile_model(make_model("recommender"), "recommender", make())
    uninterrupted.fit(
        x[:48], y[:48], batch_size=16, epochs=1, shuffle=False, verbose=0
    )  # ends with finalize
    path = str(tmp_path / "m.keras")
    uninterrupted.save(path)
    steps = [
        keras.ops.convert_to_numpy(v)
        for v in uninterrupted.optimizer.variables
        if v.name.endswith("average_steps")
    ]
    assert steps and all(np.all(s == 3) for s in steps)  # saving caught every row up
    uninterrupted.fit(x[48:], y[48:], batch_size=16, epochs=1, shuffle=False, verbose=0)

    resumed = keras.saving.load_model(path)
    resumed.fit(x[48:], y[48:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    uninterrupted.optimizer.catch_up_moving_averages()
    resumed.optimizer.catch_up_moving_averages()
    for a, b in zip(optimizer_state(uninterrupted.optimizer), optimizer_state(resumed.optimizer)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(weights_of(uninterrupted), weights_of(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------- safe mode


@keras.saving.register_keras_serializable(package="kto_tests")
def constant_learning_rate():
    return 0.05


@keras.saving.register_keras_serializable(package="kto_tests")
def make_slots_with_names(variable, slot_names, initializers):
    return {
        name: keras.Variable(init(variable.shape, "float32"), name=f"user_{name}", trainable=False)
        for name, init in zip(slot_names, initializers)
    }


def test_registered_callables_are_saved_by_name_and_load_in_safe_mode(tmp_path):
    for kind, optimizer in [
        ("mlp", kto.Adafactor(learning_rate=constant_learning_rate)),
        ("recommender", kto.EmbeddingAdam(slot_variable_creation_fn=make_slots_with_names)),
    ]:
        model = _trained(kind, optimizer, steps=2)
        path = str(tmp_path / f"{kind}.keras")
        model.save(path)
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))["compile_config"]["optimizer"][
                "config"
            ]
        if kind == "mlp":
            assert config["learning_rate"] == "kto_tests>constant_learning_rate"
        else:
            assert config["slot_variable_creation_fn"] == "kto_tests>make_slots_with_names"
        loaded = keras.saving.load_model(path)  # safe_mode=True
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
        for a, b in zip(optimizer_state(model.optimizer), optimizer_state(loaded.optimizer)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kind, make, argument",
    [
        ("mlp", lambda: kto.Adafactor(learning_rate=lambda: 0.05), "learning_rate"),
        (
            "recommender",
            lambda: kto.EmbeddingAdam(
                slot_variable_creation_fn=lambda v, names, inits: make_slots_with_names(
                    v, names, inits
                )
            ),
            "slot_variable_creation_fn",
        ),
    ],
    ids=["learning_rate_lambda", "slot_fn_lambda"],
)
def test_unregistered_callable_refuses_to_save(kind, make, argument, tmp_path):
    model = _trained(kind, make(), steps=1)
    path = tmp_path / "m.keras"
    with pytest.raises(
        ValueError,
        match=rf"(?s)`{argument}`.*not registered serializable.*register_keras_serializable",
    ):
        model.save(str(path))
    # Nothing written that would need safe_mode=False.
    if path.exists():
        with pytest.raises(Exception):
            keras.saving.load_model(str(path))


def test_learning_rate_schedule_round_trips(tmp_path):
    schedule = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=10, alpha=0.1)
    model = _trained("mlp", kto.Adafactor(learning_rate=schedule), steps=2)
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, keras.optimizers.schedules.CosineDecay)
    assert restored.get_config() == schedule.get_config()
    np.testing.assert_allclose(float(loaded.optimizer.learning_rate), float(schedule(2)), rtol=1e-6)


# ----------------------------------------------- state that does not fit


MISMATCH_CASES = [
    # saved optimizer, loading optimizer, what the error must name
    (
        "mlp",
        lambda: kto.Adafactor(),
        lambda: kto.Adafactor(min_dim_size_to_factor=16),
        ["row_second_moment", "second_moment", "min_dim_size_to_factor"],
    ),
    (
        "mlp",
        lambda: kto.Adafactor(),
        lambda: kto.Adafactor(beta_1=0.9),
        ["momentum", "beta_1"],
    ),
    (
        "mlp",  # Same number, shapes and dtypes of variables, other meaning: Keras assigns silently.
        lambda: kto.Adafactor(use_ema=True),
        lambda: kto.Adafactor(gradient_accumulation_steps=2),
        ["average", "gradient_accumulator", "use_ema", "gradient_accumulation_steps"],
    ),
    (
        "recommender",
        lambda: kto.EmbeddingAdam(use_ema=True),
        lambda: kto.EmbeddingAdam(),
        ["average", "use_ema"],
    ),
    (
        "mlp",  # The (8, 1) kernel: row statistics (8,) over the last two, (1,) over the two largest.
        lambda: kto.Adafactor(),
        lambda: kto.Adafactor(factored_dims="two_largest"),
        ["row_second_moment", "factored_dims"],
    ),
    (
        "mlp",
        lambda: kto.Adafactor(beta_1=0.9),
        lambda: kto.Adafactor(beta_1=0.9, momentum_dtype="bfloat16"),
        ["momentum", "bfloat16", "momentum_dtype"],
    ),
    (
        "recommender",
        lambda: kto.EmbeddingAdam(second_moment="rowwise"),
        lambda: kto.EmbeddingAdam(),
        ["velocities", "second_moment"],
    ),
    (
        "recommender",
        lambda: kto.EmbeddingAdam(bias_correction="per_row"),
        lambda: kto.EmbeddingAdam(),
        ["row_steps", "bias_correction"],
    ),
]


def _layout(kind, make):
    model = compile_model(make_model(kind), kind, make())
    model.optimizer.build(model.trainable_variables)
    return [
        (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
        for v in model.optimizer.variables
    ]


@pytest.mark.parametrize(
    "kind, make_saved, make_loading, named",
    MISMATCH_CASES,
    ids=[
        "factoring",
        "momentum",
        "ema_vs_accumulation_same_count",
        "ema",
        "factored_dims",
        "momentum_dtype",
        "rowwise",
        "per_row",
    ],
)
def test_load_weights_of_differently_configured_optimizer_raises(
    kind, make_saved, make_loading, named, tmp_path
):
    model = _with_state(kind, make_saved())
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)

    target = compile_model(make_model(kind, seed=7), kind, make_loading())
    target.optimizer.build(target.trainable_variables)
    before = optimizer_state(target.optimizer)
    with pytest.raises(ValueError) as error:
        target.load_weights(path)
    message = str(error.value)
    for word in named:
        assert word in message, message
    for a, b in zip(before, optimizer_state(target.optimizer)):
        np.testing.assert_array_equal(a, b)  # Nothing half-loaded.


def test_the_same_count_case_is_one_keras_would_assign_silently():
    kind, make_saved, make_loading, _ = MISMATCH_CASES[2]
    assert _layout(kind, make_saved) == _layout(kind, make_loading)


def test_load_model_with_state_that_does_not_fit_its_config_raises(tmp_path):
    """A .keras whose optimizer config no longer matches its saved state (edited, or
    written by a version that factored differently) fails loudly, naming the setting."""
    model = _trained("mlp", kto.Adafactor(), steps=2)
    path = tmp_path / "m.keras"
    model.save(str(path))
    edited = tmp_path / "edited.keras"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(edited, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                config["compile_config"]["optimizer"]["config"]["min_dim_size_to_factor"] = 16
                data = json.dumps(config).encode()
            target.writestr(item, data)
    with pytest.raises(ValueError, match=r"(?s)row_second_moment.*min_dim_size_to_factor"):
        keras.saving.load_model(str(edited))


def test_skip_mismatch_turns_the_error_into_a_warning(tmp_path):
    kind, make_saved, make_loading, _ = MISMATCH_CASES[0]
    model = _with_state(kind, make_saved())
    model.save_weights(str(tmp_path / "m.weights.h5"))
    target = compile_model(make_model(kind), kind, make_loading())
    target.optimizer.build(target.trainable_variables)
    with pytest.warns(UserWarning, match="row_second_moment"):
        target.load_weights(str(tmp_path / "m.weights.h5"), skip_mismatch=True)
    assert int(target.optimizer.iterations) == 0


@pytest.mark.parametrize(
    "kind, make_saved, make_loading",
    [
        ("mlp", lambda: keras.optimizers.Adam(0.01), lambda: kto.Adafactor()),
        ("recommender", lambda: keras.optimizers.Adam(0.01), lambda: kto.EmbeddingAdam()),
        # Ours, but another class: its state is not this optimizer's either.
        ("mlp", lambda: kto.Adafactor(), lambda: kto.EmbeddingAdam()),
    ],
    ids=["keras_adam_to_adafactor", "keras_adam_to_embedding_adam", "adafactor_to_embedding_adam"],
)
def test_another_optimizers_state_warns_and_starts_fresh(kind, make_saved, make_loading, tmp_path):
    model = _trained(kind, make_saved(), steps=2)
    path = str(tmp_path / "m.keras")
    model.save(path)

    fine_tuned = compile_model(make_model(kind, seed=9), kind, make_loading())
    fine_tuned.optimizer.build(fine_tuned.trainable_variables)
    fresh = optimizer_state(fine_tuned.optimizer)
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        fine_tuned.load_weights(path)
    for a, b in zip(fresh, optimizer_state(fine_tuned.optimizer)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights_of(model), weights_of(fine_tuned)):  # The model's weights do load.
        np.testing.assert_array_equal(a, b)
    # And training goes on from there.
    x, y = make_data(kind, 32)
    fit_steps(fine_tuned, x, y, 16)
    assert int(fine_tuned.optimizer.iterations) == 2


def test_keras_adam_refuses_our_state_the_keras_way(tmp_path):
    """The extra signature entry keeps Keras's own optimizers on their count check."""
    model = _trained("mlp", kto.EmbeddingAdam(), steps=2)
    model.save_weights(str(tmp_path / "m.weights.h5"))
    target = compile_model(make_model("mlp"), "mlp", keras.optimizers.Adam())
    target.optimizer.build(target.trainable_variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load_weights(str(tmp_path / "m.weights.h5"))
    assert any("Skipping variable loading" in str(w.message) for w in caught)
    assert int(target.optimizer.iterations) == 0


@pytest.mark.parametrize("cls", [kto.Adafactor, kto.EmbeddingAdam])
def test_unbuilt_optimizer_pickles_silently_as_keras_does(cls):
    """Keras's own optimizers restore an unbuilt optimizer's iterations and learning rate silently."""
    import pickle

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        restored = pickle.loads(pickle.dumps(cls(learning_rate=0.02)))
    assert type(restored) is cls
    assert float(keras.ops.convert_to_numpy(restored.learning_rate)) == pytest.approx(0.02)


def test_saved_slots_into_an_unbuilt_optimizer_warn_and_change_nothing():
    model = _trained("mlp", kto.Adafactor(learning_rate=0.01))
    store = {}
    model.optimizer.save_own_variables(store)
    fresh = kto.Adafactor(learning_rate=0.01)
    with pytest.warns(UserWarning, match="not been called/built yet"):
        fresh.load_own_variables(store)
    assert int(keras.ops.convert_to_numpy(fresh.iterations)) == 0
