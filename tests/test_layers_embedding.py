"""`keras_tpu_optim.layers.Embedding`: the table trained in the lookup's backward pass, on every backend.

References, written independently of the layer: the numpy EmbeddingAdam
(tests/reference) fed the gradient of the looked-up rows computed in numpy
from the model's formula, and Keras's own optimizers for the rest of a mixed
model, fed the same numpy gradients.
"""

import warnings

import numpy as np
import pytest

import keras

import keras_tpu_optim as kto
from _kto_models import custom_training_loop
from reference.numpy_embedding_adam import NumpyEmbeddingAdam

BACKEND = keras.backend.backend()
ROWS, DIM, BATCH, K = 40, 4, 6, 3
# Duplicates within a step and across steps; rows 12 and up are never looked up.
STEP_IDS = [
    [[0, 3, 3], [5, 0, 7], [3, 3, 1], [11, 2, 2], [9, 9, 9], [4, 0, 6]],
    [[7, 7, 1], [1, 10, 8], [0, 0, 0], [2, 3, 4], [5, 6, 7], [8, 9, 10]],
    [[11, 11, 3], [6, 6, 6], [1, 1, 2], [3, 0, 5], [10, 4, 4], [2, 2, 2]],
]


def initial_table():
    return np.random.RandomState(0).normal(size=(ROWS, DIM)).astype("float32")


def targets(step, shape):
    return np.random.RandomState(100 + step).normal(size=shape).astype("float32")


def numpy_of(x):
    return keras.ops.convert_to_numpy(x).astype(np.float64)


OPTION_CASES = {
    "default": {},
    "clipping_and_decay": {
        "clipvalue": 0.02,
        "clip_weight_min": -1.0,
        "clip_weight_max": 1.0,
        "weight_decay_factor": 0.05,
        "multiply_weight_decay_factor_by_learning_rate": True,
    },
    "last_occurrence": {"use_gradient_accumulation": False, "sum_inside_sqrt": False},
    "rowwise_per_row": {"second_moment": "rowwise", "bias_correction": "per_row"},
    "schedule_keras_decay": {
        "learning_rate": keras.optimizers.schedules.ExponentialDecay(
            0.05, decay_steps=1, decay_rate=0.5
        ),
        "weight_decay": 0.1,
    },
    "not_lazy": {"lazy_adam": False},
}


def reference_arguments(options):
    options = dict(options)
    schedule = options.get("learning_rate")
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        options["learning_rate"] = lambda step: 0.05 * 0.5**step
    if "weight_decay" in options:  # Keras's keyword: the decay multiplied by the learning rate
        options["weight_decay_factor"] = options.pop("weight_decay")
        options["multiply_weight_decay_factor_by_learning_rate"] = True
    options.setdefault("learning_rate", 0.05)
    return options


