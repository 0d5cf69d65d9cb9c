"""Every private Keras/TF/torch API the package uses (`keras_tpu_optim._private`) still exists and behaves as used.

A failure here after an upgrade names the one function to adapt.
"""

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from keras_tpu_optim import _private

BACKEND = keras.backend.backend()


def built(optimizer, variables):
    optimizer.build(variables)
    return optimizer


def test_in_stateless_scope():
    assert not _private.in_stateless_scope()
    with keras.StatelessScope():
        assert _private.in_stateless_scope()


def test_calling_model_is_the_outermost_layer_called():
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(_private.calling_model())
            return x

    inputs = keras.Input((2,))
    model = keras.Model(inputs, Probe()(keras.layers.Dense(2)(inputs)))
    seen.clear()
    model(np.ones((1, 2), "float32"))
    assert seen == [model]
    assert _private.calling_model() is None


@pytest.mark.backend_neutral
def test_base_optimizer_keyword_args_documents_the_base_keywords():
    text = _private.base_optimizer_keyword_args()
    for keyword in ("weight_decay", "clipnorm", "use_ema", "gradient_accumulation_steps"):
        assert keyword in text


@pytest.mark.parametrize(
    "learning_rate",
    [0.01, keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5), lambda: 0.03],
    ids=["float", "schedule", "callable"],
)
def test_learning_rate_at_the_current_step_is_keras_learning_rate(learning_rate):
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = built(kto.Adafactor(learning_rate=learning_rate), [variable])
    for _ in range(3):
        expected = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        actual = _private.learning_rate_at(optimizer, optimizer.iterations)
        assert float(keras.ops.convert_to_numpy(actual)) == pytest.approx(expected, rel=1e-6)
        optimizer.apply([np.ones((3, 2), np.float32)], [variable])
    assert _private.raw_learning_rate(optimizer) is optimizer._learning_rate


def test_learning_rate_at_another_step_follows_the_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    optimizer = kto.EmbeddingAdam(schedule)
    assert float(
        keras.ops.convert_to_numpy(_private.learning_rate_at(optimizer, 4))
    ) == pytest.approx(0.025)


def test_variable_bookkeeping():
    kernel = keras.Variable(np.ones((3, 2), np.float32), name="kernel")
    bias = keras.Variable(np.ones((2,), np.float32), name="bias")
    optimizer = kto.Adafactor(use_ema=True, gradient_accumulation_steps=2, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build([kernel, bias])
    assert _private.trainable_variables(optimizer) == [kernel, bias]
    assert _private.variable_index(optimizer, bias) == 1
    assert not _private.overwritten_with_gradient(optimizer, kernel)
    assert _private.uses_weight_decay(optimizer, kernel) and not _private.uses_weight_decay(
        optimizer, bias
    )
    assert _private.has_weight_decay_exclusions(optimizer)
    assert not _private.has_weight_decay_exclusions(kto.Adafactor(weight_decay=0.1))
    averages = _private.moving_averages(optimizer)
    accumulators = _private.gradient_accumulators(optimizer)
    assert [tuple(a.shape) for a in averages] == [(3, 2), (2,)]
    assert [tuple(a.shape) for a in accumulators] == [(3, 2), (2,)]
    assert all(_private.is_tracked(optimizer, v) for v in averages + accumulators)
    extra = keras.Variable(np.zeros((2,), np.float32), name="extra")
    assert not _private.is_tracked(optimizer, extra)
    _private.track_variable(optimizer, extra)
    assert _private.is_tracked(optimizer, extra)
    assert _private.variable_layout(kernel) is None


def test_weight_decay_decision_of_an_unbuilt_optimizer():
    """The EmbeddingAdam of a `layers.Embedding` is never built: its exclusions count as after a build.

    (Keras 3.16's `_use_weight_decay` raises on an unbuilt optimizer.)
    """
    kernel = keras.Variable(np.ones((3, 2), np.float32), name="kernel")
    bias = keras.Variable(np.ones((2,), np.float32), name="bias")
    table = keras.Variable(np.ones((4, 2), np.float32), name="table")
    optimizer = kto.EmbeddingAdam(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[table], var_names=["bias"])
    expected = {"kernel": True, "bias": False, "table": False}
    assert not optimizer.built
    assert {
        v.name: _private.uses_weight_decay(optimizer, v) for v in (kernel, bias, table)
    } == expected
    optimizer.build([kernel, bias, table])
    assert {
        v.name: _private.uses_weight_decay(optimizer, v) for v in (kernel, bias, table)
    } == expected


def test_overwritten_with_gradient_variables_are_seen():
    variable = keras.Variable(np.ones((2,), np.float32))
    variable.overwrite_with_gradient = True
    optimizer = built(kto.Adafactor(), [variable])
    assert _private.overwritten_with_gradient(optimizer, variable)


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow's XLA-context test is the TF backend's"
)
def test_tf_in_xla_context():
    import tensorflow as tf

    seen = {}

    @tf.function(jit_compile=True)
    def compiled():
        seen["compiled"] = _private.tf_in_xla_context()
        return tf.constant(0)

    @tf.function
    def graph():
        seen["graph"] = _private.tf_in_xla_context()
        return tf.constant(0)

    compiled()
    graph()
    assert seen == {"compiled": True, "graph": False}
    assert not _private.tf_in_xla_context()


