"""The code examples of the README and of docs/guide.md run as written."""

import pathlib
import re

import keras
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"


def _python_blocks_after(heading, path):
    """The python code blocks of the file at `path` after `heading`, in order."""
    section = path.read_text().split(heading, 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _python_block_after(heading, path):
    return _python_blocks_after(heading, path)[0]


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the BCOO training step is the JAX backend's"
)
def test_jax_bcoo_training_step_example_runs(capsys):
    exec(
        compile(_python_block_after("## Sparse gradients on JAX", GUIDE), "docs/guide.md", "exec"),
        {},
    )
    printed = capsys.readouterr().out.split()
    losses = [float(x) for x in printed[1:6:2]]
    assert losses[2] < losses[0]  # it trains
    assert printed[-1] == "3"  # iterations, read back into the optimizer


def test_recommender_example_trains_the_tables_in_fit():
    namespace = {}
    exec(
        compile(
            _python_block_after("## A recommender: tables trained inside `fit`", README),
            "README.md",
            "exec",
        ),
        namespace,
    )
    users = namespace["users"]
    assert (
        float(keras.ops.convert_to_numpy(users.iterations)) == 8
    )  # 8192 examples, batches of 1024
    velocities = keras.ops.convert_to_numpy(users.velocities)
    touched = set(namespace["ids"][0].tolist())
    assert (
        set(velocities.any(axis=1).nonzero()[0].tolist()) == touched
    )  # only looked-up rows have state


def test_half_width_example_keeps_a_third_of_the_bytes_a_row_and_trains():
    import keras_tpu_optim as kto

    namespace = {"kto": kto}  # imported by the example before it
    exec(
        compile(
            _python_blocks_after("## A recommender: tables trained inside `fit`", README)[1],
            "README.md",
            "exec",
        ),
        namespace,
    )
    users = namespace["users"]
    ids = keras.Input((), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.ops.cast(users(ids), "float32")))
    model.compile(optimizer="sgd", loss="mse")
    batch = np.arange(0, 1_000_000, 4096, dtype="int32")
    model.fit(batch, np.ones((len(batch), 1), "float32"), batch_size=len(batch), verbose=0)
    state = users.table_state()
    row_bytes = sum(
        np.dtype(
            keras.backend.standardize_dtype(state[name].dtype).replace("bfloat16", "float16")
        ).itemsize
        * int(np.prod(state[name].shape[1:]))
        for name in ("embeddings", "momenta", "velocities")
    )
    assert row_bytes == 4 * 32 + 4  # a third of float32's 12 * 32
    trained = keras.ops.convert_to_numpy(keras.ops.cast(state["velocities"], "float32"))
    assert (trained[batch] > 0).all() and float(keras.ops.convert_to_numpy(users.iterations)) == 1


def test_many_tables_example_trains_each_table():
    namespace = {}
    exec(
        compile(_python_block_after("## Many tables in one layer", GUIDE), "docs/guide.md", "exec"),
        namespace,
    )
    embedding, x = namespace["embedding"], namespace["x"]
    groups = embedding._grouping.groups
    assert sorted(len(m) for m in embedding._grouping.members) == [1, 2]  # users and items stacked
    assert {k: tuple(v.shape) for k, v in namespace["tables"].items()} == {
        "users": (100_000, 16),
        "items": (20_000, 16),
        "cities": (500, 16),
    }
    assert [float(keras.ops.convert_to_numpy(g.iterations)) for g in groups] == [8, 8]  # 2048 / 256
    # Each table's state is touched exactly at its features' ids (items: "item" and "history").
    seen = {
        "users": x["user"],
        "items": np.union1d(x["item"], x["history"].reshape(-1)),
        "cities": x["city"],
    }
    for name, ids in seen.items():
        group, first = embedding._grouping.placement[name]
        rows = namespace["tables"][name].shape[0]
        momenta = keras.ops.convert_to_numpy(groups[group].momenta)[first : first + rows]
        assert set(np.flatnonzero(momenta.any(axis=1)).tolist()) == set(np.unique(ids).tolist())


@pytest.mark.skipif(
    keras.backend.backend() == "torch", reason="torch has no TPU embedding engine to export to"
)
def test_many_tables_configs_move_to_keras_rs_with_exported_optimizers():
    namespace = {}
    for block in _python_blocks_after("## Many tables in one layer", GUIDE)[:2]:
        exec(compile(block, "docs/guide.md", "exec"), namespace)
    exported, features = namespace["exported"], namespace["tpu_features"]
    assert features["history"].table is features["item"].table  # one shared table
    assert features["city"].table.optimizer is exported["cities"]  # the override's own export
    assert exported["users"] is exported["items"] is not exported["cities"]
    assert features["history"].table.combiner == "mean"