def table_model(options):
    optimizer = kto.EmbeddingAdam(**{"learning_rate": 0.05, **options})
    layer = kto.layers.Embedding(
        ROWS,
        DIM,
        optimizer=optimizer,
        embeddings_initializer=keras.initializers.Constant(initial_table()),
    )
    ids = keras.Input((K,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, layer


def layer_state(layer):
    state = {
        "embeddings": layer.embeddings,
        "momenta": layer.momenta,
        "velocities": layer.velocities,
    }
    if layer.row_steps is not None and layer.catch_up_sums is None:
        state["row_steps"] = layer.row_steps
    return {name: numpy_of(value) for name, value in state.items()}


def assert_matches(layer, reference, before=None, looked_up=()):
    if layer.catch_up_sums is not None:  # `lazy_adam=False`: rows behind are caught up in one pass
        layer.catch_up()
        np.testing.assert_array_equal(numpy_of(layer.row_steps), reference.iterations)
    state = layer_state(layer)
    np.testing.assert_allclose(state["embeddings"], reference.weights, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(state["momenta"], reference.momenta, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(state["velocities"], reference.velocities, rtol=1e-5, atol=1e-12)
    if "row_steps" in state:
        np.testing.assert_array_equal(state["row_steps"], reference.row_steps)
    assert float(numpy_of(layer.iterations)) == reference.iterations
    if before is not None and reference.lazy_adam:
        untouched = np.setdiff1d(np.arange(ROWS), np.asarray(looked_up))
        for name, value in state.items():
            np.testing.assert_array_equal(value[untouched], before[name][untouched])


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_table_matches_numpy_embedding_adam(case):
    """`train_on_batch` on a model whose loss is the MSE of the looked-up rows: the numpy reference, fed
    `d loss / d rows = 2 (rows - y) / (rows * dim)` at the looked-up ids, gives the table and slots."""
    options = OPTION_CASES[case]
    model, layer = table_model(options)
    reference = NumpyEmbeddingAdam(initial_table(), **reference_arguments(options))
    for step, ids in enumerate(STEP_IDS):
        ids = np.asarray(ids, np.int32)
        y = targets(step, (BATCH, K, DIM))
        gradient = 2 * (reference.weights[ids].astype(np.float64) - y) / (BATCH * K * DIM)
        before = layer_state(layer)
        model.train_on_batch(ids, y)
        reference.apply_sparse(ids.reshape(-1), gradient.reshape(-1, DIM))
        assert_matches(layer, reference, before, ids)
    # The model's optimizer sees only the step count, overwritten: it keeps no state for the table.
    assert [v.path.split("/")[-1] for v in model.optimizer.variables] == [
        "iteration",
        "learning_rate",
    ]


def pooled_model(layer, head_optimizer):
    ids = keras.Input((K,), dtype="int32")
    pooled = keras.ops.mean(layer(ids), axis=1)
    head = keras.layers.Dense(1, kernel_initializer="glorot_uniform", name="head")
    model = keras.Model(ids, head(pooled))
    model.compile(optimizer=head_optimizer, loss="mse")
    return model, head


HEAD_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "ours_adafactor": lambda: kto.Adafactor(learning_rate=0.01),
}


def head_reference_optimizer(name):
    """Keras's own optimizer with the same numbers (ours matches Keras's Adafactor: tests/test_adafactor.py)."""
    if name == "ours_adafactor":
        return keras.optimizers.Adafactor(learning_rate=0.01)
    return HEAD_OPTIMIZERS[name]()


@pytest.mark.parametrize("head_optimizer", list(HEAD_OPTIMIZERS))
def test_mixed_model_in_fit(head_optimizer):
    """ids -> table (ours, its own EmbeddingAdam) -> mean over the ids -> Dense head (the model's optimizer),
    trained by `fit`: the table against the numpy EmbeddingAdam, the head against Keras's optimizer, both fed
    the gradients of the MSE computed in numpy."""
    layer = kto.layers.Embedding(
        ROWS,
        DIM,
        optimizer=kto.EmbeddingAdam(0.05, clipvalue=0.5),
        embeddings_initializer=keras.initializers.Constant(initial_table()),
    )
    model, head = pooled_model(layer, HEAD_OPTIMIZERS[head_optimizer]())
    ids = np.concatenate([np.asarray(s, np.int32) for s in STEP_IDS])
    y = targets(0, (len(ids), 1))
    kernel, bias = numpy_of(head.kernel), numpy_of(head.bias)
    reference = NumpyEmbeddingAdam(initial_table(), learning_rate=0.05, clipvalue=0.5)
    reference_kernel = keras.Variable(kernel.astype("float32"))
    reference_bias = keras.Variable(bias.astype("float32"))
    reference_head = head_reference_optimizer(head_optimizer)
    for start in range(0, len(ids), BATCH):
        batch_ids, batch_y = ids[start : start + BATCH], y[start : start + BATCH]
        rows = reference.weights[batch_ids].astype(np.float64)
        pooled = rows.mean(axis=1)
        w, b = numpy_of(reference_kernel), numpy_of(reference_bias)
        d_prediction = 2 * (pooled @ w + b - batch_y) / len(batch_ids)
        d_rows = np.repeat((d_prediction @ w.T)[:, None, :] / K, K, axis=1)
        reference.apply_sparse(batch_ids.reshape(-1), d_rows.reshape(-1, DIM))
        reference_head.apply(
            [
                keras.ops.convert_to_tensor(g, "float32")
                for g in (pooled.T @ d_prediction, d_prediction.sum(axis=0))
            ],
            [reference_kernel, reference_bias],
        )
    model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_matches(layer, reference)
    np.testing.assert_allclose(
        numpy_of(head.kernel), numpy_of(reference_kernel), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(numpy_of(head.bias), numpy_of(reference_bias), rtol=1e-5, atol=1e-6)
    # The head's optimizer keeps state for the head alone.
    table_state = [v for v in model.optimizer.variables if "embedding" in v.path]
    assert not table_state, [v.path for v in table_state]


def test_custom_train_step_evaluate_and_predict():
    """A hand-written training step (Keras's guides, per backend) trains the table as `fit` does; `evaluate` and
    `predict` only look rows up."""
    model, layer = table_model({})
    reference = NumpyEmbeddingAdam(initial_table(), learning_rate=0.05)
    batches = []
    for step, ids in enumerate(STEP_IDS):
        ids = np.asarray(ids, np.int32)
        y = targets(step, (BATCH, K, DIM))
        gradient = 2 * (reference.weights[ids].astype(np.float64) - y) / (BATCH * K * DIM)
        reference.apply_sparse(ids.reshape(-1), gradient.reshape(-1, DIM))
        batches.append((ids, y))
    custom_training_loop(model, model.optimizer, keras.losses.MeanSquaredError(), batches)
    assert_matches(layer, reference)
    before = layer_state(layer)
    model.evaluate(batches[0][0], batches[0][1], verbose=0)
    predicted = model.predict(batches[0][0], verbose=0)
    np.testing.assert_allclose(predicted, reference.weights[batches[0][0]], rtol=1e-6)
    for name, value in layer_state(layer).items():
        np.testing.assert_array_equal(value, before[name])
    assert float(numpy_of(layer.iterations)) == len(STEP_IDS)


def test_optimizer_none_is_keras_embedding():
    """Without `optimizer` the layer is `keras.layers.Embedding`: the same variables, and the same numbers
    trained by the model's optimizer."""
    results = []
    for layer_class in (keras.layers.Embedding, kto.layers.Embedding):
        layer = layer_class(
            ROWS,
            DIM,
            embeddings_initializer=keras.initializers.Constant(initial_table()),
            mask_zero=True,
        )
        ids = keras.Input((K,), dtype="int32")
        model = keras.Model(ids, layer(ids))
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        for step, batch in enumerate(STEP_IDS):
            model.train_on_batch(np.asarray(batch, np.int32), targets(step, (BATCH, K, DIM)))
        results.append(([v.path.split("/")[-1] for v in layer.weights], numpy_of(layer.embeddings)))
        mask = layer.compute_mask(np.asarray(STEP_IDS[0], np.int32))
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(mask), np.asarray(STEP_IDS[0]) != 0
        )
    assert results[0][0] == results[1][0] == ["embeddings"]
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_save_and_load_resume_exactly(tmp_path):
    """`model.save` / `keras.saving.load_model` restore the table, the step count, the slots and the layer
    optimizer's configuration; training the loaded model continues with the numbers of the original."""
    options = {"clipvalue": 0.02, "bias_correction": "per_row", "second_moment": "rowwise"}
    model, layer = table_model(options)
    for step in range(2):
        model.train_on_batch(np.asarray(STEP_IDS[step], np.int32), targets(step, (BATCH, K, DIM)))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_layer = loaded.layers[1]
    assert isinstance(loaded_layer, kto.layers.Embedding)
    assert loaded_layer.optimizer.get_config() == layer.optimizer.get_config()
    for model_ in (model, loaded):
        model_.train_on_batch(np.asarray(STEP_IDS[2], np.int32), targets(2, (BATCH, K, DIM)))
    for name, value in layer_state(layer).items():
        np.testing.assert_array_equal(layer_state(loaded_layer)[name], value)
    assert float(numpy_of(loaded_layer.iterations)) == 3.0


@pytest.mark.parametrize("compiled", ["default", "run_eagerly", "jit_compile"])
@pytest.mark.parametrize(
    "options",
    [{}, {"lazy_adam": False}, {"use_gradient_accumulation": False, "bias_correction": "per_row"}],
    ids=["lazy", "not_lazy", "last_per_row"],
)
def test_skip_nonfinite_updates_leaves_the_table_as_it_was(options, compiled):
    """With `skip_nonfinite_updates=True`, a step whose looked-up rows' gradient is not finite (a NaN target)
    leaves every variable of the layer bit for bit as it was, `iterations` included; the next steps train as
    in a run without the bad step."""
    if compiled != "default" and BACKEND != "tensorflow":
        pytest.skip(f"{compiled} is a TF trainer's mode here (the default step on {BACKEND})")
    options = {"skip_nonfinite_updates": True, **options}
    model, layer = table_model(options)
    clean, clean_layer = table_model(options)
    if compiled != "default":
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **{compiled: True})
    bad = targets(1, (BATCH, K, DIM))
    bad[2, 1, 3] = np.nan
    model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))
    before = [numpy_of(v) for v in layer.weights]
    model.train_on_batch(np.asarray(STEP_IDS[1], np.int32), bad)
    for want, variable in zip(before, layer.weights):
        np.testing.assert_array_equal(numpy_of(variable), want, err_msg=variable.path)
    for step in (2, 0):
        model.train_on_batch(np.asarray(STEP_IDS[step], np.int32), targets(step, (BATCH, K, DIM)))
    for step in (0, 2, 0):
        clean.train_on_batch(np.asarray(STEP_IDS[step], np.int32), targets(step, (BATCH, K, DIM)))
    assert float(numpy_of(layer.iterations)) == 3.0
    for want, variable in zip(clean_layer.weights, layer.weights):
        np.testing.assert_allclose(
            numpy_of(variable), numpy_of(want), rtol=1e-6, atol=1e-7, err_msg=variable.path
        )


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"optimizer": "adam"}, "optimizer"),
        ({"optimizer": kto.EmbeddingAdam(use_ema=True)}, "use_ema"),
        (
            {"optimizer": kto.EmbeddingAdam(gradient_accumulation_steps=2)},
            "gradient_accumulation_steps",
        ),
        ({"optimizer": kto.EmbeddingAdam(clipnorm=1.0)}, "clipnorm"),
        ({"optimizer": kto.EmbeddingAdam(global_clipnorm=1.0)}, "global_clipnorm"),
        (
            {"optimizer": kto.EmbeddingAdam(), "embeddings_regularizer": "l2"},
            "embeddings_regularizer",
        ),
        (
            {"optimizer": kto.EmbeddingAdam(), "embeddings_constraint": "non_neg"},
            "embeddings_constraint",
        ),
    ],
)
def test_unsupported_options_raise_naming_them(arguments, named):
    with pytest.raises(ValueError, match=named):
        kto.layers.Embedding(ROWS, DIM, **arguments)


