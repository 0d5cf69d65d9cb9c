"""`keras_tpu_optim.tpu.to_tpu_embedding`: the export of EmbeddingAdam to the TPU embedding engines.

Numbers are checked against tests/reference/numpy_tpu_rows.py (numpy from
docs/algorithms.md#embeddingadam and #export-to-tpu-embedding-engines). TensorFlow is imported only by the TensorFlow tests, so the torch
run never loads it.
"""

import sys

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from keras_tpu_optim.tpu import to_tpu_embedding
from tests.reference import numpy_tpu_rows as ref

BACKEND = keras.backend.backend()


def require_backend(name):
    if BACKEND != name:
        pytest.skip(f"needs KERAS_BACKEND={name}; this run is on {BACKEND}")


def require_tpu_backend():
    if BACKEND not in ("tensorflow", "jax"):
        pytest.skip(f"no TPU embedding engine on KERAS_BACKEND={BACKEND}")


def exponential_decay():
    return keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)


# The Keras learning rate and the numpy rate at 0-based step k, per kind of learning rate.
LEARNING_RATES = {
    "float": (lambda: 0.01, lambda k: 0.01),
    "schedule": (exponential_decay, lambda k: 0.01 * 0.5 ** (k / 2)),
    "piecewise": (
        lambda: keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.02, 0.005]),
        lambda k: 0.02 if k <= 2 else 0.005,
    ),
}

# Every option combination of docs/algorithms.md#embeddingadam that changes the row update.
ROW_OPTIONS = {
    "defaults": {},
    "sum_outside_sqrt": dict(sum_inside_sqrt=False, epsilon=1e-3),
    "clipvalue": dict(clipvalue=0.3),
    "clipvalue_tuple": dict(clipvalue=(None, 0.2)),
    "weight_clip": dict(clip_weight_min=-0.6, clip_weight_max=0.55),
    "decay": dict(weight_decay_factor=0.1),
    "decay_times_lr": dict(
        weight_decay_factor=3.0, multiply_weight_decay_factor_by_learning_rate=True
    ),
    "keras_weight_decay": dict(weight_decay=3.0),
    "everything": dict(
        sum_inside_sqrt=False,
        clipvalue=(-0.25, 0.5),
        clip_weight_min=-0.6,
        clip_weight_max=0.6,
        weight_decay_factor=0.05,
        beta_1=0.8,
        beta_2=0.99,
    ),
}


def engine_options(kwargs):
    """The engine configuration docs/algorithms.md#embeddingadam implies for EmbeddingAdam(**kwargs), written out by hand."""
    clip = kwargs.get("clipvalue")
    if clip is not None and not isinstance(clip, tuple):
        clip = (-clip, clip)
    decay = kwargs.get("weight_decay_factor", kwargs.get("weight_decay"))
    multiply = "weight_decay" in kwargs or bool(
        kwargs.get("multiply_weight_decay_factor_by_learning_rate")
    )
    return ref.EngineOptions(
        beta_1=kwargs.get("beta_1", 0.9),
        beta_2=kwargs.get("beta_2", 0.999),
        epsilon=kwargs.get("epsilon", 1e-7),
        sum_inside_sqrt=kwargs.get("sum_inside_sqrt", True),
        gradient_clip=clip or (None, None),
        weight_clip=(kwargs.get("clip_weight_min"), kwargs.get("clip_weight_max")),
        weight_decay_factor=decay,
        multiply_weight_decay_factor_by_learning_rate=multiply,
    )


def random_rows(seed, rows=3, dim=8):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, dim)).astype("float32") * 0.5


# ---------------------------------------------------------------------------------------------
# Every backend


@pytest.mark.parametrize(
    "make_optimizer",
    [
        kto.Adafactor,
        lambda: keras.optimizers.Adam(),
        lambda: keras.optimizers.LossScaleOptimizer(kto.EmbeddingAdam()),
    ],
    ids=["Adafactor", "keras_Adam", "LossScaleOptimizer"],
)
def test_only_embedding_adam_exports(make_optimizer):
    with pytest.raises(TypeError, match="EmbeddingAdam"):
        to_tpu_embedding(make_optimizer())


def test_torch_has_no_tpu_embedding_engine():
    require_backend("torch")
    # Other tests may import TensorFlow (Keras's serialization does); the export must not.
    tensorflow_was_imported = "tensorflow" in sys.modules
    with pytest.raises(ValueError, match="torch"):
        to_tpu_embedding(kto.EmbeddingAdam())
    assert ("tensorflow" in sys.modules) == tensorflow_was_imported


