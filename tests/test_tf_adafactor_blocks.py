"""TF's Adafactor step in blocks (`_backend/tensorflow/adafactor.py`'s `assigning_step`) on its own.

Checked against the independent numpy reference (`tests/reference/numpy_adafactor.py`)
eagerly and inside `tf.function` (where Keras's TF trainer runs it), in one block
and in blocks of a few elements; and for the ordering of its graph ops.
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest

BACKEND = keras.backend.backend()
if BACKEND != "tensorflow":
    _REASON = f"TF's blocked Adafactor step needs KERAS_BACKEND=tensorflow; this run is {BACKEND}"
    print(f"{__name__}: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

import tensorflow as tf  # noqa: E402

from keras_tpu_optim._math import blocks  # noqa: E402
from keras_tpu_optim._math import adafactor as adafactor_math  # noqa: E402
from keras_tpu_optim._backend.tensorflow import adafactor as tf_adafactor  # noqa: E402
from keras_tpu_optim._math.adafactor import AdafactorOptions  # noqa: E402
from _adafactor_options import make_options  # noqa: E402  (tests/ is on pythonpath)
from reference.numpy_adafactor import NumpyAdafactor  # noqa: E402
from test_adafactor import make_data  # noqa: E402

SHAPES = [(3,), (37, 5), (2, 16, 3), (1, 7)]
STEPS = 5
TOLERANCES = {
    "float32": dict(rtol=1e-4, atol=1e-6),
    "bfloat16": dict(rtol=1e-2, atol=1e-2),
}
NUMPY_DTYPES = {"float32": np.dtype("float32"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def make_state(shape, options):
    """Zero slots as the optimizer builds them: factored over `options.factored_axes`, else one `v`."""
    axes = options.factored_axes(shape)
    if axes is None:
        slots = (tf.Variable(tf.zeros(shape)),)
    else:
        a, b = axes
        slots = (
            tf.Variable(tf.zeros([d for i, d in enumerate(shape) if i != b])),
            tf.Variable(tf.zeros([d for i, d in enumerate(shape) if i != a])),
        )
    momentum = None
    if options.beta_1 is not None:
        momentum = tf.Variable(tf.zeros(shape, dtype=options.momentum_dtype))
    return slots, momentum


def assigning_step(
    grad, variable, slots, momentum, learning_rate, step, variable_index, options, **kwargs
):
    """`tf_adafactor.assigning_step` with `options` (its numbers split off as the compiled step passes them)."""
    structure, values = adafactor_math.split_options(options)
    return tf_adafactor.assigning_step(
        grad, variable, slots, momentum, learning_rate, step, variable_index, values,
        structure=structure, **kwargs,
    )  # fmt: skip


def stepper(options, chunk_elements, in_graph):
    def step(grad, variable, slots, momentum, learning_rate, step, variable_index=0):
        assigning_step(
            grad,
            variable,
            slots,
            momentum,
            learning_rate,
            step,
            variable_index,
            options,
            chunk_elements=chunk_elements,
        )

    return tf.function(step, autograph=False) if in_graph else step


def as_float64(x):
    return np.asarray(tf.cast(tf.convert_to_tensor(x), tf.float32)).astype(np.float64)


# (dtype, beta_1, multiply_by_parameter_scale, schedule): each setting on and off at least once, with each dtype.
CASES = [
    ("float32", None, True, {}),
    ("float32", 0.9, False, dict(decay_offset=2, beta_2_cap=0.6)),
    ("float32", 0.9, True, {}),
    ("bfloat16", None, False, dict(decay_offset=2, beta_2_cap=0.6)),
    ("bfloat16", 0.9, True, {}),
]


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize(
    "chunk_elements", [blocks.CHUNK_ELEMENTS, 4], ids=["one_block", "blocks_of_4"]
)
@pytest.mark.parametrize(
    "dtype, beta_1, multiply_by_parameter_scale, schedule",
    CASES,
    ids=[
        "f32",
        "f32_momentum_offset_cap_no_scale",
        "f32_momentum",
        "bf16_offset_cap_no_scale",
        "bf16_momentum",
    ],
)
def test_matches_numpy_reference(
    dtype, beta_1, multiply_by_parameter_scale, schedule, chunk_elements, in_graph
):
    reference = NumpyAdafactor(
        learning_rate=0.5,
        beta_1=beta_1,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        **schedule,
    )
    options = make_options(reference)
    step_fn = stepper(options, chunk_elements, in_graph)
    inits, grads = make_data(SHAPES, STEPS)
    np_dtype = NUMPY_DTYPES[dtype]
    expected = [x.astype(np_dtype) for x in inits]
    params = [tf.Variable(tf.cast(x, dtype)) for x in inits]
    states = [make_state(s, options) for s in SHAPES]
    for t, step_grads in enumerate(grads):
        expected = reference.step(expected, [g.astype(np_dtype) for g in step_grads])
        for param, grad, (slots, momentum) in zip(params, step_grads, states):
            # Other scalar dtypes than the kernel's float32, to exercise the casts.
            step_fn(
                tf.cast(grad, dtype),
                param,
                slots,
                momentum,
                tf.constant(0.5, tf.float64),
                tf.constant(t + 1, tf.int64),
            )
        for i, (param, want) in enumerate(zip(params, expected)):
            assert param.dtype == tf.as_dtype(dtype)
            np.testing.assert_allclose(
                as_float64(param),
                want.astype(np.float64),
                **TOLERANCES[dtype],
                err_msg=f"step {t + 1}, variable {i} of shape {SHAPES[i]}",
            )
    for i, ((slots, momentum), state) in enumerate(zip(states, reference.state)):
        names = ("row", "column") if len(slots) == 2 else ("v",)
        for slot, name in zip(slots, names):
            np.testing.assert_allclose(
                as_float64(slot), state[name], rtol=1e-4, err_msg=f"{name} of variable {i}"
            )
        if beta_1 is not None:
            np.testing.assert_allclose(
                as_float64(momentum), state["m"], **TOLERANCES[dtype], err_msg=f"m {i}"
            )
    for i, (final, init) in enumerate(zip(expected, inits)):
        assert not np.allclose(final.astype(np.float64), init, rtol=1e-3, atol=0), (
            f"variable {i} never moved"
        )


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "tf_function"])
def test_two_largest_in_blocks_matches_one_block(in_graph):
    """Statistics over the blocks' own axis (summed across blocks) and over the others (one part per block)."""
    # (30, 4, 20): the leading axis is the largest (row means over the blocks' axis);
    # (6, 40, 9): neither factored axis is the leading one; (3, 8, 50): the leading axis is not factored.
    shapes = [(30, 4, 20), (6, 40, 9), (3, 8, 50)]
    options = AdafactorOptions(factored_dims="two_largest", beta_1=0.9, momentum_dtype="bfloat16")
    rng = np.random.default_rng(1)
    inits = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(3)]
    finals = []
    for chunk in (blocks.CHUNK_ELEMENTS, 50):
        step_fn = stepper(options, chunk, in_graph)
        params = [tf.Variable(x) for x in inits]
        states = [make_state(s, options) for s in shapes]
        for t, step_grads in enumerate(grads):
            for param, grad, (slots, momentum) in zip(params, step_grads, states):
                step_fn(
                    tf.constant(grad), param, slots, momentum, tf.constant(0.01), tf.constant(t + 1)
                )
        finals.append(
            [as_float64(p) for p in params] + [as_float64(s) for st in states for s in st[0]]
        )
    for whole, blocked in zip(*finals):
        np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-7)
    for final, init in zip(finals[0], inits):
        assert not np.allclose(final, init)


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "tf_function"])
def test_blocks_round_stochastically_as_one_block(in_graph):
    """Stochastic rounding's random bits belong to the element, whatever the blocks."""
    options = AdafactorOptions(stochastic_rounding=True, seed=3, beta_1=0.9)
    rng = np.random.default_rng(4)
    # Blocks of several rows, of one row and of part of a vector, with a shorter last block.
    shapes = [(12, 30), (9, 20, 6), (300,)]
    inits = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [rng.normal(size=s).astype("float32") for s in shapes]
    results = []
    for chunk in (blocks.CHUNK_ELEMENTS, 90, 13):
        step_fn = stepper(options, chunk, in_graph)
        params = [tf.Variable(tf.cast(x, tf.bfloat16)) for x in inits]
        states = [make_state(s, options) for s in shapes]
        for t in range(3):
            for index, (param, grad, (slots, momentum)) in enumerate(zip(params, grads, states)):
                step_fn(
                    tf.cast(grad, tf.bfloat16),
                    param,
                    slots,
                    momentum,
                    tf.constant(0.01),
                    tf.constant(t + 1),
                    index,
                )
        results.append([as_float64(p) for p in params])
    for blocked in results[1:]:
        for whole, part, init in zip(results[0], blocked, inits):
            assert not np.array_equal(whole, init.astype(np.float64))
            # The same bits, but where float32 sums in another order moved a value across a rounding threshold.
            assert np.mean(whole == part) > 0.99