@pytest.mark.parametrize(
    "name, value", [("use_ema", True), ("second_moment", "rowwise"), ("bias_correction", "per_row")]
)
def test_option_set_after_construction_is_checked_at_the_next_step(name, value):
    model, layer = table_model({})
    setattr(layer.optimizer, name, value)
    with pytest.raises(ValueError, match=name):
        model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))


def test_public_names_beyond_keras_embedding_are_documented():
    ours = kto.layers.Embedding(ROWS, DIM, optimizer=kto.EmbeddingAdam(bias_correction="per_row"))
    ours.build()
    keras_layer = keras.layers.Embedding(ROWS, DIM)
    keras_layer.build()
    public = lambda layer: {name for name in dir(layer) if not name.startswith("_")}
    added = public(ours) - public(keras_layer)
    assert added == {
        "optimizer",
        "iterations",
        "momenta",
        "velocities",
        "row_steps",
        "catch_up_sums",
        "catch_up",
        "table_state",
        "restart_catch_up_sums",
        "out_of_range_ids",
    }
    for name in added:
        assert (
            f"`{name}`" in kto.layers.Embedding.__doc__
            or f"    {name}:" in kto.layers.Embedding.__doc__
        ), name


@pytest.mark.parametrize(
    "options, added",
    [
        ({}, []),
        ({"bias_correction": "per_row"}, ["row_steps"]),
        ({"lazy_adam": False}, ["row_steps", "catch_up_sums"]),
    ],
)
def test_table_state_names_the_saved_variables_in_order(options, added):
    layer = kto.layers.Embedding(ROWS, DIM, optimizer=kto.EmbeddingAdam(**options))
    layer.build()
    state = layer.table_state()
    assert list(state) == ["embeddings", "iterations", "momenta", "velocities", *added]
    assert all(getattr(layer, name) is variable for name, variable in state.items())
    store = {}
    layer.save_own_variables(store)
    assert list(store) == [str(i) for i in range(len(state))]
    assert all(store[str(i)] is variable for i, variable in enumerate(state.values()))


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs eagerly: no compiler to insert copies")
@pytest.mark.parametrize(
    "options",
    [{}, {"bias_correction": "per_row", "second_moment": "rowwise"}, {"lazy_adam": False}],
    ids=["full", "row_slots", "not_lazy"],
)
def test_compiled_train_step_copies_no_table_or_slot(options):
    """Keras's compiled train step (JAX: `jax.jit(model.train_step, donate_argnums=0)`, as `fit` runs it; TF: the
    train function under `jit_compile=True`) writes the table and its slots in place: its optimized HLO copies
    no array of the table's rows."""
    import re

    rows = 1009  # a row count no other array of the step has
    optimizer = kto.EmbeddingAdam(0.05, **options)
    layer = kto.layers.Embedding(rows, DIM, optimizer=optimizer)
    ids = keras.Input((K,), dtype="int32")
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    x, y = np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM))
    if BACKEND == "jax":
        import jax

        model.optimizer.build(model.trainable_variables)
        state = tuple(
            [v.value for v in variables]
            for variables in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.optimizer.variables,
                model.metrics_variables,
            )
        )
        hlo = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile().as_text()
    else:
        import tensorflow as tf

        model.train_on_batch(x, y)  # builds the optimizer and the train function
        step = tf.function(model.train_step, jit_compile=True)
        hlo = step.experimental_get_compiler_ir((tf.constant(x), tf.constant(y)))(
            stage="optimized_hlo"
        )
    copies = [
        line for line in hlo.splitlines() if " copy(" in line and re.search(rf"\[{rows}[,\]]", line)
    ]
    assert not copies, "the compiled step copies a table or a slot:\n" + "\n".join(copies)
    table_lines = [line for line in hlo.splitlines() if f"[{rows},{DIM}]" in line]
    assert any("scatter" in line.lower() for line in table_lines), (
        "no row scatter into the table found"
    )