@pytest.mark.parametrize(
    "option, value",
    [
        ("clipnorm", 1.0),
        ("global_clipnorm", 1.0),
        ("use_ema", True),
        ("loss_scale_factor", 128.0),
        ("gradient_accumulation_steps", 2),
        ("second_moment", "rowwise"),
        ("bias_correction", "per_row"),
    ],
)
def test_keras_options_no_engine_honours_raise(option, value):
    require_tpu_backend()
    with pytest.raises(ValueError, match=option):
        to_tpu_embedding(kto.EmbeddingAdam(**{option: value}))


@pytest.mark.parametrize(
    "options",
    [{"momentum_dtype": "bfloat16"}, {"velocity_dtype": "bfloat16", "stochastic_rounding": True}],
)
def test_half_width_state_exports_saying_what_it_casts(options):
    """The engines keep float32 tables and slots: the export warns, naming each half-width option."""
    require_tpu_backend()
    with pytest.warns(UserWarning, match="cast to float32") as caught:
        exported = to_tpu_embedding(kto.EmbeddingAdam(**options))
    assert exported is not None
    for name, value in options.items():
        assert f"{name}={value!r}" in str(caught[0].message)


def test_weight_decay_exclusions_raise():
    require_tpu_backend()
    optimizer = kto.EmbeddingAdam(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(ValueError, match="exclude_from_weight_decay"):
        to_tpu_embedding(optimizer)


# ---------------------------------------------------------------------------------------------
# TensorFlow: tf.tpu.experimental.embedding.Adam


def optimization_parameters(tpu_optimizer):
    from tensorflow.core.protobuf.tpu import optimization_parameters_pb2

    parameters = optimization_parameters_pb2.OptimizationParameters()
    tpu_optimizer._set_optimization_parameters(parameters)
    return parameters


def test_tf_every_option_lands_in_the_proto():
    require_backend("tensorflow")
    import tensorflow as tf
    from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb

    def slot_fn(table, names, initializers):  # passed through untouched
        raise AssertionError("not called here")

    optimizer = kto.EmbeddingAdam(
        beta_1=0.8,
        beta_2=0.99,
        epsilon=1e-5,
        lazy_adam=False,
        sum_inside_sqrt=False,
        clip_weight_min=-2.0,
        clip_weight_max=3.0,
        weight_decay_factor=0.25,
        multiply_weight_decay_factor_by_learning_rate=True,
        slot_variable_creation_fn=slot_fn,
        clipvalue=(-0.5, 0.75),
        low_dimensional_packing_status=True,
    )
    tpu_optimizer = to_tpu_embedding(optimizer)
    assert isinstance(tpu_optimizer, tf.tpu.experimental.embedding.Adam)
    assert tpu_optimizer.slot_variable_creation_fn is slot_fn
    assert callable(tpu_optimizer.learning_rate)

    parameters = optimization_parameters(tpu_optimizer)
    np.testing.assert_allclose(
        [parameters.adam.beta1, parameters.adam.beta2, parameters.adam.epsilon],
        [0.8, 0.99, 1e-5],
        rtol=1e-7,
    )
    assert parameters.adam.use_non_lazy_adam is True
    assert parameters.adam.use_sum_inside_sqrt is False
    assert parameters.gradient_accumulation_status == pb.GradientAccumulationStatus.ENABLED
    assert (parameters.clipping_limits.lower.value, parameters.clipping_limits.upper.value) == (
        -2.0,
        3.0,
    )
    assert (
        parameters.gradient_clipping_limits.lower.value,
        parameters.gradient_clipping_limits.upper.value,
    ) == (
        -0.5,
        0.75,
    )
    assert parameters.weight_decay_factor == 0.25
    assert parameters.multiply_weight_decay_factor_by_learning_rate is True
    assert parameters.low_dimensional_packing_status == pb.LowDimensionalPackingStatus.ENABLED


def test_tf_default_options_in_the_proto():
    require_backend("tensorflow")
    from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb

    tpu_optimizer = to_tpu_embedding(kto.EmbeddingAdam(use_gradient_accumulation=False))
    # TPUEmbeddingV2 refuses a table whose decay options are anything but None.
    assert tpu_optimizer.weight_decay_factor is None
    assert tpu_optimizer.multiply_weight_decay_factor_by_learning_rate is None
    parameters = optimization_parameters(tpu_optimizer)
    np.testing.assert_allclose(
        [parameters.adam.beta1, parameters.adam.beta2, parameters.adam.epsilon],
        [0.9, 0.999, 1e-7],
        rtol=1e-7,
    )
    assert parameters.adam.use_non_lazy_adam is False
    assert parameters.adam.use_sum_inside_sqrt is True
    assert parameters.gradient_accumulation_status == pb.GradientAccumulationStatus.DISABLED
    for field in ("clipping_limits", "gradient_clipping_limits"):
        assert not parameters.HasField(field)
    assert parameters.weight_decay_factor == 0.0
    assert parameters.multiply_weight_decay_factor_by_learning_rate is False
    assert parameters.low_dimensional_packing_status == pb.LowDimensionalPackingStatus.DISABLED


def test_tf_keras_weight_decay_is_decay_times_learning_rate():
    require_backend("tensorflow")
    parameters = optimization_parameters(
        to_tpu_embedding(kto.EmbeddingAdam(weight_decay=0.05, clipvalue=0.1))
    )
    assert parameters.weight_decay_factor == pytest.approx(0.05)
    assert parameters.multiply_weight_decay_factor_by_learning_rate is True
    assert (
        parameters.gradient_clipping_limits.lower.value,
        parameters.gradient_clipping_limits.upper.value,
    ) == (
        pytest.approx(-0.1),
        pytest.approx(0.1),
    )


@pytest.mark.parametrize("kind", sorted(LEARNING_RATES))
def test_tf_learning_rate_is_bias_corrected_and_follows_the_step(kind):
    require_backend("tensorflow")
    import tensorflow as tf

    make_learning_rate, numpy_rate = LEARNING_RATES[kind]
    optimizer = kto.EmbeddingAdam(make_learning_rate(), beta_1=0.8, beta_2=0.99)
    learning_rate = to_tpu_embedding(optimizer).learning_rate
    in_graph = tf.function(learning_rate)  # the engine calls it inside the training step
    for iterations in range(5):
        optimizer.iterations.assign(iterations)
        expected = ref.bias_corrected_learning_rate(
            numpy_rate(iterations), iterations + 1, 0.8, 0.99
        )
        np.testing.assert_allclose(float(learning_rate()), expected, rtol=1e-6)
        np.testing.assert_allclose(float(in_graph()), expected, rtol=1e-6)


def test_tf_engine_fed_the_export_matches_embedding_adam():
    """Simulate the TPU from the proto and the dynamic rate; it must reproduce EmbeddingAdam's steps."""
    require_backend("tensorflow")
    import tensorflow as tf

    kwargs = dict(ROW_OPTIONS["everything"], learning_rate=exponential_decay())
    optimizer = kto.EmbeddingAdam(**kwargs)
    tpu_optimizer = to_tpu_embedding(optimizer)
    options = ref.EngineOptions.from_proto(optimization_parameters(tpu_optimizer))
    table = keras.Variable(random_rows(0, rows=6), name="table")
    optimizer.build([table])
    weight, momenta, velocities = (
        np.array(table.numpy(), np.float64),
        np.zeros((6, 8)),
        np.zeros((6, 8)),
    )
    rows = np.array([1, 4])
    for step in range(3):
        fed_rate = float(tpu_optimizer.learning_rate())  # read before the step, as the engine does
        gradient = random_rows(10 + step, rows=2)
        updated = ref.engine_row_update(
            gradient, weight[rows], momenta[rows], velocities[rows], fed_rate, options
        )
        weight[rows], momenta[rows], velocities[rows] = updated
        optimizer.apply(
            [tf.IndexedSlices(tf.constant(gradient), tf.constant(rows), tf.constant([6, 8]))],
            [table],
        )
    np.testing.assert_allclose(table.numpy(), weight, rtol=1e-5, atol=1e-6)


def test_tf_table_descriptor_and_keras_rs_table_config():
    require_backend("tensorflow")
    import keras_rs
    from keras_rs.src.layers.embedding.tensorflow import config_conversion
    from tensorflow.core.protobuf.tpu import tpu_embedding_configuration_pb2

    tpu_optimizer = to_tpu_embedding(kto.EmbeddingAdam(0.02, clip_weight_max=1.0))
    table_config = keras_rs.layers.TableConfig(
        name="items", vocabulary_size=100, embedding_dim=8, optimizer=tpu_optimizer
    )
    tf_table_config = config_conversion.keras_to_tf_tpu_table_config(table_config)
    assert tf_table_config.optimizer is tpu_optimizer

    # What TPUEmbedding does with it when it builds its configuration.
    configuration = tpu_embedding_configuration_pb2.TPUEmbeddingConfiguration()
    tf_table_config._set_table_descriptor(
        configuration.table_descriptor.add(), 1, {tpu_optimizer.learning_rate: 3}
    )
    parameters = configuration.table_descriptor[0].optimization_parameters
    assert parameters.learning_rate.dynamic.tag == 3
    assert parameters.clipping_limits.upper.value == 1.0
    assert parameters.HasField("adam")


# ---------------------------------------------------------------------------------------------
# JAX: jax_tpu_embedding CustomOptimizerSpec


def trace_like_jax_tpu_embedding(spec, dim):
    """`jax_tpu_embedding.sparsecore.lib.nn.embedding.tpu_sparse_dense_matmul_grad`'s tracing, verbatim."""
    import jax
    import jax.numpy as jnp

    num_slots = len(spec.slot_variables_initializers())
    num_hyperparams = len(spec.get_hyperparameters(0))
    aval = jax.ShapeDtypeStruct((1, dim), jnp.float32)
    # grad, table, slot_0, ..., slot_n, hyperparam_0, ..., hyperparam_n
    in_avals = [aval] * (1 + 1 + num_slots + num_hyperparams)
    return jax.make_jaxpr(spec.custom_computation_fn)(*in_avals)


def run_traced(closed_jaxpr, grad, weight, momenta, velocities, learning_rate):
    """Run the traced computation on one row at a time, hyperparameters broadcast to rows."""
    from jax.extend.core import jaxpr_as_fun

    function = jaxpr_as_fun(closed_jaxpr)
    outputs = []
    for r in range(grad.shape[0]):
        row = [np.asarray(a[r : r + 1], np.float32) for a in (grad, weight, momenta, velocities)]
        rate = np.full_like(row[0], learning_rate)
        outputs.append([np.asarray(o) for o in function(*row, rate)])
    return [np.concatenate(parts) for parts in zip(*outputs)]


def test_jax_spec_shape_and_slots():
    require_backend("jax")
    import jax
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec

    spec = to_tpu_embedding(kto.EmbeddingAdam())
    assert isinstance(spec, embedding_spec.CustomOptimizerSpec)
    assert spec.slot_variables_count() == 2
    for initializer in spec.slot_variables_initializers():
        slot = initializer(jax.random.key(0), (16, 8))
        assert slot.dtype == np.float32 and not np.any(np.asarray(slot))
    closed_jaxpr = trace_like_jax_tpu_embedding(spec, dim=8)
    assert len(closed_jaxpr.in_avals) == 5
    assert [(tuple(a.shape), a.dtype) for a in closed_jaxpr.out_avals] == [((1, 8), np.float32)] * 3
    # Same options, same spec: jax_tpu_embedding stacks only tables with equal optimizers.
    optimizer = kto.EmbeddingAdam(clipvalue=0.5)
    assert to_tpu_embedding(optimizer) == to_tpu_embedding(optimizer)


@pytest.mark.parametrize("name", sorted(ROW_OPTIONS))
def test_jax_row_computation_matches_numpy(name):
    require_backend("jax")
    kwargs = ROW_OPTIONS[name]
    spec = to_tpu_embedding(kto.EmbeddingAdam(exponential_decay(), **kwargs))
    closed_jaxpr = trace_like_jax_tpu_embedding(spec, dim=8)
    options = engine_options(kwargs)
    weight, momenta, velocities = (
        random_rows(0),
        np.zeros((3, 8), np.float32),
        np.zeros((3, 8), np.float32),
    )
    expected = (weight.astype(np.float64), momenta, velocities)
    for step in range(3):
        grad = random_rows(step + 1)
        (learning_rate,) = spec.get_hyperparameters(step)
        np.testing.assert_allclose(
            float(learning_rate),
            ref.bias_corrected_learning_rate(
                0.01 * 0.5 ** (step / 2), step + 1, options.beta_1, options.beta_2
            ),
            rtol=2e-5,  # float32 1 - 0.999^t loses about 1e-5 relative
        )
        expected = ref.engine_row_update(grad, *expected, float(learning_rate), options)
        weight, momenta, velocities = run_traced(
            closed_jaxpr, grad, weight, momenta, velocities, learning_rate
        )
        for actual, wanted in zip((weight, momenta, velocities), expected):
            np.testing.assert_allclose(actual, wanted, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["defaults", "everything", "keras_weight_decay"])
def test_jax_row_computation_equals_embedding_adam_on_a_table(name):
    require_backend("jax")
    kwargs = ROW_OPTIONS[name]
    optimizer = kto.EmbeddingAdam(exponential_decay(), **kwargs)
    spec = to_tpu_embedding(optimizer)
    row_computation = spec.custom_computation_fn
    initial = random_rows(0, rows=10)
    table = keras.Variable(initial, name="table")
    optimizer.build([table])
    momenta_slot, velocities_slot = optimizer._state_of(table).slots
    touched = np.array([2, 5, 9])
    engine = [initial[touched], np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32)]
    for step in range(3):
        gradient = np.zeros((10, 8), np.float32)
        gradient[touched] = random_rows(step + 1)
        (learning_rate,) = spec.get_hyperparameters(step)
        engine = [np.asarray(x) for x in row_computation(gradient[touched], *engine, learning_rate)]
        optimizer.apply([gradient], [table])
    untouched = np.setdiff1d(np.arange(10), touched)
    np.testing.assert_array_equal(np.asarray(table.value)[untouched], initial[untouched])
    for variable, rows in zip((table, momenta_slot, velocities_slot), engine):
        np.testing.assert_allclose(np.asarray(variable.value)[touched], rows, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(LEARNING_RATES))