@pytest.mark.skipif(BACKEND != "torch", reason="torch sparse tensors are the torch backend's")
def test_torch_sparse_entries_keep_duplicates_unless_coalesced():
    import torch

    indices = torch.tensor([[1, 3, 1]])
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    gradient = torch.sparse_coo_tensor(indices, values, (5, 2))
    ids, rows = _private.torch_sparse_entries(gradient)
    np.testing.assert_array_equal(ids.numpy(), [1, 3, 1])
    np.testing.assert_array_equal(rows.numpy(), values.numpy())
    ids, rows = _private.torch_sparse_entries(gradient.coalesce())
    np.testing.assert_array_equal(ids.numpy(), [1, 3])
    np.testing.assert_array_equal(rows.numpy(), [[6.0, 8.0], [3.0, 4.0]])


def test_keras_weight_decay_hook_is_the_one_embedding_adam_overrides():
    """EmbeddingAdam turns Keras's every-row decay off by overriding `_apply_weight_decay`."""
    assert callable(getattr(keras.optimizers.Optimizer, "_apply_weight_decay", None))
    assert "_apply_weight_decay" in vars(kto.EmbeddingAdam)
    table = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = kto.EmbeddingAdam(0.1, weight_decay=0.5)
    gradient = np.zeros((3, 2), np.float32)
    gradient[0] = 1.0
    optimizer.apply([gradient], [table])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(table)[1:], 1.0)
    assert np.all(keras.ops.convert_to_numpy(table)[0] < 1.0)


def test_keras_gradient_clipping_hook_is_the_one_embedding_adam_overrides():
    """EmbeddingAdam keeps Keras's clipnorm but moves clipvalue into the row update."""
    assert callable(getattr(keras.optimizers.Optimizer, "_clip_gradients", None))
    assert "_clip_gradients" in vars(kto.EmbeddingAdam)
    optimizer = kto.EmbeddingAdam(clipvalue=0.1, clipnorm=1.0)
    assert optimizer.clipvalue == 0.1
    gradient = keras.ops.convert_to_tensor(np.array([[3.0, 4.0], [0.0, 0.0]], np.float32))
    (clipped,) = optimizer._clip_gradients([gradient])
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(clipped), [[0.6, 0.8], [0.0, 0.0]], rtol=1e-6
    )


def test_layout_map_of_a_distribution():
    if BACKEND != "jax" or len(keras.distribution.list_devices()) < 2:
        pytest.skip("keras.distribution.ModelParallel needs the JAX backend and 2 devices")
    mesh = keras.distribution.DeviceMesh((2,), ["model"], keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    assert (
        _private.layout_map(keras.distribution.ModelParallel(layout_map=layout_map)) is layout_map
    )
    assert (
        _private.layout_map(
            keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:2])
        )
        is None
    )


def test_raw_iterations_counts_apply_calls_under_gradient_accumulation():
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = built(kto.EmbeddingAdam(gradient_accumulation_steps=2), [variable])
    for _ in range(3):
        optimizer.apply([np.ones((3, 2), np.float32)], [variable])
    assert _private.raw_iterations(optimizer) is optimizer._iterations
    assert int(keras.ops.convert_to_numpy(_private.raw_iterations(optimizer))) == 3
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 1