def pooled_layer_model(seed=0, **options):
    """ids -> ours (its own EmbeddingAdam) -> flatten -> Dense head, compiled with Keras's Adam."""
    keras.utils.set_random_seed(seed)
    layer = kto.layers.Embedding(
        ROWS, DIM, optimizer=kto.EmbeddingAdam(0.05, clipvalue=0.5, **options), name="table"
    )
    model = keras.Sequential(
        [
            keras.Input((K,), dtype="int32"),
            layer,
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model, layer


def fit_data():
    ids = np.concatenate([np.asarray(s, np.int32) for s in STEP_IDS])
    return ids, targets(0, (len(ids), 1))


def test_orbax_checkpoint_resumes_with_load_checkpoint(tmp_path):
    """`keras.callbacks.OrbaxCheckpoint` saves the layer's table, slots and step count with the model's
    variables; `kto.load_checkpoint` restores them into a fresh model, which trains on exactly as the original."""
    pytest.importorskip("orbax.checkpoint")
    ids, y = fit_data()
    keras.backend.clear_session(free_memory=False)
    model, layer = pooled_layer_model(seed=0)
    directory = str(tmp_path / "ckpt")
    checkpoint = keras.callbacks.OrbaxCheckpoint(
        directory, save_freq=len(STEP_IDS), save_on_background=False
    )
    model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    keras.backend.clear_session(
        free_memory=False
    )  # the fresh model gets the saved model's layer names
    restored, restored_layer = pooled_layer_model(seed=1)
    kto.load_checkpoint(restored, directory)
    for trained in (model, restored):
        trained.fit(ids[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for want, got in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(numpy_of(got), numpy_of(want), err_msg=want.path)
    assert float(numpy_of(restored_layer.iterations)) == len(STEP_IDS) + 1


def _rows_split_over_4_of_8(key, axes=("model", None)):
    """A `ModelParallel` distribution whose LayoutMap gives `key` `axes` on a 2 x 4 ("batch", "model") mesh."""
    if len(keras.distribution.list_devices()) < 8:
        pytest.skip(
            "needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (dev/test.sh sets it)"
        )
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.mark.skipif(
    BACKEND != "jax", reason=f"keras.distribution runs on the JAX backend; this run is {BACKEND}"
)
@pytest.mark.parametrize("lazy_adam", [True, False], ids=["lazy", "not_lazy"])
def test_jax_model_parallel_rows_split_matches_one_device(lazy_adam):
    """The table split by rows over 4 of 8 devices (`ModelParallel`) by a LayoutMap naming only the table: its
    slots (and `row_steps`) are laid out like it by themselves, and train the same numbers as on one device."""
    distribution = _rows_split_over_4_of_8(".*table/embeddings")
    ids, y = fit_data()
    single, _ = pooled_layer_model(lazy_adam=lazy_adam)
    single.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    keras.distribution.set_distribution(distribution)
    try:
        split, layer = pooled_layer_model(lazy_adam=lazy_adam)
        split.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    row_state = (layer.embeddings, layer.momenta, layer.velocities)
    for variable in row_state + (() if lazy_adam else (layer.row_steps,)):
        assert len(variable.value.sharding.device_set) == 8
        shard = variable.value.addressable_shards[0].data.shape
        assert shard == (ROWS // 4,) + tuple(variable.shape[1:]), variable.path
    for want, got in zip(single.weights, split.weights):
        np.testing.assert_allclose(
            numpy_of(got), numpy_of(want), rtol=1e-5, atol=1e-7, err_msg=want.path
        )


@pytest.mark.skipif(
    BACKEND != "jax", reason=f"keras.distribution runs on the JAX backend; this run is {BACKEND}"
)
def test_jax_layout_map_laying_a_slot_apart_from_its_table_is_refused():
    """A LayoutMap key that would split `momenta` where the table is whole: refused, naming the key, the slot and
    the table, as the optimizers refuse it for their slots."""
    keras.distribution.set_distribution(_rows_split_over_4_of_8(".*table/momenta"))
    try:
        with pytest.raises(
            ValueError,
            match=r"key '\.\*table/momenta' gives Embedding's state '\w+/table/momenta'.*'\w+/table/embeddings'",
        ):
            pooled_layer_model()
    finally:
        keras.distribution.set_distribution(None)


def test_two_lookups_in_one_step_raise():
    """A table looked up twice in one step would be updated twice (on JAX its two "gradients" would add up): the
    traced step raises instead (JAX, TF), or on torch the second backward pass of the step."""
    layer = kto.layers.Embedding(ROWS, DIM, optimizer=kto.EmbeddingAdam(0.05))
    users, friends = keras.Input((K,), dtype="int32"), keras.Input((K,), dtype="int32")
    model = keras.Model([users, friends], layer(users) + layer(friends))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ids = np.asarray(STEP_IDS[0], np.int32)
    with pytest.raises(ValueError, match="called twice in one training step"):
        model.train_on_batch([ids, ids], targets(0, (BATCH, K, DIM)))
    # One lookup per step, in one model or several, is fine: a second model sharing the layer trains on.
    single = keras.Model(users, layer(users))
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for step in range(2):
        single.train_on_batch(ids, targets(step, (BATCH, K, DIM)))
    assert float(numpy_of(layer.iterations)) == 2


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's")
@pytest.mark.parametrize("mode", ["default", "run_eagerly", "loss_scale_factor"])
@pytest.mark.parametrize(
    "options", [{}, {"second_moment": "rowwise", "bias_correction": "per_row"}]
)
def test_tf_mirrored_strategy_trains_the_table_as_one_device(options, mode):
    """Under MirroredStrategy (2 logical CPU devices) each replica looks up half the batch; every replica's
    rows and gradients reach one update, the mirrored copies stay alike, and the table, slots and count
    are one device's (its float32 rounding), also with a model's optimizer that scales the loss. (Keras's own models do not run under this strategy with
    `jit_compile=True` here: XLA reaches the other replica's variables.)"""
    import tensorflow as tf
    from _mirrored import mirrored_strategy

    def train(strategy):
        with strategy.scope():
            model, layer = table_model(options)
            if mode == "loss_scale_factor":
                model.compile(
                    optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=64.0), loss="mse"
                )
            elif mode != "default":
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **{mode: True})
        for step, ids in enumerate(STEP_IDS):
            model.train_on_batch(np.asarray(ids, np.int32), targets(step, (BATCH, K, DIM)))
        return layer

    mirrored, single = train(mirrored_strategy()), train(tf.distribute.get_strategy())
    for name, variable in mirrored.table_state().items():
        copies = [numpy_of(v) for v in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)
        np.testing.assert_allclose(
            copies[0], numpy_of(single.table_state()[name]), rtol=1e-6, atol=1e-7, err_msg=name
        )
    assert float(numpy_of(mirrored.iterations)) == len(STEP_IDS)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's")
def test_tf_strategies_the_layer_cannot_serve_raise_naming_them():
    import tensorflow as tf
    from _mirrored import mirrored_strategy

    mirrored_strategy()  # two logical CPU devices, or a skip
    central = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with central.scope():
        model, _ = table_model({})
    with pytest.raises(ValueError, match="not under CentralStorageStrategy"):
        model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))
    with mirrored_strategy().scope():
        model, _ = table_model({"lazy_adam": False})
    with pytest.raises(ValueError, match="lazy_adam=False.*MirroredStrategy"):
        model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))
    with mirrored_strategy().scope():
        model, _ = table_model({"skip_nonfinite_updates": True})
    with pytest.raises(
        ValueError, match="'embedding[^']*'.*skip_nonfinite_updates=True.*MirroredStrategy"
    ):
        model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))
    with mirrored_strategy().scope():
        model, _ = table_model({})
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse"
        )
    with pytest.raises(ValueError, match="'embedding[^']*'.*LossScaleOptimizer.*MirroredStrategy"):
        model.train_on_batch(np.asarray(STEP_IDS[0], np.int32), targets(0, (BATCH, K, DIM)))


