"""Gradients whose static shape is partly or wholly unknown, on every TensorFlow path.

Inside Keras's traced train step a gradient's static shape can lose
dimensions (TF's gradient of a reshaped matmul is `(None, 64)` for a
`(32, 64)` kernel). Every kernel takes its shapes from the variable. Here the
gradients come in through `tf.function` input signatures with unknown
dimensions (or an unknown rank), on each path: `tf.function` (Adafactor's
CPU step in blocks for float32, its XLA-compiled step for bfloat16;
EmbeddingAdam's compiled row update of `tf.IndexedSlices`, its dense rows),
`jit_compile=True`, `MirroredStrategy` over two logical CPU devices (the
conftest splits the CPU), gradient accumulation and stochastic rounding;
checked against the numpy references. A gradient whose shape, known only
when the step runs, differs from the variable's raises an error naming the
variable.
"""

from __future__ import annotations


import keras
import ml_dtypes
import numpy as np
import pytest

BACKEND = keras.backend.backend()
if BACKEND != "tensorflow":
    _REASON = f"static shapes that are unknown until a TF graph runs are TensorFlow's; this run is {BACKEND}"
    print(f"{__name__}: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

import tensorflow as tf  # noqa: E402

import keras_tpu_optim as kto  # noqa: E402
from _mirrored import mirrored_strategy  # noqa: E402
from reference.numpy_adafactor import NumpyAdafactor  # noqa: E402
from reference.numpy_embedding_adam import KerasAccumulation, NumpyEmbeddingAdam  # noqa: E402

STEPS = 3
# How much of a gradient's static shape the input signature leaves unknown.
UNKNOWN = {
    "leading": lambda shape: tf.TensorShape([None, *shape[1:]]),
    "every_dim": lambda shape: tf.TensorShape([None] * len(shape)),
    "rank": lambda shape: tf.TensorShape(None),
}
MODES = ["function", "xla", "mirrored"]


def combinations(cases):
    """Every case on every path with every dimension unknown; the other kinds of unknown with the first case."""
    first = cases[0]
    return [(case, mode, "every_dim") for case in cases for mode in MODES] + [
        (first, mode, unknown) for mode in MODES for unknown in UNKNOWN if unknown != "every_dim"
    ]


def _strategy(mode, options):
    if mode != "mirrored":
        return tf.distribute.get_strategy()
    if options.get("gradient_accumulation_steps"):
        pytest.skip(
            "Keras applies accumulated gradients in an ops.cond, where a tf.distribute strategy cannot "
            "all-reduce them (any optimizer; the README says so)"
        )
    return mirrored_strategy()


def _replicas(mode):
    """How many times the step's gradient is summed: Keras all-reduces the replicas' gradients with SUM."""
    return 2 if mode == "mirrored" else 1


def _compiled_apply(optimizer, variables, signature, mode, strategy, make_gradients=list):
    """`optimizer.apply(make_gradients(inputs), variables)` in a `tf.function` of the input `signature`.

    The gradients are made inside the step (under a strategy, in each replica), as a train step makes them.
    """

    def apply(*inputs):
        optimizer.apply(make_gradients(inputs), variables)

    if mode == "mirrored":
        replicated = apply

        def apply(*grads):  # noqa: F811  (every replica applies the same gradients)
            strategy.run(replicated, args=grads)

    return tf.function(apply, input_signature=signature, jit_compile=mode == "xla")


# ------------------------------------------------------------------ Adafactor

ADAFACTOR_SHAPES = [(8, 6), (5,), (2, 4, 3)]
ADAFACTOR_CASES = {
    "defaults": ({}, "float32"),
    "beta_1_accumulation": ({"beta_1": 0.9, "gradient_accumulation_steps": 2}, "float32"),
    "bfloat16_stochastic_rounding": ({"stochastic_rounding": True, "seed": 3}, "bfloat16"),
}


@pytest.mark.parametrize("case, mode, unknown", combinations(list(ADAFACTOR_CASES)))
def test_adafactor_with_unknown_gradient_shapes_matches_numpy(case, mode, unknown):
    options, dtype = ADAFACTOR_CASES[case]
    accumulation = options.get("gradient_accumulation_steps", 1)
    strategy = _strategy(mode, options)
    rng = np.random.default_rng(0)
    initial = [rng.normal(size=shape).astype(np.float32) for shape in ADAFACTOR_SHAPES]
    with strategy.scope():
        variables = [keras.Variable(x, dtype=dtype, name=f"v{i}") for i, x in enumerate(initial)]
        optimizer = kto.Adafactor(learning_rate=0.1, **options)
        optimizer.build(variables)
    numpy_options = {k: v for k, v in options.items() if k in ("beta_1",)}
    reference = NumpyAdafactor(learning_rate=0.1, **numpy_options)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    params = [x.astype(np_dtype) for x in initial]
    signature = [tf.TensorSpec(UNKNOWN[unknown](shape), dtype) for shape in ADAFACTOR_SHAPES]
    step = _compiled_apply(optimizer, variables, signature, mode, strategy)
    pending = [np.zeros(shape) for shape in ADAFACTOR_SHAPES]
    for k in range(STEPS * accumulation):
        grads = [rng.normal(size=shape).astype(np.float32) for shape in ADAFACTOR_SHAPES]
        step(*[tf.constant(g, dtype) for g in grads])
        # The summed gradient (two replicas) as the optimizer receives it, in its dtype; accumulated as Keras does.
        received = [(np.asarray(g.astype(np_dtype), np.float64) * _replicas(mode)) for g in grads]
        pending = [p + g for p, g in zip(pending, received)]
        if (k + 1) % accumulation == 0:
            params = reference.step(params, [p / accumulation for p in pending])
            pending = [np.zeros(shape) for shape in ADAFACTOR_SHAPES]
    # Stochastic rounding lands within one bfloat16 step of the exact value.
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-6)
    for variable, want in zip(variables, params):
        got = keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32"))
        np.testing.assert_allclose(
            got, np.asarray(want, np.float32), err_msg=variable.name, **tolerance
        )
    assert int(optimizer.iterations.numpy()) == STEPS


