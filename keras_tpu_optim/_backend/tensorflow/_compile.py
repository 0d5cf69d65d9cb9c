"""Compiling TF updates with XLA where nothing else compiles them, one trace per optimizer or layer."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_tpu_optim import _private


def native_variable(variable):
    """The tf.Variable behind a Keras variable (Keras's TF optimizer may pass either)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def compiling_helps() -> bool:
    """Whether compiling an update with XLA helps here: no XLA around it, no distribution strategy."""
    return not tf.distribute.has_strategy() and not _private.tf_in_xla_context()


# The functions called eagerly, by key alone (traced ones are in their optimizer's or layer's cache).
_eager: dict = {}


def compiled_function(cache, key, make, *, xla: bool = True):
    """`tf.function(make(), jit_compile=True, autograph=False)` made once per `key` in `cache` (the optimizer's
    or layer's; eagerly one shared dict); with `xla=False`, a graph function run by TF's kernels, never inlined."""
    functions = _eager if tf.executing_eagerly() else cache
    key = (key, xla)
    function = functions.get(key)
    if function is None:
        # No autograph: the bodies are keras.ops code without Python control flow on tensors (JAX
        # traces the same code), and converting them took a large share of every trace.
        kind = {"jit_compile": True} if xla else {"experimental_attributes": {"_noinline": True}}
        function = functions[key] = tf.function(make(), autograph=False, **kind)
    return function


def compiled_where_it_helps(cache, key, function):
    """`function`, compiled with XLA (`compiled_function`) where that helps (`compiling_helps`)."""
    return compiled_function(cache, key, lambda: function) if compiling_helps() else function


def platform_of(variable) -> str:
    device = getattr(native_variable(variable), "device", "") or ""
    if device:
        return tf.DeviceSpec.from_string(device).device_type.lower() or "cpu"
    # Not placed yet: where TF would place it.
    for kind in ("TPU", "GPU"):
        if tf.config.list_logical_devices(kind):
            return kind.lower()
    return "cpu"