def test_model_optimizer_that_accumulates_raises_naming_it():
    """The table would be updated at every micro-step of an accumulated step: the first training call raises,
    before anything is updated."""
    model, layer = pooled_layer_model()
    before = numpy_of(layer.embeddings)
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), loss="mse")
    ids, y = fit_data()
    model.predict(ids[:BATCH], verbose=0)  # looking up is not training
    with pytest.raises(ValueError, match="table.*gradient_accumulation_steps=2"):
        model.train_on_batch(ids[:BATCH], y[:BATCH])
    np.testing.assert_array_equal(numpy_of(layer.embeddings), before)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")  # without it, it trains on
    model.train_on_batch(ids[:BATCH], y[:BATCH])
    assert float(numpy_of(layer.iterations)) == 1


SKIPPING_MODEL_OPTIMIZERS = {
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10
    ),
    "loss_scale_factor": lambda: keras.optimizers.SGD(0.1, loss_scale_factor=64.0),
    "skip_nonfinite": lambda: kto.Adafactor(0.1, skip_nonfinite_updates=True),
    # Ours unscale the gradients themselves: not those that overwrite their variables (the layer's).
    "ours_loss_scale_factor": lambda: kto.Adafactor(0.1, loss_scale_factor=64.0),
}


@pytest.mark.parametrize("model_optimizer", list(SKIPPING_MODEL_OPTIMIZERS))
@pytest.mark.parametrize("case", ["default", "last_occurrence", "not_lazy"])
def test_model_optimizer_that_scales_or_skips(case, model_optimizer):
    """A model's optimizer that scales the loss trains the table with the unscaled rows' gradient: the numpy
    reference's numbers. One that skips non-finite steps (a `LossScaleOptimizer`, `skip_nonfinite_updates`)
    skips the table's too: an overflowing step (targets near float32's maximum: the rows' gradient is
    infinite) leaves every variable of the layer bit for bit as it was, the next steps train as the reference
    without it, and a `LossScaleOptimizer` halves its scale."""
    options = OPTION_CASES[case]
    model, layer = table_model(options)
    model.compile(optimizer=SKIPPING_MODEL_OPTIMIZERS[model_optimizer](), loss="mse")
    reference = NumpyEmbeddingAdam(initial_table(), **reference_arguments(options))
    skips = model_optimizer in ("loss_scale", "skip_nonfinite")
    for step, ids in enumerate(STEP_IDS):
        ids = np.asarray(ids, np.int32)
        if step == 1 and skips:
            before = [numpy_of(v) for v in layer.weights]
            bad = 3e38 if model_optimizer == "loss_scale" else np.nan
            model.train_on_batch(ids, np.full((BATCH, K, DIM), bad, np.float32))
            for want, variable in zip(before, layer.weights):
                np.testing.assert_array_equal(numpy_of(variable), want, err_msg=variable.path)
        y = targets(step, (BATCH, K, DIM))
        gradient = 2 * (reference.weights[ids].astype(np.float64) - y) / (BATCH * K * DIM)
        model.train_on_batch(ids, y)
        reference.apply_sparse(ids.reshape(-1), gradient.reshape(-1, DIM))
    assert_matches(layer, reference)
    if model_optimizer == "loss_scale":
        assert float(numpy_of(model.optimizer.dynamic_scale)) == 2.0**9


