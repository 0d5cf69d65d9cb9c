"""Saving: configs and variables round-trip, exact resume in a fresh process, safe
loading, cross-backend files, and state that does not fit this optimizer.

References: the uninterrupted run (bit for bit, same backend), Keras's own
behaviour for other optimizers' state, and the values before saving.
"""

import json
import os
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest

import keras

import keras_tpu_optim as kto
from _kto_models import compile_model, fit_steps, make_data, make_model, make_optimizer, optimizer_state, weights_of

BACKEND = keras.backend.backend()
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_resume_worker.py")


def _run_worker(backend, tasks, tmp_path, name):
    job = tmp_path / f"{name}.json"
    job.write_text(json.dumps({"tasks": tasks}))
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.Popen(
        [sys.executable, WORKER, str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait(process, timeout=240):
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]


def _load_result(path):
    data = np.load(path)
    weights = [data[f"w{i}"] for i in range(sum(k.startswith("w") for k in data.files))]
    state = [data[f"o{i}"] for i in range(sum(k.startswith("o") for k in data.files))]
    return weights, state


def _trained(kind, optimizer, steps=3, batch_size=16):
    x, y = make_data(kind, steps * batch_size)
    model = compile_model(make_model(kind), kind, optimizer)
    fit_steps(model, x, y, batch_size)
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
]


@pytest.mark.parametrize("kind, make", ROUND_TRIP_CASES, ids=["adafactor", "embedding_adam", "loss_scaled_adafactor"])
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
    looked_up = keras.optimizers.get(name)
    assert type(looked_up) is cls
    assert looked_up.get_config() == cls().get_config()

    optimizer = cls(learning_rate=0.02, clipnorm=2.0, skip_nonfinite_updates=True)
    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == name
    restored = keras.optimizers.deserialize(json.loads(json.dumps(serialized)))
    assert type(restored) is cls and restored.get_config() == optimizer.get_config()
    assert restored.skip_nonfinite_updates is True
    assert keras.optimizers.get(serialized).get_config() == optimizer.get_config()


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
            config = json.loads(archive.read("config.json"))["compile_config"]["optimizer"]["config"]
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
            lambda: kto.EmbeddingAdam(slot_variable_creation_fn=lambda v, names, inits: make_slots_with_names(v, names, inits)),
            "slot_variable_creation_fn",
        ),
    ],
    ids=["learning_rate_lambda", "slot_fn_lambda"],
)
def test_unregistered_callable_refuses_to_save(kind, make, argument, tmp_path):
    model = _trained(kind, make(), steps=1)
    path = tmp_path / "m.keras"
    with pytest.raises(ValueError, match=rf"(?s)`{argument}`.*not registered serializable.*register_keras_serializable"):
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


# ------------------------------------------------------------ exact resume


RESUME_SCENARIOS = {
    # name: (model kind, optimizer spec, steps before the save); 3 steps with
    # accumulation over 2 means the save holds one accumulated micro-step.
    "adafactor_schedule_momentum_accumulation_mid": (
        "mlp",
        {"class": "Adafactor", "kwargs": {"beta_1": 0.9, "gradient_accumulation_steps": 2}, "schedule": 0.1},
        3,
    ),
    "adafactor_ema": (
        "mlp",
        {"class": "Adafactor", "kwargs": {"learning_rate": 0.1, "use_ema": True, "ema_overwrite_frequency": 2}},
        3,
    ),
    "embedding_adam_schedule_ema_accumulation_mid": (
        "recommender",
        {
            "class": "EmbeddingAdam",
            "kwargs": {"use_ema": True, "ema_overwrite_frequency": 2, "gradient_accumulation_steps": 2},
            "schedule": 0.05,
        },
        3,
    ),
}