@pytest.mark.parametrize("hook", _private.EMA_HOOKS)
def test_ema_hooks_exist_and_apply_calls_the_update_hook(hook, monkeypatch):
    """EmbeddingAdam overrides Keras's EMA hooks: they must exist, and `apply` must call the update one."""
    assert callable(getattr(keras.optimizers.Optimizer, hook))
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = built(kto.EmbeddingAdam(use_ema=True, ema_overwrite_frequency=1), [variable])
    calls = []
    original = getattr(kto.EmbeddingAdam, hook)

    def spy(self, *args, **kwargs):
        calls.append(hook)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(kto.EmbeddingAdam, hook, spy)
    optimizer.apply([np.ones((3, 2), np.float32)], [variable])
    if hook == "_update_model_variables_moving_average" or BACKEND != "jax":
        # (Keras's JAX optimizer overwrites the variables inline rather than through the second hook.)
        assert calls, f"Keras's apply no longer calls {hook}"
    optimizer.finalize_variable_values([variable])


def test_accumulation_hook_exists_and_apply_calls_it(monkeypatch):
    """Both optimizers override Keras's `_backend_apply_gradients` (the accumulate-or-update step)."""
    from keras_tpu_optim._base import OptimizerBase

    assert callable(getattr(keras.optimizers.Optimizer, _private.ACCUMULATION_HOOK))
    assert _private.ACCUMULATION_HOOK in vars(OptimizerBase)
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = built(kto.EmbeddingAdam(gradient_accumulation_steps=2), [variable])
    calls = []
    original = getattr(OptimizerBase, _private.ACCUMULATION_HOOK)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OptimizerBase, _private.ACCUMULATION_HOOK, spy)
    optimizer.apply([np.ones((3, 2), np.float32)], [variable])
    assert calls, f"Keras's apply no longer calls {_private.ACCUMULATION_HOOK}"


def test_keras_step_parts_the_accumulation_calls():
    """The parts of Keras's step `keras_tpu_optim._accumulation` runs: clip, decay, update loop, EMA hooks."""
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer = built(
        kto.EmbeddingAdam(0.1, clipnorm=1.0, use_ema=True, ema_overwrite_frequency=1), [variable]
    )
    gradient = keras.ops.convert_to_tensor(
        np.array([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]], np.float32)
    )
    (clipped,) = _private.clip_gradients(optimizer, [gradient])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clipped)[0], [0.6, 0.8], rtol=1e-6)
    _private.apply_weight_decay(optimizer, [variable])  # EmbeddingAdam's: lazy, so nothing here
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), 1.0)
    _private.backend_update_step(optimizer, [clipped], [variable], optimizer.learning_rate)
    after = keras.ops.convert_to_numpy(variable)
    assert np.all(after[0] < 1.0) and np.all(after[1:] == 1.0)
    _private.update_moving_averages(optimizer)
    (average,) = _private.moving_averages(optimizer)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(average), after)
    variable.assign(np.zeros((3, 2), np.float32))
    _private.overwrite_with_moving_averages(optimizer)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), after)


def test_moving_averages_left_out_of_keras_ema_step():
    """EmbeddingAdam's lazy EMA runs Keras's own EMA step with its lazily averaged tables left out."""
    kernel = keras.Variable(np.ones((3, 2), np.float32))
    bias = keras.Variable(np.ones((2,), np.float32))
    optimizer = built(kto.Adafactor(use_ema=True), [kernel, bias])
    averages = _private.moving_averages(optimizer)
    with _private.moving_averages_left_out(optimizer, [averages[0]]):
        left = _private.moving_averages(optimizer)
        assert left[0] is None and left[1] is averages[1]
        keras.optimizers.Optimizer._update_model_variables_moving_average(optimizer, [kernel, bias])
    assert all(a is b for a, b in zip(_private.moving_averages(optimizer), averages, strict=True))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(averages[0]), 0.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(averages[1]), 1.0)
    assert not any(v is None for v in optimizer.variables)
