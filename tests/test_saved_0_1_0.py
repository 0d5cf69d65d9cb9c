"""Files saved by keras_tpu_optim 0.1.0 still load, on every backend.

`tests/data/*_0_1_0.keras` were written by the released 0.1.0 code on JAX
(`tests/data/make_0_1_0_files.py`, which must be run with the 0.1.0 package).
The reference is the archive itself: the expected optimizer config comes from
its `config.json` and the expected variable values from its `model.weights.h5`,
read here with zipfile + h5py, never through the package under test.

Keras stores an optimizer's variables in `model.weights.h5` as the datasets
`optimizer/vars/0`, `optimizer/vars/1`, ... in the order of
`optimizer.variables` (0 is `iterations`, 1 `learning_rate`, then the slots);
0.1.0 adds `optimizer/vars/keras_tpu_optim_state_signature`, a JSON document as
uint8 bytes describing each of them. Layer weights are under
`layers/<group>/vars/<i>`, the group's `name` attribute being the layer's name.

Run one backend per process: KERAS_BACKEND=tensorflow|jax|torch.
"""

import io
import json
import os
import zipfile

import h5py
import numpy as np
import pytest

import keras

import keras_tpu_optim as kto

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SIGNATURE_KEY = "keras_tpu_optim_state_signature"

# What make_0_1_0_files.py saved, independently of the archive: the class, the
# hyperparameters it was constructed with, the optimizer variables (shape per
# position, after iterations and learning_rate) and the layers.
FILES = {
    "adafactor_0_1_0.keras": dict(
        cls=kto.Adafactor,
        options=dict(beta_1=0.9, relative_step=True, min_dim_size_to_factor=None, use_ema=False),
        slots=[
            ("row_second_moment", "dense/kernel", (8,)),
            ("column_second_moment", "dense/kernel", (6,)),
            ("momentum", "dense/kernel", (8, 6)),
            ("second_moment", "dense/bias", (6,)),
            ("momentum", "dense/bias", (6,)),
        ],
        layers=["dense"],
        # Same architecture, optimizer without momentum: the saved state is not its state.
        other_optimizer=lambda: kto.Adafactor(),
        named_in_error=["momentum", "beta_1"],
    ),
    "embedding_adam_0_1_0.keras": dict(
        cls=kto.EmbeddingAdam,
        options=dict(clipvalue=1.0, weight_decay=1e-3, use_ema=True, beta_1=0.9, beta_2=0.999),
        slots=[
            ("average", "table/embeddings", (50, 4)),
            ("average", "score/kernel", (4, 1)),
            ("average", "score/bias", (1,)),
            ("momenta", "table/embeddings", (50, 4)),
            ("velocities", "table/embeddings", (50, 4)),
            ("momenta", "score/kernel", (4, 1)),
            ("velocities", "score/kernel", (4, 1)),
            ("momenta", "score/bias", (1,)),
            ("velocities", "score/bias", (1,)),
        ],
        layers=["table", "score"],
        # Same architecture, optimizer without EMA.
        other_optimizer=lambda: kto.EmbeddingAdam(0.01, clipvalue=1.0, weight_decay=1e-3),
        named_in_error=["average", "use_ema"],
    ),
}
NAMES = sorted(FILES)


def _archive(filename):
    """(config.json as a dict, {h5 path: numpy value} of model.weights.h5) of a .keras file."""
    with zipfile.ZipFile(os.path.join(DATA, filename)) as archive:
        config = json.loads(archive.read("config.json"))
        weights = archive.read("model.weights.h5")
    values, group_names = {}, {}
    with h5py.File(io.BytesIO(weights), "r") as h5:

        def visit(path, item):
            if isinstance(item, h5py.Dataset):
                values[path] = np.asarray(item[()])
            elif "name" in item.attrs:
                group_names[path] = item.attrs["name"]

        h5.visititems(visit)
    return config, values, group_names


def _saved_optimizer_variables(values):
    numbered = {
        int(key.rsplit("/", 1)[1]): value
        for key, value in values.items()
        if key.startswith("optimizer/vars/") and key.rsplit("/", 1)[1].isdigit()
    }
    assert sorted(numbered) == list(range(len(numbered)))
    return [numbered[i] for i in range(len(numbered))]


def _saved_layer_weights(values, group_names, layer_name):
    groups = [
        path
        for path, name in group_names.items()
        if name == layer_name and path.startswith("layers/")
    ]
    assert len(groups) == 1, (layer_name, group_names)
    numbered = {
        int(key.rsplit("/", 1)[1]): value
        for key, value in values.items()
        if key.rsplit("/", 1)[0] == groups[0]
    }
    return [numbered[i] for i in range(len(numbered))]


def _data(model, n=8):
    rng = np.random.default_rng(123)
    shape = tuple(model.inputs[0].shape[1:])
    if "int" in keras.backend.standardize_dtype(model.inputs[0].dtype):
        x = rng.integers(0, 50, size=(n,) + shape).astype("int32")
    else:
        x = rng.normal(size=(n,) + shape).astype("float32")
    y = rng.normal(size=(n,) + tuple(model.outputs[0].shape[1:])).astype("float32")
    return x, y