def test_exact_resume_in_a_fresh_process(tmp_path):
    """Train N steps, save, load in a new process, train M more == N+M uninterrupted, bit for bit."""
    batch_size, more_steps = 16, 3
    tasks, references = [], {}
    for name, (kind, spec, steps) in RESUME_SCENARIOS.items():
        x, y = make_data(kind, (steps + more_steps) * batch_size, seed=3)
        split = steps * batch_size
        np.savez(tmp_path / f"{name}_rest.npz", x=x[split:], y=y[split:])
        model = compile_model(make_model(kind), kind, make_optimizer(spec))
        fit_steps(model, x[:split], y[:split], batch_size)
        model.save(str(tmp_path / f"{name}.keras"))
        fit_steps(model, x[split:], y[split:], batch_size)
        references[name] = (weights_of(model), optimizer_state(model.optimizer))
        if not spec.get("kwargs", {}).get("use_ema"):
            # Two fit calls are one run (EMA aside: fit ends by installing the averages).
            single = compile_model(make_model(kind), kind, make_optimizer(spec))
            fit_steps(single, x, y, batch_size)
            for a, b in zip(weights_of(single), references[name][0]):
                np.testing.assert_array_equal(a, b)
        tasks.append(
            {
                "op": "resume",
                "model": str(tmp_path / f"{name}.keras"),
                "data": str(tmp_path / f"{name}_rest.npz"),
                "batch_size": batch_size,
                "out": str(tmp_path / f"{name}_resumed.npz"),
            }
        )
    _wait(_run_worker(BACKEND, tasks, tmp_path, "resume"))
    for name, (want_weights, want_state) in references.items():
        got_weights, got_state = _load_result(tmp_path / f"{name}_resumed.npz")
        assert len(got_weights) == len(want_weights) and len(got_state) == len(want_state), name
        for got, want in zip(got_weights + got_state, want_weights + want_state):
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.skipif(BACKEND != "jax", reason="drives all three backends (subprocesses); runs once, under JAX")
def test_file_saved_on_one_backend_resumes_on_the_others(tmp_path):
    """Each backend resumes the files of the other two; each run is compared with
    the saving backend's own uninterrupted run. Sequenced so that only two
    subprocesses are needed: JAX (here) saves; TF resumes it and saves; torch
    resumes both and saves; TF resumes torch's; JAX resumes TF's and torch's."""
    scenarios = {
        "adafactor": ("mlp", {"class": "Adafactor", "kwargs": {"learning_rate": 0.1, "beta_1": 0.5}}),
        "embedding_adam": ("recommender", {"class": "EmbeddingAdam", "schedule": 0.05}),
    }
    steps, more_steps, batch_size = 2, 2, 16

    def train_save(name, backend):
        kind, spec = scenarios[name]
        return {
            "op": "train_save",
            "kind": kind,
            "optimizer": spec,
            "data": str(tmp_path / f"{name}.npz"),
            "steps": steps,
            "batch_size": batch_size,
            "save": str(tmp_path / f"{name}_{backend}.keras"),
            "out": str(tmp_path / f"{name}_{backend}_reference.npz"),
        }

    def resume(name, source, target):
        return {
            "op": "resume",
            "model": str(tmp_path / f"{name}_{source}.keras"),
            "data": str(tmp_path / f"{name}_rest.npz"),
            "batch_size": batch_size,
            "out": str(tmp_path / f"{name}_{source}_on_{target}.npz"),
        }

    for name, (kind, _) in scenarios.items():
        x, y = make_data(kind, (steps + more_steps) * batch_size, seed=5)
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        np.savez(tmp_path / f"{name}_rest.npz", x=x[steps * batch_size :], y=y[steps * batch_size :])

    import _resume_worker

    for name in scenarios:
        _resume_worker.run(train_save(name, "jax"))
    _wait(_run_worker("tensorflow", [t for n in scenarios for t in (resume(n, "jax", "tensorflow"), train_save(n, "tensorflow"))], tmp_path, "tf"))
    _wait(
        _run_worker(
            "torch",
            [t for n in scenarios for t in (resume(n, "jax", "torch"), resume(n, "tensorflow", "torch"), train_save(n, "torch"))],
            tmp_path,
            "torch",
        )
    )
    last_tf = _run_worker("tensorflow", [resume(n, "torch", "tensorflow") for n in scenarios], tmp_path, "tf2")
    for name in scenarios:
        keras.backend.clear_session()
        _resume_worker.run(resume(name, "tensorflow", "jax"))
        _resume_worker.run(resume(name, "torch", "jax"))
    _wait(last_tf)

    backends = ["jax", "tensorflow", "torch"]
    for name in scenarios:
        for source in backends:
            want_weights, want_state = _load_result(tmp_path / f"{name}_{source}_reference.npz")
            for target in backends:
                if target == source:
                    continue
                got_weights, got_state = _load_result(tmp_path / f"{name}_{source}_on_{target}.npz")
                assert len(got_state) == len(want_state)
                for got, want in zip(got_weights + got_state, want_weights + want_state):
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"{name} {source}->{target}")


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
]


def _layout(kind, make):
    model = compile_model(make_model(kind), kind, make())
    model.optimizer.build(model.trainable_variables)
    return [(tuple(v.shape), keras.backend.standardize_dtype(v.dtype)) for v in model.optimizer.variables]


@pytest.mark.parametrize("kind, make_saved, make_loading, named", MISMATCH_CASES, ids=["factoring", "momentum", "ema_vs_accumulation_same_count", "ema"])
def test_load_weights_of_differently_configured_optimizer_raises(kind, make_saved, make_loading, named, tmp_path):
    model = _trained(kind, make_saved(), steps=2)
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
    model = _trained(kind, make_saved(), steps=2)
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