def test_a_step_the_model_skips_for_another_gradient():
    """A `LossScaleOptimizer` skipping a step for another variable's gradient (a `Dense` kernel's overflows, the
    looked-up rows' does not; the kernel stays 0 while its input is): on TF and torch the table, trained in the backward pass, keeps its step count
    in step with it, and the next steps train on; on JAX the model's skip holds the table too."""
    ids = keras.Input((K,), dtype="int32")
    x = keras.Input((1,))
    layer = kto.layers.Embedding(ROWS, DIM, optimizer=kto.EmbeddingAdam(0.05))
    dense = keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False)
    pooled = keras.ops.mean(layer(ids), axis=(1, 2))[:, None]
    model = keras.Model([ids, x], pooled + dense(x))
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse"
    )
    batch = np.asarray(STEP_IDS[0], np.int32)
    y = targets(0, (BATCH, 1))
    model.train_on_batch([batch, np.zeros((BATCH, 1), "float32")], y)
    before = numpy_of(layer.embeddings)
    model.train_on_batch(
        [batch, np.full((BATCH, 1), 1e35, "float32")], y
    )  # the kernel's gradient overflows
    assert float(numpy_of(model.optimizer.dynamic_scale)) == 2.0**14
    in_place = BACKEND != "jax"
    assert np.array_equal(numpy_of(layer.embeddings), before) != in_place
    assert float(numpy_of(layer.iterations)) == (2 if in_place else 1)
    model.train_on_batch([batch, np.zeros((BATCH, 1), "float32")], y)
    assert float(numpy_of(layer.iterations)) == (3 if in_place else 2)
    assert np.isfinite(numpy_of(layer.embeddings)).all()


