"""`keras_tpu_optim.layers.DistributedEmbedding`: many tables in one layer, each trained by its EmbeddingAdam.

References, written independently of the layer: the numpy EmbeddingAdam (tests/reference), one per table,
fed the gradient of each looked-up row computed in numpy from the pooling formulas (keras-rs's
`EmbedReduce`: weighted sum, divided by the weights' sum for "mean" or by the root of their squares' sum
for "sqrtn"), and keras-rs's own layer for the outputs of its configs.
"""

import importlib.util

import numpy as np
import pytest

import keras
from keras import ops

import keras_tpu_optim as kto
from keras_tpu_optim.layers import DistributedEmbedding, FeatureConfig, TableConfig
from reference.numpy_embedding_adam import NumpyEmbeddingAdam
from test_layers_embedding import MODES, OPTION_CASES, numpy_of, reference_arguments

BACKEND = keras.backend.backend()
BATCH, K = 6, 3
# (rows, dim, combiner, the table's optimizer: None for the layer's)
TABLES = {
    "a": (40, 4, "mean", None),
    "b": (30, 4, "sqrtn", None),  # grouped with "a": same width, the layer's optimizer
    "c": (20, 3, "sum", "override"),  # an EmbeddingAdam of its own
    "d": (25, 4, "mean", "keras_adam"),  # keras.optimizers.Adam, mapped
}
# feature -> (table, ids per example or None for one id per example, weighted)
FEATURES = {
    "fa": ("a", None, False),
    "fa_bag": ("a", K, True),  # shares table "a" with "fa"
    "fb": ("b", K, False),
    "fc": ("c", K, True),
    "fd": ("d", None, False),
}
OVERRIDE = dict(learning_rate=0.2, clipvalue=0.05)
ADAM = dict(learning_rate=0.03)


def initial_table(name):
    rows, dim = TABLES[name][:2]
    return np.random.RandomState(ord(name)).normal(size=(rows, dim)).astype("float32")


def table_optimizer(kind):
    if kind == "override":
        return kto.EmbeddingAdam(**OVERRIDE)
    if kind == "keras_adam":
        return keras.optimizers.Adam(**ADAM)
    return None


def feature_configs():
    tables = {
        name: TableConfig(
            name,
            rows,
            dim,
            initializer=keras.initializers.Constant(initial_table(name)),
            optimizer=table_optimizer(kind),
            combiner=combiner,
        )
        for name, (rows, dim, combiner, kind) in TABLES.items()
    }
    return {
        name: FeatureConfig(
            name,
            tables[table],
            input_shape=(BATCH,) if per_example is None else (BATCH, per_example),
            output_shape=(BATCH, TABLES[table][1]),
        )
        for name, (table, per_example, _) in FEATURES.items()
    }


def step_inputs(step):
    rng = np.random.RandomState(step)
    ids, weights = {}, {}
    for name, (table, per_example, weighted) in FEATURES.items():
        rows = TABLES[table][0]
        # Low ids more often: duplicates within a feature and across the features of a table.
        shape = (BATCH,) if per_example is None else (BATCH, per_example)
        ids[name] = np.minimum(rng.geometric(0.2, size=shape) - 1, rows - 1).astype("int32")
        weights[name] = (
            rng.uniform(0.0, 2.0, size=shape).astype("float32")
            if weighted
            else np.ones(shape, "float32")
        )
    weights["fb"][0, 0] = 0.0  # a padded entry
    return ids, weights


def pooled_numpy(table, ids, weights, combiner):
    """keras-rs's EmbedReduce in numpy: `(rows, d loss / d rows per unit output gradient)`."""
    rows = table[ids].astype(np.float64)
    if ids.ndim == 1:
        scale = weights if combiner == "sum" else np.ones_like(weights)
        return rows * scale[:, None], scale
    if combiner == "sum":
        norm = np.ones((ids.shape[0],))
    elif combiner == "mean":
        norm = weights.sum(axis=1)
    else:
        norm = np.sqrt(np.square(weights).sum(axis=1))
    scale = weights / norm[:, None]
    return (rows * scale[..., None]).sum(axis=1), scale


