"""Distributed training matches single-device training; optimizer state follows the sharding.

JAX: `keras.distribution` on 8 virtual CPU devices (dev/test.sh sets
XLA_FLAGS=--xla_force_host_platform_device_count=8). TF: MirroredStrategy over
the 2 logical CPU devices tests/conftest.py sets before TensorFlow initialises.
"""

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
STEPS = 3


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, size=(64, 4)).astype("int32")
    targets = rng.normal(size=(64, 1)).astype("float32")
    return ids, targets


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(64, 16, name="embedding"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, name="dense"),
            keras.layers.Dense(1, name="dense_out"),
        ]
    )


def _train(make_optimizer, distribution=None):
    """Build and train under `distribution`; returns (model, optimizer)."""
    keras.distribution.set_distribution(distribution)
    try:
        model = _model()
        optimizer = make_optimizer()
        model.compile(optimizer=optimizer, loss="mse")
        ids, targets = _data()
        model.fit(
            ids, targets, batch_size=16, epochs=1, steps_per_epoch=STEPS, verbose=0, shuffle=False
        )
        return model, optimizer
    finally:
        keras.distribution.set_distribution(None)


OPTIMIZERS = {
    "adafactor": lambda: kto.Adafactor(learning_rate=0.01),
    "embedding_adam": lambda: kto.EmbeddingAdam(0.01, max_touched_rows=8),
}


def _require_jax_devices():
    if BACKEND != "jax":
        pytest.skip(f"keras.distribution runs on the JAX backend; this run is {BACKEND}")
    if len(keras.distribution.list_devices()) < 8:
        pytest.skip(
            "needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (dev/test.sh sets it)"
        )


def _weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_jax_model_parallel_matches_single_device_and_shards_state(name):
    _require_jax_devices()
    single = _weights(_train(OPTIMIZERS[name])[0])

    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embedding/embeddings"] = ("model", None)
    layout_map[".*dense/kernel"] = (None, "model")
    model, optimizer = _train(
        OPTIMIZERS[name],
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"),
    )

    for got, want in zip(_weights(model), single):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    paths = {v.path: tuple(v.value.sharding.spec) for v in optimizer.variables}

    def spec(suffix):
        (match,) = [s for p, s in paths.items() if p.endswith(suffix)]
        return match

    table, kernel = "_embedding_embeddings", "_dense_kernel"
    if name == "adafactor":
        # Each statistic is sharded along the axis it keeps.
        assert spec(f"{table}_row_second_moment") == ("model",)
        assert spec(f"{table}_column_second_moment") in ((None,), ())
        assert spec(f"{kernel}_row_second_moment") in ((None,), ())
        assert spec(f"{kernel}_column_second_moment") == ("model",)
    else:
        for slot in ("momenta", "velocities"):
            assert spec(f"{table}_{slot}") == ("model", None)
            assert spec(f"{kernel}_{slot}") == (None, "model")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_jax_layout_map_matching_the_optimizers_scalars_is_refused(name):
    """'.*embedding.*' also matches `embedding_adam/iteration` (and '.*' everything): a
    sharded layout for a scalar, which JAX would refuse with an IndexError deep inside."""
    _require_jax_devices()
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("model", "batch"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embedding.*" if name == "embedding_adam" else ".*"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        with pytest.raises(ValueError, match="LayoutMap gives .*iteration"):
            OPTIMIZERS[name]()
        if name == "embedding_adam":  # a name the key does not match: fine
            assert kto.EmbeddingAdam(0.01, name="table_optimizer").name == "table_optimizer"
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize(
    "name, key, axes, state",
    [
        # Aimed at the state, not the kernel: a row statistic is rank 1.
        ("adafactor", ".*dense_kernel.*", ("model", None), "dense_kernel_row_second_moment"),
        # The right rank, but apart from the table's own (replicated) layout.
        (
            "embedding_adam",
            ".*embedding_embeddings_momenta",
            ("model", None),
            "embedding_embeddings_momenta",
        ),
        (
            "embedding_adam",
            ".*_velocities",
            (None, None, "model"),
            "embedding_embeddings_velocities",
        ),
    ],
)
def test_jax_layout_map_laying_out_state_apart_from_its_variable_is_refused(name, key, axes, state):
    """Our state follows its model variable's layout; a key that matches only state would
    be ignored (or have the wrong rank): refused at build, before any variable is created."""
    _require_jax_devices()
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("model", "batch"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[key] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        model = _model()
        optimizer = OPTIMIZERS[name]()
        with pytest.raises(
            ValueError,
            match=rf"LayoutMap key .* gives .*'{optimizer.name}/\w*{state}'.*Nothing was built",
        ):
            optimizer.build(model.trainable_variables)
        assert not optimizer.built
        assert sorted(v.path.split("/")[-1] for v in optimizer.variables) == [
            "iteration",
            "learning_rate",
        ]
        del layout_map[key]  # fixed: the same optimizer builds
        optimizer.build(model.trainable_variables)
        assert optimizer.built and len(optimizer.variables) > 2
    finally:
        keras.distribution.set_distribution(None)


def test_jax_layout_map_key_matching_a_variable_and_its_state_is_the_variables():
    """'.*dense[/_]kernel.*' matches '.../dense/kernel' and 'adafactor/..._dense_kernel_row_second_moment'
    (with a layout of the wrong rank): the key is the kernel's, and the state follows it (no error)."""
    _require_jax_devices()
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("model", "batch"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense[/_]kernel.*"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        model = _model()
        optimizer = kto.Adafactor(learning_rate=0.01, beta_1=0.9)
        optimizer.build(model.trainable_variables)
        specs = {v.path: tuple(v.value.sharding.spec) for v in optimizer.variables}
        assert specs["adafactor/sequential_dense_kernel_row_second_moment"] in ((None,), ())
        assert specs["adafactor/sequential_dense_kernel_column_second_moment"] == ("model",)
        assert specs["adafactor/sequential_dense_kernel_momentum"] == (None, "model")
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_jax_data_parallel_matches_single_device(name):
    _require_jax_devices()
    single = _weights(_train(OPTIMIZERS[name])[0])
    model, _ = _train(OPTIMIZERS[name], keras.distribution.DataParallel())
    for got, want in zip(_weights(model), single):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tf_mirrored_strategy_matches_single_device():
    """MirroredStrategy over two logical CPU devices (tests/conftest.py) against the default strategy."""
    if BACKEND != "tensorflow":
        pytest.skip(
            f"tf.distribute.MirroredStrategy needs the TensorFlow backend; this run is {BACKEND}"
        )
    import tensorflow as tf
    from _mirrored import mirrored_strategy

    def train(name, strategy):
        keras.backend.clear_session(free_memory=False)
        with strategy.scope():
            model = _model()
            model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
        ids, targets = _data()
        model.fit(
            ids, targets, batch_size=16, epochs=1, steps_per_epoch=STEPS, verbose=0, shuffle=False
        )
        return _weights(model)

    for name in sorted(OPTIMIZERS):
        mirrored = train(name, mirrored_strategy())
        single = train(name, tf.distribute.get_strategy())
        for got, want in zip(mirrored, single):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