@pytest.mark.parametrize("case", ["default", "not_lazy"])
def test_floatx_bfloat16_trains_and_looks_up(case):
    """Under `floatx="bfloat16"` (the table bf16 by default; Keras promotes int32 ids and Python ints to it on
    JAX) the layer trains its looked-up rows only, and `predict` returns the table's rows at the ids."""
    keras.config.set_floatx("bfloat16")
    try:
        model, layer = table_model(OPTION_CASES[case])
        ids = np.asarray(STEP_IDS[0], np.int32)
        before = numpy_of(layer.embeddings)
        model.train_on_batch(ids, targets(0, (BATCH, K, DIM)))
        predicted = keras.ops.convert_to_numpy(model.predict_on_batch(ids)).astype(np.float64)
    finally:
        keras.config.set_floatx("float32")
    if layer.catch_up_sums is not None:
        layer.catch_up()
    table = numpy_of(layer.embeddings)
    assert layer.embeddings.dtype == "bfloat16" and float(numpy_of(layer.iterations)) == 1
    touched = np.unique(ids)
    assert not np.array_equal(table[touched], before[touched])
    if case == "default":  # lazy: the rows not looked up keep their values
        untouched = np.setdiff1d(np.arange(ROWS), touched)
        np.testing.assert_array_equal(table[untouched], before[untouched])
    np.testing.assert_array_equal(predicted, table[ids])