# ------------------------------------------------------------------ EmbeddingAdam

ROWS, DIM = 12, 4
IDS = [[1, 4, 1, 7], [0, 1, 2, 2], [7, 7, 3], [4, 11, 1, 11], [6, 2], [5, 1, 5]]
EMBEDDING_CASES = {
    "defaults": {},
    "last_occurrence_clipped_rowwise": {
        "use_gradient_accumulation": False,
        "second_moment": "rowwise",
        "clip_weight_max": 0.05,
    },
    "per_row_decay_accumulation": {
        "bias_correction": "per_row",
        "weight_decay": 0.3,
        "clipvalue": 0.4,
        "gradient_accumulation_steps": 2,
    },
}


def _embedding_reference_options(options):
    reference = dict(options)
    reference.pop("gradient_accumulation_steps", None)
    if "weight_decay" in reference:
        reference["weight_decay_factor"] = reference.pop("weight_decay")
        reference["multiply_weight_decay_factor_by_learning_rate"] = True
    return reference


@pytest.mark.parametrize("kind", ["dense", "indexed_slices"])
@pytest.mark.parametrize("case, mode, unknown", combinations(list(EMBEDDING_CASES)))
def test_embedding_adam_with_unknown_gradient_shapes_matches_numpy(case, kind, mode, unknown):
    options = EMBEDDING_CASES[case]
    if kind == "dense" and not options.get("use_gradient_accumulation", True):
        pytest.skip(
            "a dense gradient has summed its duplicates already: the last-occurrence rule is sparse"
        )
    strategy = _strategy(mode, options)
    rng = np.random.default_rng(1)
    initial = rng.uniform(-0.1, 0.1, (ROWS, DIM)).astype(np.float32)
    with strategy.scope():
        table = keras.Variable(initial, name="table")
        optimizer = kto.EmbeddingAdam(0.05, **options)
        optimizer.build([table])
    reference = NumpyEmbeddingAdam(
        initial, learning_rate=0.05, **_embedding_reference_options(options)
    )
    steps = options.get("gradient_accumulation_steps")
    feed = KerasAccumulation(reference, steps).apply_sparse if steps else reference.apply_sparse
    if kind == "dense":
        signature, make_gradients = [tf.TensorSpec(UNKNOWN[unknown]((ROWS, DIM)), tf.float32)], list
    else:
        signature = [
            tf.TensorSpec(UNKNOWN[unknown]((len(IDS[0]), DIM)), tf.float32),
            tf.TensorSpec([None], tf.int32),
        ]

        def make_gradients(inputs):
            values, indices = inputs
            return [tf.IndexedSlices(values, indices, tf.constant([ROWS, DIM]))]

    step = _compiled_apply(optimizer, [table], signature, mode, strategy, make_gradients)
    for seed, ids in enumerate(IDS):
        values = np.random.default_rng(seed).normal(0.0, 0.5, (len(ids), DIM)).astype(np.float32)
        if kind == "dense":
            dense = np.zeros((ROWS, DIM), np.float32)
            np.add.at(dense, ids, values)
            step(tf.constant(dense))
        else:
            step(tf.constant(values), tf.constant(ids, tf.int32))
        # Two replicas: the optimizer receives the gradient twice (all-gathered IndexedSlices, or the summed dense one).
        feed(list(ids) * _replicas(mode), np.concatenate([values] * _replicas(mode)))
    np.testing.assert_allclose(table.numpy(), reference.weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table.numpy()[[8, 9, 10]], initial[[8, 9, 10]])  # never looked up