def reference_optimizers(options):
    references = {}
    for name, (_, _, _, kind) in TABLES.items():
        if kind == "override":
            arguments = reference_arguments(OVERRIDE)
        elif kind == "keras_adam":
            arguments = dict(ADAM, sum_inside_sqrt=False)
        else:
            arguments = reference_arguments(options)
        references[name] = NumpyEmbeddingAdam(initial_table(name), **arguments)
    return references


def dot_loss(y_true, y_pred):
    return ops.sum(y_true * y_pred, axis=-1)


def make_model(options, configs=None, layer_optimizer="default"):
    if layer_optimizer == "default":
        layer_optimizer = kto.EmbeddingAdam(**{"learning_rate": 0.05, **options})
    layer = DistributedEmbedding(configs or feature_configs(), optimizer=layer_optimizer)
    ids = {
        name: keras.Input((per_example,) if per_example else (), dtype="int32", name=name)
        for name, (_, per_example, _) in FEATURES.items()
    }
    weights = {name: keras.Input(ids[name].shape[1:], name=f"{name}_w") for name in FEATURES}
    outputs = layer(ids, weights)
    model = keras.Model([ids, weights], ops.concatenate([outputs[n] for n in FEATURES], axis=-1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=dot_loss)
    return model, layer


def width():
    return sum(TABLES[table][1] for table, _, _ in FEATURES.values())


def reference_step(references, ids, weights, coefficients):
    """The outputs before the step, then each table's numpy step with its features' row gradients."""
    outputs, start, entries = [], 0, {name: ([], []) for name in TABLES}
    for name, (table, _, _) in FEATURES.items():
        dim, combiner = TABLES[table][1], TABLES[table][2]
        pooled, scale = pooled_numpy(references[table].weights, ids[name], weights[name], combiner)
        outputs.append(pooled)
        upstream = coefficients[:, start : start + dim] / BATCH  # d mean(sum(y * out)) / d out
        start += dim
        row_gradients = scale[..., None] * (upstream[:, None] if ids[name].ndim > 1 else upstream)
        entries[table][0].append(ids[name].reshape(-1))
        entries[table][1].append(row_gradients.reshape(-1, dim))
    for table, (table_ids, gradients) in entries.items():
        references[table].apply_sparse(np.concatenate(table_ids), np.concatenate(gradients))
    return np.concatenate(outputs, axis=-1)


def assert_tables_match(layer, references):
    tables = layer.get_embedding_tables()
    for name, reference in references.items():
        np.testing.assert_allclose(
            numpy_of(tables[name]), reference.weights, rtol=2e-6, atol=2e-7, err_msg=name
        )


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_tables_match_numpy_embedding_adam(case):
    """`train_on_batch` on a model whose loss is linear in the pooled rows: every table (two grouped by the
    layer's optimizer, shared by two features; one with its own EmbeddingAdam; one with Keras's Adam) against
    its numpy EmbeddingAdam fed the rows' gradients; the outputs against numpy's pooling."""
    options = OPTION_CASES[case]
    model, layer = make_model(options)
    assert sorted(len(m) for m in layer._grouping.members) == [1, 1, 2]
    references = reference_optimizers(options)
    for step in range(3):
        ids, weights = step_inputs(step)
        coefficients = np.random.RandomState(50 + step).normal(size=(BATCH, width()))
        coefficients = coefficients.astype("float32")
        expected = reference_step(references, ids, weights, coefficients)
        np.testing.assert_allclose(
            numpy_of(model.predict_on_batch([ids, weights])), expected, rtol=1e-5, atol=1e-6
        )
        model.train_on_batch([ids, weights], coefficients)
        assert_tables_match(layer, references)
    # Rows never looked up keep their bits (lazy): the last rows of "a" are out of the ids' reach here.
    if options.get("lazy_adam", True):
        never = [
            r
            for r in range(40)
            if all(
                r not in step_inputs(s)[0]["fa"] and r not in step_inputs(s)[0]["fa_bag"]
                for s in range(3)
            )
        ]
        np.testing.assert_array_equal(
            numpy_of(layer.get_embedding_tables()["a"])[never], initial_table("a")[never]
        )


def test_adam_tables_and_the_layer_optimizer():
    """`"adam"` takes the layer's optimizer where one is given, and Keras's default Adam where not; a
    `keras.optimizers.Adam` becomes the EmbeddingAdam with its numbers; tables of one width and equal
    optimizers share a group."""
    layer_optimizer = kto.EmbeddingAdam(0.5)
    adam = keras.optimizers.Adam(0.02, beta_1=0.8, epsilon=1e-5)
    tables = [
        TableConfig("x", 10, 2, optimizer="adam"),
        TableConfig("y", 10, 2, optimizer=adam),
        TableConfig("z", 10, 2, optimizer=adam),
        TableConfig("w", 10, 2),
    ]
    features = [FeatureConfig(t.name, t) for t in tables]
    layer = DistributedEmbedding(features, optimizer=layer_optimizer)
    assert layer.table_optimizer("x") is layer_optimizer
    assert layer.table_optimizer("w") is layer_optimizer
    converted = layer.table_optimizer("y")
    assert converted is layer.table_optimizer("z")
    assert isinstance(converted, kto.EmbeddingAdam)
    assert (converted.sum_inside_sqrt, converted.beta_1, converted.epsilon) == (False, 0.8, 1e-5)
    assert float(numpy_of(converted.learning_rate)) == pytest.approx(0.02)
    assert sorted(len(m) for m in layer._grouping.members) == [2, 2]
    alone = DistributedEmbedding([FeatureConfig("x", TableConfig("x", 10, 2, optimizer="adam"))])
    default = alone.table_optimizer("x")
    assert (default.sum_inside_sqrt, default.epsilon, default.beta_2) == (False, 1e-7, 0.999)
    assert float(numpy_of(default.learning_rate)) == pytest.approx(0.001)


def _features(*tables, shape=None):
    return [FeatureConfig(f"f{i}", t, input_shape=shape) for i, t in enumerate(tables)]


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: _features(TableConfig("t", 5, 2), TableConfig("t", 6, 2)), "'t'"),
        (lambda: [FeatureConfig("f", None)], "'f'"),
        (lambda: _features(TableConfig("t", 0, 2)), "vocabulary_size"),
        (lambda: _features(TableConfig("t", 5, -1)), "embedding_dim"),
        (lambda: _features(TableConfig("t", 5, 2, combiner="max")), "combiner"),
        (lambda: _features(TableConfig("t", 5, 2, optimizer="sgd")), "'sgd'"),
        (lambda: _features(TableConfig("t", 5, 2, optimizer="adagrad")), "'adagrad'"),
        (lambda: _features(TableConfig("t", 5, 2, optimizer=keras.optimizers.SGD())), "'SGD'"),
        (
            lambda: _features(
                TableConfig("t", 5, 2, optimizer=keras.optimizers.Adam(amsgrad=True))
            ),
            "amsgrad",
        ),
        (lambda: _features(TableConfig("t", 5, 2, placement="sparsecore")), "placement"),
        (
            lambda: _features(
                TableConfig("t", 5, 2, optimizer=kto.EmbeddingAdam(gradient_accumulation_steps=2))
            ),
            "gradient_accumulation_steps",
        ),
    ],
)
def test_misconfigurations_raise_naming_the_table(make, named):
    with pytest.raises(ValueError, match=named):
        DistributedEmbedding(make(), optimizer=kto.EmbeddingAdam())