def test_mixed_float16_trains_the_table_and_skips_an_overflowing_step():
    """Under the `mixed_float16` policy Keras wraps the model's optimizer in a `LossScaleOptimizer`: the table
    (float32) trains as in float32 up to float16's rounding of the looked-up rows, and a step whose float16
    gradient overflows leaves the layer as it was, the next steps training as a run without it."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        mixed, mixed_layer = pooled_layer_model()
        clean, clean_layer = pooled_layer_model()
    finally:
        keras.config.set_dtype_policy("float32")
    full, full_layer = pooled_layer_model()
    assert isinstance(mixed.optimizer, keras.optimizers.LossScaleOptimizer)
    assert mixed_layer.embeddings.dtype == "float32" and mixed_layer.compute_dtype == "float16"
    ids, y = fit_data()
    for start in range(0, len(ids), BATCH):
        batch = ids[start : start + BATCH], y[start : start + BATCH]
        if start == BATCH:
            before = [numpy_of(v) for v in mixed_layer.weights]
            mixed.train_on_batch(batch[0], np.full_like(batch[1], 6e4))
            for want, variable in zip(before, mixed_layer.weights):
                np.testing.assert_array_equal(numpy_of(variable), want, err_msg=variable.path)
        for model in (mixed, clean, full):
            model.train_on_batch(*batch)
    for a, b in zip(mixed_layer.weights, clean_layer.weights):
        np.testing.assert_array_equal(numpy_of(a), numpy_of(b), err_msg=a.path)
    assert float(numpy_of(mixed_layer.iterations)) == len(STEP_IDS)
    np.testing.assert_allclose(
        numpy_of(mixed_layer.embeddings), numpy_of(full_layer.embeddings), rtol=0, atol=5e-3
    )


MODES = {
    "tensorflow": ["default", "run_eagerly", "jit_compile"],
    "jax": ["default", "run_eagerly"],
    "torch": ["default"],
}[BACKEND]


@pytest.mark.parametrize("bad", [ROWS, -1, 2**30])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["default", "last_occurrence", "not_lazy"])
def test_out_of_range_ids_read_zero_rows_and_train_nothing(case, mode, bad):
    """Ids outside [0, ROWS) among valid ones, in every trainer mode of the backend: they read zero rows,
    the table trains as the numpy reference fed only the valid ids' gradients (no other row changes), and
    they are counted in `out_of_range_ids`, said once in a warning where the step runs eagerly."""
    options = OPTION_CASES[case]
    model, layer = table_model(options)
    if mode != "default":
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **{mode: True})
    reference = NumpyEmbeddingAdam(initial_table(), **reference_arguments(options))
    counted = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, ids in enumerate(STEP_IDS):
            ids = np.asarray(ids, np.int32)
            ids[step + 1, step] = ids[4, 2] = bad
            valid = ids != bad
            y = targets(step, (BATCH, K, DIM))
            rows = np.where(valid[..., None], reference.weights[np.clip(ids, 0, ROWS - 1)], 0)
            gradient = 2 * (rows.astype(np.float64) - y) / (BATCH * K * DIM)
            before = layer_state(layer)
            model.train_on_batch(ids, y)
            reference.apply_sparse(ids[valid], gradient[valid])
            counted += 2
            assert int(numpy_of(layer.out_of_range_ids)) == counted
            assert_matches(layer, reference, before, ids[valid])
    found = numpy_of(model.predict_on_batch(ids))
    np.testing.assert_array_equal(found[~valid], 0)
    np.testing.assert_allclose(
        found[valid], layer_state(layer)["embeddings"][ids[valid]], rtol=1e-6
    )
    warned = [w for w in caught if "out_of_range_ids" in str(w.message)]
    eager = mode == "run_eagerly" or BACKEND == "torch"
    assert len(warned) == (1 if eager else 0), [str(w.message) for w in warned]
    if warned:
        assert f"'{layer.name}'" in str(warned[0].message)


@pytest.mark.parametrize(
    "options",
    [{}, {"second_moment": "rowwise"}, {"use_gradient_accumulation": False}],
    ids=["lazy", "rowwise", "last_occurrence"],
)
def test_bf16_table_and_slots_store_the_float32_step_rounded_as_the_reference(options):
    """A bfloat16 table with bfloat16 `momenta` and `velocities` and `stochastic_rounding=True`: after each
    step each holds the float32 result of a float32 twin (`mixed_bfloat16`: the same bf16 rows and
    gradients, started from the same state) rounded by the numpy reference of the hash (streams 0, 1, 2 of
    table index 0, the layer's step); rows not looked up keep their bits."""
    from test_stochastic_rounding import reference_round

    seed = 21
    half_width = dict(momentum_dtype="bfloat16", velocity_dtype="bfloat16")

    def model(dtype, **extra):
        optimizer = kto.EmbeddingAdam(learning_rate=0.01, **options, **extra)
        layer = kto.layers.Embedding(
            ROWS,
            DIM,
            optimizer=optimizer,
            dtype=dtype,
            embeddings_initializer=keras.initializers.Constant(initial_table()),
        )
        ids = keras.Input((K,), dtype="int32")
        built = keras.Model(ids, keras.ops.cast(layer(ids), "float32"))
        built.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return built, layer

    half, half_layer = model("bfloat16", stochastic_rounding=True, seed=seed, **half_width)
    twin, twin_layer = model("mixed_bfloat16")
    names = ("embeddings", "momenta", "velocities")
    for step, ids in enumerate(STEP_IDS):
        for name, value in half_layer.table_state().items():  # the twin starts where the layer is
            twin_layer.table_state()[name].assign(numpy_of(value).astype(np.float32))
        y = targets(step, (BATCH, K, DIM))
        half.train_on_batch(np.asarray(ids, np.int32), y)
        twin.train_on_batch(np.asarray(ids, np.int32), y)
        for stream, name in enumerate(names):
            want = reference_round(
                numpy_of(twin_layer.table_state()[name]).astype(np.float32),
                "bfloat16",
                seed,
                step,
                stream,
            )
            np.testing.assert_array_equal(
                numpy_of(half_layer.table_state()[name]), want.astype(np.float64), err_msg=name
            )
        assert half_layer.table_state()[name].dtype == "bfloat16"


def test_lazy_adam_false_with_half_width_slots_raises_naming_them():
    layer = kto.layers.Embedding(
        ROWS, DIM, optimizer=kto.EmbeddingAdam(lazy_adam=False, momentum_dtype="bfloat16")
    )
    with pytest.raises(ValueError, match="lazy_adam=False.*momentum_dtype='bfloat16'"):
        layer(np.zeros((2,), "int32"), training=True)


def test_mixed_bfloat16_keeps_the_table_and_its_state_in_float32():
    """Under `mixed_bfloat16` the rows come out in bfloat16, but the table, its slots and `iterations` are
    read and written in float32: Adam's first step moves each looked-up entry by the learning rate
    (`lr_t * m / sqrt(v) = lr * sign(g)`), far below bfloat16's spacing at 1, and the other rows keep
    their bits."""
    table = 1.0 + np.random.RandomState(3).uniform(0, 1e-3, (ROWS, DIM)).astype("float32")
    layer = kto.layers.Embedding(
        ROWS,
        DIM,
        optimizer=kto.EmbeddingAdam(1e-5),
        dtype="mixed_bfloat16",
        embeddings_initializer=keras.initializers.Constant(table),
    )
    ids = keras.Input((K,), dtype="int32")
    model = keras.Model(ids, keras.ops.cast(layer(ids), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    batch = np.asarray(STEP_IDS[0], np.int32)
    rows = model.predict_on_batch(batch)
    assert keras.backend.standardize_dtype(layer(batch).dtype) == "bfloat16"
    model.train_on_batch(batch, np.zeros((BATCH, K, DIM), "float32"))
    state = layer.table_state()
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in state.values())
    moved = numpy_of(state["embeddings"]) - table
    looked_up = np.unique(batch)
    np.testing.assert_allclose(-moved[looked_up], 1e-5, rtol=2e-2)  # every row's gradient is > 0
    others = np.setdiff1d(np.arange(ROWS), looked_up)
    np.testing.assert_array_equal(moved[others], 0.0)
    assert float(numpy_of(state["iterations"])) == 1.0
    del rows