def test_jax_learning_rate_follows_the_keras_schedule(kind):
    require_backend("jax")
    import jax
    import jax.numpy as jnp

    make_learning_rate, numpy_rate = LEARNING_RATES[kind]
    optimizer = kto.EmbeddingAdam(make_learning_rate(), beta_1=0.8, beta_2=0.99)
    spec = to_tpu_embedding(optimizer)
    jitted = jax.jit(spec.get_learning_rate)
    for step in range(5):
        expected = ref.bias_corrected_learning_rate(numpy_rate(step), step + 1, 0.8, 0.99)
        np.testing.assert_allclose(float(spec.get_learning_rate(step)), expected, rtol=1e-6)
        # keras-rs passes its step counter as a float32 array, under jit.
        np.testing.assert_allclose(float(jitted(jnp.float32(step))), expected, rtol=1e-6)
        # ...and it is the rate EmbeddingAdam itself uses at that step.
        optimizer.iterations.assign(step)
        np.testing.assert_allclose(
            float(spec.get_learning_rate(step)),
            float(optimizer._row_learning_rate(optimizer.iterations)),
            rtol=1e-6,
        )


@pytest.mark.parametrize(
    "option, value",
    [
        ("lazy_adam", False),
        ("use_gradient_accumulation", False),
        ("slot_variable_creation_fn", lambda table, names, initializers: {}),
        ("low_dimensional_packing_status", True),
    ],
)
def test_jax_options_sparsecore_cannot_honour_raise(option, value):
    require_backend("jax")
    with pytest.raises(ValueError, match=option):
        to_tpu_embedding(kto.EmbeddingAdam(**{option: value}))