def test_no_optimizer_and_wrong_shapes_raise():
    with pytest.raises(ValueError, match="table 't': it has no optimizer"):
        DistributedEmbedding(_features(TableConfig("t", 5, 2)))
    layer = DistributedEmbedding(
        _features(TableConfig("t", 5, 2), shape=(4, 3)), optimizer=kto.EmbeddingAdam()
    )
    with pytest.raises(ValueError, match="feature 'f0' has `input_shape=\\(4, 3\\)`"):
        layer([np.zeros((4, 2), "int32")])
    with pytest.raises(ValueError, match="2 features are configured"):
        DistributedEmbedding(
            _features(TableConfig("t", 5, 2), TableConfig("u", 5, 2)), optimizer=kto.EmbeddingAdam()
        )([np.zeros((4,), "int32")])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [3, -1, 2**30])
def test_ids_out_of_their_tables_range_read_zero_rows_and_train_nothing(bad, mode):
    """Tables "a" (pooled by "sum") and "b" are stacked; ids outside "a"'s range, in a training step beside
    valid ids, read zero rows and train nothing: "b" and "a"'s rows not looked up keep their bits, and the
    tables train as in a step where those entries have weight 0. The layer counts them."""

    def trained(ids_a, weights_a):
        a = TableConfig("a", 3, 2, initializer="ones", combiner="sum")
        b = TableConfig("b", 3, 2, initializer="ones")
        features = [
            FeatureConfig("fa", a, input_shape=(2, 2)),
            FeatureConfig("fb", b, input_shape=(2,)),
        ]
        layer = DistributedEmbedding(features, optimizer=kto.EmbeddingAdam(0.1))
        ids = [keras.Input((2,), dtype="int32"), keras.Input((), dtype="int32")]
        weights = [keras.Input((2,)), keras.Input(())]
        model = keras.Model([ids, weights], keras.layers.Concatenate()(layer(ids, weights)))
        modes = {} if mode == "default" else {mode: True}
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **modes)
        batch = [
            [np.asarray(ids_a, "int32"), np.array([1, 2], "int32")],
            [np.asarray(weights_a, "float32"), np.ones((2,), "float32")],
        ]
        looked_up = numpy_of(model.predict_on_batch(batch))
        model.train_on_batch(batch, np.full((2, 4), 2.0, "float32"))
        return looked_up, {t: numpy_of(v) for t, v in layer.get_embedding_tables().items()}, layer

    found, tables, layer = trained([[0, bad], [bad, bad]], [[1.0, 1.0], [1.0, 1.0]])
    expected, reference, _ = trained([[0, 0], [0, 0]], [[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(found[:, :2], [[1.0, 1.0], [0.0, 0.0]])
    for name in ("a", "b"):
        np.testing.assert_allclose(tables[name], reference[name], rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(tables["a"][1:], 1.0)
    np.testing.assert_array_equal(tables["b"][0], 1.0)
    assert not np.array_equal(tables["a"][0], 1.0)
    assert int(numpy_of(layer.out_of_range_ids)) == 6  # 3 looked up by `predict`, 3 by the step


@pytest.mark.parametrize("options", [{}, {"lazy_adam": False}], ids=["lazy", "not_lazy"])
def test_save_load_into_another_grouping_and_resume_exactly(tmp_path, options):
    """Trained 2 steps, saved, loaded into layers that group and order the tables otherwise: the state of
    every table carries over, and training on continues as uninterrupted training does (not lazy: each
    row's skipped steps, caught up in closed form or stepped by the sweep, to float32 rounding)."""
    model, layer = make_model(options)
    for step in range(2):
        ids, weights = step_inputs(step)
        model.train_on_batch([ids, weights], np.ones((BATCH, width()), "float32"))
    path = str(tmp_path / "tables.weights.h5")
    model.save_weights(path)
    ids, weights = step_inputs(2)
    model.train_on_batch([ids, weights], np.ones((BATCH, width()), "float32"))

    # Another grouping: "b" gets an optimizer of its own, with the layer's numbers (`max_touched_rows` does
    # not change a lookup's step, but makes the configurations differ): "b" moves from row 40 of a stacked
    # table to a table of its own.
    configs = feature_configs()
    configs["fb"].table.optimizer = kto.EmbeddingAdam(0.05, max_touched_rows=1000, **options)
    regrouped, other = make_model(options, configs=configs)
    assert sorted(len(m) for m in other._grouping.members) == [1, 1, 1, 1]
    regrouped.load_weights(path)
    regrouped.train_on_batch([ids, weights], np.ones((BATCH, width()), "float32"))
    for name, table in layer.get_embedding_tables().items():
        tolerance = dict(rtol=0, atol=0) if not options else dict(rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(
            numpy_of(other.get_embedding_tables()[name]), numpy_of(table), **tolerance
        )


def test_model_save_and_load_keeps_configs(tmp_path):
    model, layer = make_model({})
    ids, weights = step_inputs(0)
    model.train_on_batch([ids, weights], np.ones((BATCH, width()), "float32"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"dot_loss": dot_loss})
    other = next(l for l in loaded.layers if isinstance(l, DistributedEmbedding))
    for name, table in layer.get_embedding_tables().items():
        np.testing.assert_array_equal(numpy_of(other.get_embedding_tables()[name]), numpy_of(table))
    assert float(numpy_of(other.table_optimizer("c").learning_rate)) == pytest.approx(0.2)
    np.testing.assert_array_equal(
        numpy_of(loaded.predict_on_batch([ids, weights])),
        numpy_of(model.predict_on_batch([ids, weights])),
    )


def test_skip_nonfinite_updates_is_each_tables_optimizers():
    """With the layer's optimizer's `skip_nonfinite_updates=True`, a step with a NaN in the loss's coefficients
    (every table's row gradients not finite) leaves the tables that optimizer trains ("a" and "b", one stacked
    group: rows, slots and step count) bit for bit as they were; tables with optimizers of their own, which do
    not skip, take the step."""
    model, layer = make_model({"skip_nonfinite_updates": True})
    coefficients = np.random.RandomState(50).normal(size=(BATCH, width())).astype("float32")
    model.train_on_batch(list(step_inputs(0)), coefficients)
    before = {name: numpy_of(table) for name, table in layer.get_embedding_tables().items()}
    skipping = [g for g in layer._grouping.groups if g.optimizer.skip_nonfinite_updates]
    state = [[numpy_of(v) for v in g.weights] for g in skipping]
    coefficients[0, :] = np.nan
    model.train_on_batch(list(step_inputs(1)), coefficients)
    after = {name: numpy_of(table) for name, table in layer.get_embedding_tables().items()}
    for name in before:
        skips = layer.table_optimizer(name).skip_nonfinite_updates
        assert skips == (name in ("a", "b")), name
        assert np.array_equal(after[name], before[name]) == skips, name
    for group, values in zip(skipping, state):
        for want, variable in zip(values, group.weights):
            np.testing.assert_array_equal(numpy_of(variable), want, err_msg=variable.path)


def test_loss_scale_optimizer_skips_an_overflowing_step_in_every_group():
    """Under a `LossScaleOptimizer`, a step whose scaled loss overflows (coefficients near float32's maximum)
    leaves every group's tables, slots and step count bit for bit as they were and halves the scale; the
    next step trains as a run without the bad step (loss scales are powers of 2: unscaling is exact)."""
    runs = []
    for bad_step in (True, False):
        model, layer = make_model({})
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss=dot_loss
        )
        coefficients = np.random.RandomState(50).normal(size=(BATCH, width())).astype("float32")
        model.train_on_batch(list(step_inputs(0)), coefficients)
        if bad_step:
            before = [numpy_of(v) for v in layer.weights]
            model.train_on_batch(list(step_inputs(1)), np.full_like(coefficients, 3e38))
            for want, variable in zip(before, layer.weights):
                np.testing.assert_array_equal(numpy_of(variable), want, err_msg=variable.path)
            assert float(numpy_of(model.optimizer.dynamic_scale)) == 2.0**14
        model.train_on_batch(list(step_inputs(2)), coefficients)
        runs.append([numpy_of(v) for v in layer.weights])
    for with_bad, without in zip(*runs):
        np.testing.assert_array_equal(with_bad, without)


@pytest.mark.backend_neutral
def test_configs_round_trip_through_their_own_config():
    adam = kto.EmbeddingAdam(0.3, clipvalue=1.0)
    table = TableConfig("t", 10, 4, initializer="zeros", optimizer=adam, combiner="sqrtn")
    feature = FeatureConfig("f", table, input_shape=(8, 3), output_shape=(8, 4))
    config = table.get_config()
    assert config["optimizer"]["class_name"] == "EmbeddingAdam" and config["combiner"] == "sqrtn"
    again = TableConfig.from_config(config)
    assert (again.name, again.vocabulary_size, again.embedding_dim, again.combiner) == (
        "t",
        10,
        4,
        "sqrtn",
    )
    assert isinstance(again.initializer, keras.initializers.Zeros)
    assert again.optimizer.get_config() == adam.get_config()
    assert feature.get_config()["table"] == "t"
    feature_again = FeatureConfig.from_config(feature.get_config(), {"t": again})
    assert feature_again.table is again
    assert (feature_again.input_shape, feature_again.output_shape) == ((8, 3), (8, 4))


@pytest.mark.skipif(
    importlib.util.find_spec("keras_rs") is None, reason="keras-rs is not installed"
)
def test_keras_rs_configs_give_keras_rs_outputs():
    """keras-rs's own configs, as they are: our outputs equal keras-rs's layer's on the same tables."""
    import keras_rs

    tables = [
        keras_rs.layers.TableConfig(
            name,
            rows,
            dim,
            initializer=keras.initializers.Constant(initial_table(name)),
            combiner=combiner,
        )
        for name, (rows, dim, combiner, _) in TABLES.items()
    ]
    by_name = {t.name: t for t in tables}
    configs = {
        name: keras_rs.layers.FeatureConfig(
            name,
            by_name[table],
            input_shape=(BATCH,) if k is None else (BATCH, k),
            output_shape=(BATCH, TABLES[table][1]),
        )
        for name, (table, k, _) in FEATURES.items()
    }
    ours = DistributedEmbedding(configs, optimizer=kto.EmbeddingAdam())
    theirs = keras_rs.layers.DistributedEmbedding(configs)
    ids, weights = step_inputs(0)
    expected = theirs(ids, weights)
    actual = ours(ids, weights)
    for name in FEATURES:
        np.testing.assert_allclose(
            numpy_of(actual[name]), numpy_of(expected[name]), rtol=1e-6, atol=1e-7, err_msg=name
        )
    assert ours.table_optimizer("a") is ours.optimizer  # keras-rs's default "adam": the layer's


def _ragged_rows():
    """Rows of up to K ids (one empty), their weights, and one dense id per example."""
    rng = np.random.RandomState(7)
    lengths = [1, 3, 0, 2, 3, 1]
    rows = [rng.randint(0, 40, n).tolist() for n in lengths]
    weights = [rng.uniform(0.5, 2.0, n).astype("float32").tolist() for n in lengths]
    return rows, weights, rng.randint(0, 40, BATCH).astype("int32")


def _sparse_inputs(rows, weights):
    """`(ids, weights)` as the backend's ragged or sparse tensors, or None where it has neither."""
    indices = np.array([[b, j] for b, r in enumerate(rows) for j in range(len(r))], "int64")
    values = np.array([i for r in rows for i in r], "int32")
    weight_values = np.array([w for ws in weights for w in ws], "float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return {
            "ragged": (tf.ragged.constant(rows, tf.int32), tf.ragged.constant(weights, tf.float32)),
            "sparse": (
                tf.SparseTensor(indices, values, (BATCH, K)),
                tf.SparseTensor(indices, weight_values, (BATCH, K)),
            ),
        }
    if BACKEND == "jax":
        from jax.experimental import sparse

        return {
            "sparse": (
                sparse.BCOO((values, indices.astype("int32")), shape=(BATCH, K)),
                sparse.BCOO((weight_values, indices.astype("int32")), shape=(BATCH, K)),
            )
        }
    return {}


@pytest.mark.skipif(
    BACKEND == "torch", reason="torch has no ragged or sparse inputs (keras-rs: TF and JAX)"
)
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_ragged_and_sparse_inputs_look_up_and_update_only_their_entries(combiner):
    """A bag feature given as a ragged or sparse tensor, beside a dense feature of the same table: the pooled
    rows equal numpy's over the present entries (an empty row pools to zeros), and a training step updates
    the table as the numpy EmbeddingAdam fed only those entries' gradients: padding looks nothing up."""
    rows, weights, single = _ragged_rows()
    for kind, (bag, bag_weights) in _sparse_inputs(rows, weights).items():
        table = TableConfig(
            "a",
            40,
            4,
            initializer=keras.initializers.Constant(initial_table("a")),
            combiner=combiner,
        )
        features = {
            "bag": FeatureConfig("bag", table, input_shape=(BATCH, K)),
            "one": FeatureConfig("one", table, input_shape=(BATCH,)),
        }
        layer = DistributedEmbedding(features, optimizer=kto.EmbeddingAdam(0.05))
        reference = NumpyEmbeddingAdam(initial_table("a"), learning_rate=0.05)
        w = reference.weights.astype(np.float64)
        norms = [
            (sum(ws) if combiner == "mean" else np.sqrt(sum(x * x for x in ws))) if ws else 1.0
            for ws in weights
        ]
        expected = np.stack(
            [
                sum((wt * w[i] for i, wt in zip(r, ws)), np.zeros(4)) / n
                for r, ws, n in zip(rows, weights, norms)
            ]
        )
        coefficients = np.random.RandomState(3).normal(size=(BATCH, 4))

        def loss_of(outputs):
            return ops.sum(outputs["bag"] * coefficients) + ops.sum(outputs["one"])

        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                outputs = layer(
                    {"bag": bag, "one": single}, {"bag": bag_weights, "one": None}, training=True
                )
                loss = loss_of(outputs)
            tape.gradient(loss, layer.trainable_variables)
        else:
            import jax

            outputs = layer({"bag": bag, "one": single}, {"bag": bag_weights, "one": None})
            trainable = [v.value for v in layer.trainable_variables]

            def loss_fn(values):
                out, _ = layer.stateless_call(
                    values,
                    [v.value for v in layer.non_trainable_variables],
                    {"bag": bag, "one": single},
                    {"bag": bag_weights, "one": None},
                    training=True,
                )
                return loss_of(out)

            new_values = jax.grad(loss_fn)(trainable)
            for variable, value in zip(layer.trainable_variables, new_values):
                variable.assign(value)  # `overwrite_with_gradient`: the gradient is the new value
        np.testing.assert_allclose(
            numpy_of(outputs["bag"]), expected, rtol=1e-5, atol=1e-6, err_msg=kind
        )
        ids = [i for r in rows for i in r] + single.tolist()
        gradients = [
            coefficients[b] * wt / norms[b]
            for b, (r, ws) in enumerate(zip(rows, weights))
            for wt in ws
        ]
        gradients += [np.ones(4)] * BATCH
        reference.apply_sparse(np.array(ids), np.array(gradients))
        np.testing.assert_allclose(
            numpy_of(layer.get_embedding_tables()["a"]),
            reference.weights,
            rtol=2e-6,
            atol=2e-7,
            err_msg=kind,
        )


@pytest.mark.skipif(
    BACKEND != "jax", reason=f"keras.distribution runs on the JAX backend; this run is {BACKEND}"
)
def test_jax_model_parallel_stacked_tables_split_by_rows():
    """The groups' stacked tables split by rows over 4 of 8 devices (`ModelParallel`) by a LayoutMap naming only
    the tables, their slots laid out like them by themselves: the same numbers as on one device."""
    if len(keras.distribution.list_devices()) < 8:
        pytest.skip("needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")

    def train(model):
        for step in range(2):
            ids, weights = step_inputs(step)
            coefficients = np.random.RandomState(50 + step).normal(size=(BATCH, width()))
            model.train_on_batch([ids, weights], coefficients.astype("float32"))

    single, one = make_model({})
    train(single)
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/embeddings"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    try:
        split, layer = make_model({})
        train(split)
    finally:
        keras.distribution.set_distribution(None)
    for group in layer._grouping.groups:
        for variable in (group.embeddings, group.momenta, group.velocities):
            shard = variable.value.addressable_shards[0].data
            assert shard.shape[0] == group.input_dim // 4, variable.path
    for name, table in one.get_embedding_tables().items():
        np.testing.assert_allclose(
            numpy_of(layer.get_embedding_tables()[name]), numpy_of(table), rtol=1e-5, atol=1e-7
        )


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="TF's eager, graph and XLA steps; JAX runs compiled (the tests above); torch: the next test",
)
@pytest.mark.parametrize("compilation", ["run_eagerly", "jit_compile"])
def test_eager_and_compiled_steps_agree(compilation):
    """The same steps eagerly (`run_eagerly=True`), in a `tf.function` (the default) and compiled by XLA
    (`jit_compile=True`): the same tables."""
    tables = []
    for flags in ({}, {compilation: True}):
        model, layer = make_model({})
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=dot_loss, **flags)
        for step in range(2):
            ids, weights = step_inputs(step)
            coefficients = np.random.RandomState(50 + step).normal(size=(BATCH, width()))
            model.train_on_batch([ids, weights], coefficients.astype("float32"))
        tables.append({k: numpy_of(v) for k, v in layer.get_embedding_tables().items()})
    for name in tables[0]:
        np.testing.assert_allclose(
            tables[1][name], tables[0][name], rtol=1e-6, atol=1e-7, err_msg=name
        )


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "torch", reason="`torch.compile` is the torch backend's compiler")
def test_torch_compile_steps_equal_eager_steps(monkeypatch):
    """`jit_compile=True` on torch (`torch.compile` of the train step, the lookups' updates in their
    backward passes) gives the eager steps' tables, on a small model. Traced and functionalized as inductor
    would take it (`aot_eager`): inductor's code generation is torch's, tested once in test_torch_rows.py."""
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    tables = []
    for jit_compile in (False, True):
        shared = TableConfig(
            "a", 40, 4, initializer=keras.initializers.Constant(initial_table("a"))
        )
        own = TableConfig(
            "c", 20, 3, initializer=keras.initializers.Constant(initial_table("c")),
            optimizer=kto.EmbeddingAdam(0.2),
        )  # fmt: skip
        features = {"x": FeatureConfig("x", shared), "y": FeatureConfig("y", own)}
        layer = DistributedEmbedding(features, optimizer=kto.EmbeddingAdam(0.05))
        inputs = {name: keras.Input((), dtype="int32", name=name) for name in features}
        outputs = layer(inputs)
        model = keras.Model(inputs, ops.concatenate([outputs["x"], outputs["y"]], axis=-1))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=dot_loss, jit_compile=jit_compile)
        for step in range(2):
            ids = step_inputs(step)[0]
            x = {"x": ids["fa"], "y": np.minimum(ids["fd"], 19)}
            model.train_on_batch(
                x, np.random.RandomState(step).normal(size=(BATCH, 7)).astype("float32")
            )
        tables.append({k: numpy_of(v) for k, v in layer.get_embedding_tables().items()})
    for name in tables[0]:
        np.testing.assert_allclose(
            tables[1][name], tables[0][name], rtol=1e-6, atol=1e-7, err_msg=name
        )
        assert not np.array_equal(tables[0][name], initial_table(name))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.distribute is TensorFlow's")
def test_tf_mirrored_strategy_trains_every_table_as_one_device():
    """Under MirroredStrategy (2 logical CPU devices) the grouped tables, shared and pooled features
    included, train as on one device, and the replicas' copies stay alike."""
    import tensorflow as tf
    from _mirrored import mirrored_strategy

    def train(strategy):
        with strategy.scope():
            model, layer = make_model({})
        for step in range(3):
            ids, weights = step_inputs(step)
            model.train_on_batch([ids, weights], np.ones((BATCH, width()), "float32"))
        return layer

    mirrored, single = train(mirrored_strategy()), train(tf.distribute.get_strategy())
    for group, want_group in zip(mirrored._grouping.groups, single._grouping.groups):
        for name, variable in group.table_state().items():
            copies = [numpy_of(v) for v in variable.value.values]
            np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)
            want = numpy_of(want_group.table_state()[name])
            np.testing.assert_allclose(copies[0], want, rtol=1e-6, atol=1e-7, err_msg=name)