def depends_on(op, target) -> bool:
    """Whether graph op `op` runs after `target` (through data or control inputs)."""
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if node.name in seen:
            continue
        seen.add(node.name)
        stack.extend(t.op for t in node.inputs)
        stack.extend(node.control_inputs)
    return False


def test_reductions_are_block_sized_and_ordered():
    """In a graph, no square of the gradient is bigger than a block, and each block's waits for the previous block's."""
    options = AdafactorOptions()
    shape = (64, 32)
    chunk = 256  # 8 rows: 8 blocks
    variable = tf.Variable(tf.ones(shape))
    slots, _ = make_state(shape, options)

    @tf.function(autograph=False)
    def step(grad):
        assigning_step(
            grad, variable, slots, None, 0.01, tf.constant(1), 0, options, chunk_elements=chunk
        )

    graph = step.get_concrete_function(tf.TensorSpec(shape)).graph
    all_squares = [op for op in graph.get_operations() if op.type == "Square"]
    for op in all_squares:
        assert op.outputs[0].shape.num_elements() <= chunk, op.outputs[0].shape
    # The statistics and RMS(update): one square of g per block per pass (the parameter's RMS is a dot product).
    squares = [op for op in all_squares if tuple(op.outputs[0].shape) == (8, 32)]
    assert len(squares) == 2 * 8
    for passes in range(2):
        in_pass = squares[8 * passes : 8 * (passes + 1)]
        for previous, op in zip(in_pass, in_pass[1:]):
            assert depends_on(op, previous), (op.name, previous.name)
            assert not depends_on(previous, op)