# ------------------------------------------------------------------ shapes that differ at run time


@pytest.mark.parametrize(
    "kind", ["adafactor", "embedding_adam_dense", "embedding_adam_indexed_slices"]
)
def test_gradient_of_another_shape_at_run_time_raises_naming_the_variable(kind):
    variable = keras.Variable(np.ones((6, 4), np.float32), name="kernel")
    optimizer = kto.Adafactor(0.01) if kind == "adafactor" else kto.EmbeddingAdam(0.01)
    optimizer.build([variable])
    if kind == "embedding_adam_indexed_slices":
        signature = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int32)]
        step = tf.function(
            lambda values, ids: optimizer.apply(
                [tf.IndexedSlices(values, ids, tf.constant([6, 5]))], [variable]
            ),
            input_signature=signature,
        )
        wrong = (tf.ones((2, 5)), tf.constant([0, 3]))
    else:
        step = tf.function(
            lambda g: optimizer.apply([g], [variable]),
            input_signature=[tf.TensorSpec([None, None])],
        )
        wrong = (tf.ones((6, 5)),)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"variable \W*kernel\W* has shape .*variable has shape \(6, 4\).*at run time",
    ):
        step(*wrong)
    # Everything the gradient reaches waits for the check: the variable and its slots are unchanged.
    np.testing.assert_array_equal(variable.numpy(), np.ones((6, 4), np.float32))
    for slot in optimizer.variables[2:]:
        assert not np.any(keras.ops.convert_to_numpy(slot)), slot.path


# ------------------------------------------------------------------ the layer trained in its lookup


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("lazy_adam", [True, False])
def test_layer_trained_in_its_lookup_with_an_unknown_batch_size_matches_numpy(
    lazy_adam, jit_compile
):
    """Keras's trainer relaxes a step's batch dimension to unknown once batches of two sizes have run."""
    initial = np.random.default_rng(1).uniform(-0.1, 0.1, (ROWS, DIM)).astype(np.float32)
    optimizer = kto.EmbeddingAdam(0.05, lazy_adam=lazy_adam)
    layer = kto.layers.Embedding(
        ROWS, DIM, embeddings_initializer=keras.initializers.Constant(initial), optimizer=optimizer
    )
    layer.build()
    reference = NumpyEmbeddingAdam(initial, learning_rate=0.05, lazy_adam=lazy_adam)
    signature = [tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, DIM], tf.float32)]

    @tf.function(input_signature=signature, jit_compile=jit_compile)
    def step(ids, values):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * values)
        layer.iterations.assign(tape.gradient(loss, layer.iterations.value))

    for seed, ids in enumerate(IDS):
        values = np.random.default_rng(seed).normal(0.0, 0.5, (len(ids), DIM)).astype(np.float32)
        step(tf.constant(ids, tf.int32), tf.constant(values))
        reference.apply_sparse(np.array(ids), values)
    layer.catch_up()
    np.testing.assert_allclose(layer.embeddings.numpy(), reference.weights, rtol=1e-5, atol=1e-6)