@pytest.mark.parametrize("filename", NAMES)
@pytest.mark.backend_neutral
def test_file_is_what_the_generator_wrote(filename):
    """The fixture itself (read without the package): 0.1.0's layout and signature."""
    expected = FILES[filename]
    config, values, _ = _archive(filename)
    optimizer = config["compile_config"]["optimizer"]
    assert optimizer["registered_name"] == f"keras_tpu_optim>{expected['cls'].__name__}"
    for key, value in expected["options"].items():
        assert optimizer["config"][key] == value, key
    np.testing.assert_allclose(optimizer["config"]["learning_rate"], 0.01, rtol=1e-6)

    saved = _saved_optimizer_variables(values)
    assert len(saved) == 2 + len(expected["slots"])
    assert int(saved[0]) == 3  # iterations: three training steps
    assert [tuple(v.shape) for v in saved[2:]] == [shape for _, _, shape in expected["slots"]]

    assert f"optimizer/vars/{SIGNATURE_KEY}" in values
    signature = json.loads(
        values[f"optimizer/vars/{SIGNATURE_KEY}"].astype(np.uint8).tobytes().decode("utf-8")
    )
    assert signature["class"] == optimizer["registered_name"]
    assert [
        (e["role"], e["of_path"], tuple(e["shape"])) for e in signature["variables"][2:]
    ] == expected["slots"]
    assert [e["role"] for e in signature["variables"][:2]] == ["iteration", "learning_rate"]


@pytest.mark.parametrize("filename", NAMES)
def test_load_model_restores_config_and_state_and_trains_on(filename):
    expected = FILES[filename]
    config, values, group_names = _archive(filename)
    saved_config = config["compile_config"]["optimizer"]["config"]

    model = keras.saving.load_model(os.path.join(DATA, filename))  # safe_mode=True
    optimizer = model.optimizer

    # (a) the config: class, and every setting 0.1.0 saved (a newer version may add settings).
    assert type(optimizer) is expected["cls"]
    loaded_config = optimizer.get_config()
    for key, value in saved_config.items():
        assert loaded_config[key] == value, (key, loaded_config[key], value)
    for key, value in expected["options"].items():
        assert loaded_config[key] == value, key
    np.testing.assert_allclose(
        float(keras.ops.convert_to_numpy(optimizer.learning_rate)), 0.01, rtol=1e-6
    )

    # (b) every optimizer variable, position by position, and the model's weights.
    saved = _saved_optimizer_variables(values)
    # State added after 0.1.0 and derived on load: the lazy EMA's per-row count of EMA
    # updates (0.1.0 updated every average at every step, so every row is at `iterations`).
    derived = [v for v in optimizer.variables if v.name.endswith("_average_steps")]
    assert len(derived) == (3 if filename.startswith("embedding_adam") else 0)
    for variable in derived:
        assert keras.backend.standardize_dtype(variable.dtype) == "int32"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable.value), 3)
    restored = [
        keras.ops.convert_to_numpy(v.value)
        for v in optimizer.variables
        if not any(v is d for d in derived)
    ]
    assert len(restored) == len(saved)
    for position, (stored, loaded) in enumerate(zip(saved, restored)):
        assert loaded.shape == stored.shape, position
        if position == 0:  # iterations: int32 on JAX (where the file was made), int64 on TF/torch
            assert int(loaded) == int(stored) == 3
        else:
            assert loaded.dtype == stored.dtype, position
            np.testing.assert_array_equal(loaded, stored, err_msg=f"optimizer variable {position}")
    assert any(np.any(v != 0) for v in saved[2:])  # the state is not a fresh one
    for layer_name in expected["layers"]:
        stored_weights = _saved_layer_weights(values, group_names, layer_name)
        loaded_weights = [
            keras.ops.convert_to_numpy(w.value) for w in model.get_layer(layer_name).weights
        ]
        assert len(loaded_weights) == len(stored_weights)
        for stored, loaded in zip(stored_weights, loaded_weights):
            np.testing.assert_array_equal(loaded, stored)

    # (c) one more step from there.
    if keras.backend.backend() == "torch":
        # The file's compile config says jit_compile=True (what "auto" resolved
        # to on JAX, where it was saved); on torch that means torch.compile of
        # the whole train step: ~40 s on a small CPU box and not what this test
        # is about. Eager, as torch's "auto" would be.
        model.jit_compile = False
    before = [keras.ops.convert_to_numpy(w.value).copy() for w in model.trainable_weights]
    x, y = _data(model)
    loss = model.train_on_batch(x, y)
    assert np.isfinite(loss)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations.value)) == 4
    after = [keras.ops.convert_to_numpy(w.value) for w in model.trainable_weights]
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    current = [v for v in optimizer.variables if not any(v is d for d in derived)]
    for position, (stored, now) in enumerate(zip(saved[2:], current[2:]), start=2):
        now = keras.ops.convert_to_numpy(now.value)
        assert np.all(np.isfinite(now)), position
    assert any(
        not np.array_equal(stored, keras.ops.convert_to_numpy(now.value))
        for stored, now in zip(saved[2:], current[2:])
    )


@pytest.mark.parametrize("filename", NAMES)
def test_differently_configured_optimizer_refuses_the_state(filename):
    expected = FILES[filename]
    path = os.path.join(DATA, filename)
    model = keras.saving.load_model(path, compile=False)
    target = keras.models.clone_model(model)
    target.compile(optimizer=expected["other_optimizer"](), loss="mse")
    target.optimizer.build(target.trainable_variables)
    with pytest.raises(ValueError) as error:
        target.load_weights(path)
    message = str(error.value)
    for word in expected["named_in_error"]:
        assert word in message, message
    assert int(keras.ops.convert_to_numpy(target.optimizer.iterations.value)) == 0
