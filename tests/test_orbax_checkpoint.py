"""`keras_tpu_optim.load_checkpoint`: resuming from a `keras.callbacks.OrbaxCheckpoint`
with the saved state checked first (one process; the multi-process runs are in
integration/test_multiprocess_jax.py).

Keras's own loaders assign an Orbax checkpoint by variable path and skip whatever does not
match, silently; these tests pin that down and check that ours refuses instead.
"""

import os
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from _kto_models import compile_model, make_data, make_model, optimizer_state, weights_of

pytest.importorskip("orbax.checkpoint")

STEPS, BATCH = 2, 8


def _model(optimizer, seed=1):
    # Orbax checkpoints hold variables by path: a fresh name scope gives the
    # rebuilt model the layer names of the saved one.
    keras.backend.clear_session(free_memory=False)
    return compile_model(make_model("mlp", seed=seed), "mlp", optimizer)


def _trained(tmp_path, optimizer):
    x, y = make_data("mlp", STEPS * BATCH)
    model = _model(optimizer)
    directory = str(tmp_path / "ckpt")
    checkpoint = keras.callbacks.OrbaxCheckpoint(
        directory, save_freq=STEPS, save_on_background=False
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    return model, directory


def test_restores_weights_and_state_of_an_unbuilt_optimizer(tmp_path):
    trained, directory = _trained(tmp_path, kto.Adafactor(learning_rate=0.1, beta_1=0.9))
    model = _model(seed=2, optimizer=kto.Adafactor(learning_rate=0.1, beta_1=0.9))
    assert not model.optimizer.built
    kto.load_checkpoint(model, directory)
    for got, want in zip(
        weights_of(model) + optimizer_state(model.optimizer),
        weights_of(trained) + optimizer_state(trained.optimizer),
    ):
        np.testing.assert_array_equal(got, want)
    assert len(optimizer_state(model.optimizer)) == len(optimizer_state(trained.optimizer))


def test_keras_load_weights_skips_the_slots_of_an_unbuilt_optimizer(tmp_path):
    """Why load_checkpoint builds the optimizer: Keras assigns by path, and an unbuilt
    optimizer has only its counter and learning rate."""
    trained, directory = _trained(tmp_path, kto.EmbeddingAdam(0.1))
    model = _model(seed=2, optimizer=kto.EmbeddingAdam(0.1))
    model.load_weights(directory)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == STEPS
    model.optimizer.build(model.trainable_variables)
    assert not np.any(optimizer_state(model.optimizer)[-1])  # fresh slots, silently


@pytest.mark.parametrize(
    "saved, here, setting",
    [
        (
            lambda: kto.Adafactor(learning_rate=0.1, beta_1=0.9),
            lambda: kto.Adafactor(learning_rate=0.1),
            "beta_1",
        ),
        (
            lambda: kto.Adafactor(learning_rate=0.1),
            lambda: kto.Adafactor(learning_rate=0.1, min_dim_size_to_factor=1000),
            "min_dim_size_to_factor",
        ),
        (lambda: kto.EmbeddingAdam(0.1), lambda: kto.EmbeddingAdam(0.1, use_ema=True), "use_ema"),
    ],
)
def test_a_differently_configured_optimizer_raises_and_changes_nothing(
    tmp_path, saved, here, setting
):
    _, directory = _trained(tmp_path, saved())
    model = _model(seed=2, optimizer=here())
    model.optimizer.build(model.trainable_variables)
    before = weights_of(model) + optimizer_state(model.optimizer)
    with pytest.raises(ValueError, match=setting) as raised:
        kto.load_checkpoint(model, directory)
    assert "Nothing was loaded" in str(raised.value)
    for got, want in zip(weights_of(model) + optimizer_state(model.optimizer), before):
        np.testing.assert_array_equal(got, want)


def test_a_schedule_in_place_of_a_float_learning_rate_resumes(tmp_path):
    trained, directory = _trained(tmp_path, kto.EmbeddingAdam(0.1))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    model = _model(seed=2, optimizer=kto.EmbeddingAdam(schedule))
    kto.load_checkpoint(model, directory)
    for got, want in zip(weights_of(model), weights_of(trained)):
        np.testing.assert_array_equal(got, want)


def test_other_layer_names_raise(tmp_path):
    """Keras would load nothing (paths differ) and say nothing."""
    _, directory = _trained(tmp_path, kto.Adafactor(learning_rate=0.1))
    model = compile_model(
        make_model("mlp", seed=2), "mlp", kto.Adafactor(learning_rate=0.1)
    )  # dense_2, dense_3
    with pytest.raises(ValueError, match="which the checkpoint lacks"):
        kto.load_checkpoint(model, directory)


def test_not_a_checkpoint(tmp_path):
    model = _model(kto.Adafactor())
    with pytest.raises(ValueError, match="not a directory"):
        kto.load_checkpoint(model, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="OrbaxCheckpoint"):
        kto.load_checkpoint(model, str(tmp_path / "empty"))


_RESTORE_ON_ONE_DEVICE = """
import json, sys, numpy as np, keras, keras_tpu_optim as kto
from _kto_models import compile_model, make_model
import jax
assert len(jax.devices()) == 1, jax.devices()
directory, expected = sys.argv[1:3]
want = dict(np.load(expected))
results = {}
for how in ("keras", "ours", "ours_schedule"):
    keras.backend.clear_session()
    # A schedule of the same value in place of the saved float learning rate: the checkpoint
    # holds a learning_rate array this optimizer has no variable for.
    learning_rate = keras.optimizers.schedules.PiecewiseConstantDecay([1000], [0.1, 0.1]) if how == "ours_schedule" else 0.1
    model = compile_model(make_model("mlp", seed=2), "mlp", kto.Adafactor(learning_rate=learning_rate, beta_1=0.9))
    try:
        if how == "keras":
            model.optimizer.build(model.trainable_variables)
            model.load_weights(directory)
        else:
            kto.load_checkpoint(model, directory)
    except Exception as error:
        results[how] = f"FAILED {type(error).__name__}: {str(error)[:500]}"
        continue
    got = {v.path: keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables + model.optimizer.variables}
    assert set(want) - set(got) == ({"adafactor/learning_rate"} if how == "ours_schedule" else set()), (how, sorted(set(want) ^ set(got)))
    for path, value in got.items():
        np.testing.assert_array_equal(value, want[path], err_msg=f"{how}: {path}")
    results[how] = f"RESTORED {len(got)}"
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="placement on devices is JAX's: TF and torch checkpoints hold plain arrays",
)
@pytest.mark.processes
def test_a_checkpoint_of_8_sharded_devices_restores_on_one_device(tmp_path):
    """Keras's `load_weights` without a distribution asks Orbax for the saved placements,
    which name 8 devices; `load_checkpoint` places every array as this model's variables,
    and an array the model has no variable for (the float learning rate, where a schedule
    now stands) on this process's device."""
    import json
    import subprocess
    import sys

    import jax

    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as dev/test.sh sets)"
        )
    mesh = keras.distribution.DeviceMesh((2, 4), ["model", "batch"], jax.devices()[:8])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*dense/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    with distribution.scope():
        trained, directory = _trained(tmp_path, kto.Adafactor(learning_rate=0.1, beta_1=0.9))
        kernel = trained.trainable_variables[0]
        assert len(kernel.value.sharding.device_set) == 8
        variables = trained.trainable_variables + trained.optimizer.variables
        np.savez(
            tmp_path / "want.npz",
            **{v.path: keras.ops.convert_to_numpy(v.value) for v in variables},
        )
    script = tmp_path / "restore.py"
    script.write_text(_RESTORE_ON_ONE_DEVICE)
    tests = str(Path(__file__).resolve().parent)
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        KERAS_BACKEND="jax",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(tests).parent), tests, env.get("PYTHONPATH")])
    )
    run = subprocess.run(
        [sys.executable, str(script), directory, str(tmp_path / "want.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    assert results["keras"].startswith("FAILED"), results  # why load_checkpoint places
    assert results["ours"] == f"RESTORED {len(variables)}", results
    assert results["ours_schedule"] == f"RESTORED {len(variables) - 1}", results


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="TF and torch restore through Keras's model.load_weights (no placement)",
)
def test_a_checkpoint_orbax_cannot_place_raises_and_changes_nothing(tmp_path, monkeypatch):
    from keras_tpu_optim import _orbax

    _, directory = _trained(tmp_path, kto.EmbeddingAdam(0.1))
    model = _model(seed=2, optimizer=kto.EmbeddingAdam(0.1))
    model.optimizer.build(model.trainable_variables)
    before = weights_of(model) + optimizer_state(model.optimizer)

    ocp = _orbax._ocp()

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "The available devices are different from the devices used to save the checkpoint."
        )

    monkeypatch.setattr(ocp, "load_checkpointables", refuse)
    with pytest.raises(
        ValueError, match="onto this process's devices .*devices used to save.*Nothing was loaded"
    ):
        kto.load_checkpoint(model, directory)
    for got, want in zip(weights_of(model) + optimizer_state(model.optimizer), before):
        np.testing.assert_array_equal(got, want)