def test_variables_steps_are_chained_in_a_graph():
    """`after_previous_step` orders each variable's step after the previous one's in the same graph."""
    variables = [tf.Variable(tf.zeros([4])) for _ in range(3)]

    @tf.function(autograph=False)
    def apply(chained):
        for v in variables:
            if chained:
                with tf_adafactor.after_previous_step() as done:
                    done.append(v.assign_add(tf.ones([4]), read_value=False))
            else:
                v.assign_add(tf.ones([4]), read_value=False)

    for chained in (True, False):
        graph = apply.get_concrete_function(chained).graph
        assigns = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
        assert len(assigns) == 3
        for previous, op in zip(assigns, assigns[1:]):
            assert depends_on(op, previous) == chained, (op.name, chained)
    apply(True)
    for v in variables:
        np.testing.assert_array_equal(v.numpy(), np.ones(4))


@pytest.mark.parametrize("optimizer_name", ["Adafactor", "EmbeddingAdam"])
def test_state_is_created_eagerly_when_built_in_a_trace(optimizer_name, monkeypatch):
    """Built inside a `tf.function` (as Keras's TF trainer builds it), the state is initialised eagerly:
    the trace keeps the functions it keeps for an optimizer built before it (no initializer function per
    state variable), and the function is traced once, not a second time for having created variables;
    the numbers are those of an eager run."""
    import contextlib

    from tensorflow.python.eager import context

    import keras_tpu_optim
    from keras_tpu_optim import _backend

    def run(in_graph, built_before=False):
        variables = [
            keras.Variable(np.full((6, 4), 0.5, "float32")),
            keras.Variable(np.ones(4, "float32")),
        ]
        optimizer = getattr(keras_tpu_optim, optimizer_name)(learning_rate=0.1)
        if built_before:
            optimizer.build(variables)
        grads = [tf.constant(np.arange(24, dtype="float32").reshape(6, 4) / 24), tf.ones([4])]
        apply = lambda: optimizer.apply(grads, variables)  # noqa: E731
        if in_graph:
            apply = tf.function(apply, autograph=False)
        before = set(context.context().list_function_names())
        apply()
        apply()
        traces = apply.experimental_get_tracing_count() if in_graph else 0
        # Names, not counts: functions of earlier tests may be collected meanwhile.
        new_functions = len(set(context.context().list_function_names()) - before)
        return optimizer, [v.numpy() for v in variables], new_functions, traces

    optimizer, traced, new_functions, traces = run(True)
    assert traces == 1
    n_state = len(optimizer.variables) - 2  # less iterations and learning rate
    assert n_state >= 2
    _, _, new_functions_built_before, _ = run(True, built_before=True)
    assert new_functions == new_functions_built_before
    with monkeypatch.context() as patch:
        patch.setattr(_backend.get(), "state_creation_scope", contextlib.nullcontext)
        _, traced_in_scope, new_functions_in_scope, traces_in_scope = run(True)
    assert traces_in_scope == 2  # what the test would see without the scope
    # Keras 3.16's TF optimizer creates its variables under `tf.init_scope` itself: no initializer
    # functions without ours either (the second trace remains).
    if tuple(int(part) for part in keras.__version__.split(".")[:2]) < (3, 16):
        assert new_functions_in_scope - new_functions >= n_state, (
            new_functions,
            new_functions_in_scope,
        )
    _, eager, _, _ = run(False)
    for a, b, c, initial in zip(traced, traced_in_scope, eager, (0.5, 1.0)):
        np.testing.assert_allclose(a, c, rtol=1e-6)
        np.testing.assert_allclose(b, c, rtol=1e-6)
        assert not np.allclose(a, initial)


@pytest.mark.parametrize("optimizer_name", ["Adafactor", "EmbeddingAdam"])
def test_keras_fit_traces_the_train_step_once(optimizer_name):
    """Keras's TF trainer builds the optimizer inside its traced train step. As with SGD, whose state
    exists before `fit`, the step is traced once: a second trace would keep a second copy of the
    whole step's graph in the process (measured: 11 MB on a 0.1M-parameter transformer)."""
    from tensorflow.python.eager import context

    import keras_tpu_optim

    def traces(optimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(3)])
        model.compile(optimizer=optimizer, loss="mse")
        names = lambda: {
            n for n in context.context().list_function_names() if "one_step_on_data" in n
        }  # noqa: E731
        before = names()
        x, y = np.ones((8, 5), "float32"), np.zeros((8, 3), "float32")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        assert optimizer.built
        return len(names() - before)

    assert traces(keras.optimizers.SGD(0.1)) == 1
    assert traces(getattr(keras_tpu_optim, optimizer_name)(learning_rate=0.1)) == 1
    assert traces(keras.optimizers.Adam(0.1)) == 2  # Keras's own: state created in the trace