def test_jax_spec_goes_through_jax_tpu_embeddings_gradient_step():
    """Trace `tpu_sparse_dense_matmul_grad` itself (its TPU lowering aside): it accepts the spec."""
    require_backend("jax")
    import jax
    import jax.numpy as jnp
    from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

    spec = to_tpu_embedding(
        kto.EmbeddingAdam(exponential_decay(), clipvalue=0.5, weight_decay=0.01)
    )
    table = embedding_spec.TableSpec(
        vocabulary_size=64,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=spec,
        combiner="sum",
        name="items",
        suggested_coo_buffer_size_per_device=128,
    )
    feature = embedding_spec.FeatureSpec(
        name="f", table_spec=table, input_shape=[16, 1], output_shape=[16, 8]
    )
    features = {"f": feature}
    embedding.prepare_feature_specs_for_training(
        features, global_device_count=1, num_sc_per_device=4
    )
    inputs = embedding.eval_preprocess_sparse_dense_matmul_input_shape(
        features, local_device_count=1, global_device_count=1, num_sc_per_device=4
    )
    stacked = embedding.get_stacked_table_specs(features)["items"]
    rows = jax.ShapeDtypeStruct(
        (stacked.stack_vocab_size, stacked.stack_embedding_dim), jnp.float32
    )
    variables = {"items": embedding.EmbeddingVariables(table=rows, slot=(rows, rows))}

    def gradient_step(activation_gradients, preprocessed_inputs, variables, step):
        return embedding.tpu_sparse_dense_matmul_grad(
            activation_gradients,
            preprocessed_inputs,
            variables,
            features,
            global_device_count=1,
            num_sc_per_device=4,
            step=step,
        )

    gradients = {"f": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    arguments = (gradients, inputs, variables, jax.ShapeDtypeStruct((), jnp.float32))
    updated = jax.eval_shape(gradient_step, *arguments)["items"]
    assert [tuple(v.shape) for v in jax.tree.leaves(updated)] == [tuple(rows.shape)] * 3
    equations = jax.make_jaxpr(gradient_step)(*arguments).jaxpr.eqns
    optimizer_steps = [e for e in equations if "optimizer_grad" in e.primitive.name]
    assert len(optimizer_steps) == 1 and optimizer_steps[0].params["num_hyperparameters"] == 1


# ---------------------------------------------------------------------------------------------
# A DistributedEmbedding's tables


def layer_of_three_tables():
    """Tables "a" and "c" trained by the layer's optimizer, "b" by its own (another rate and options)."""
    from keras_tpu_optim.layers import DistributedEmbedding, FeatureConfig, TableConfig

    own = kto.EmbeddingAdam(exponential_decay(), beta_1=0.8, beta_2=0.99, clip_weight_max=0.5)
    tables = [
        TableConfig("a", 10, 4),
        TableConfig("b", 20, 4, optimizer=own),
        TableConfig("c", 30, 8),
    ]
    features = {t.name: FeatureConfig(t.name, t) for t in tables}
    features["a2"] = FeatureConfig("a2", tables[0])  # a shared table: one export
    layer = DistributedEmbedding(features, optimizer=kto.EmbeddingAdam(0.02, epsilon=1e-6))
    return layer, {"a": (0.02, 0.9, 0.999), "b": (None, 0.8, 0.99), "c": (0.02, 0.9, 0.999)}


def test_a_layers_tables_export_with_their_optimizers_rates():
    """Each table's export carries its optimizer's numbers, its rate read at the step counter given (TF) or
    passed by the engine (JAX); tables of one optimizer share one export."""
    require_tpu_backend()
    layer, expected = layer_of_three_tables()
    counter = keras.Variable(0, dtype="int64", trainable=False, name="steps")
    exported = to_tpu_embedding(
        layer, **({"iterations": counter} if BACKEND == "tensorflow" else {})
    )
    assert list(exported) == ["a", "b", "c"]
    assert exported["a"] is exported["c"] and exported["a"] is not exported["b"]
    for step in range(4):
        counter.assign(step)
        for name, (rate, beta_1, beta_2) in expected.items():
            base = 0.01 * 0.5 ** (step / 2) if rate is None else rate
            want = ref.bias_corrected_learning_rate(base, step + 1, beta_1, beta_2)
            if BACKEND == "tensorflow":
                got = float(exported[name].learning_rate())
            else:
                got = float(exported[name].get_learning_rate(step))
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{name}, step {step}")
    if BACKEND == "tensorflow":
        assert optimization_parameters(exported["b"]).clipping_limits.upper.value == 0.5
        assert exported["a"].epsilon == 1e-6
    else:
        assert exported["b"].custom_computation_fn.options.clip_weight_max == 0.5
        assert exported["a"].custom_computation_fn.options.epsilon == 1e-6


def test_a_layers_export_names_the_step_counter_where_needed():
    layer, _ = layer_of_three_tables()
    if BACKEND == "torch":
        with pytest.raises(ValueError, match="no TPU embedding engine"):
            to_tpu_embedding(layer)
    elif BACKEND == "tensorflow":
        with pytest.raises(ValueError, match="needs `iterations`"):
            to_tpu_embedding(layer)
    else:
        with pytest.raises(ValueError, match="takes no `iterations`"):
            to_tpu_embedding(layer, iterations=keras.Variable(0))
