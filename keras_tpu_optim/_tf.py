"""Small TensorFlow helpers shared by the TF fast paths (imported only on that backend)."""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf


def native_variable(variable):
    """The tf.Variable behind a Keras variable (Keras's TF optimizer may pass either)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def in_xla_context() -> bool:
    """Whether the op being built will be compiled by XLA (`jit_compile=True`).

    Uses a private TF function; if TF moves it, says True: the callers' XLA
    forms are correct everywhere, only slower without XLA.
    """
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        return True
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def compiling_helps() -> bool:
    """Whether compiling an update with XLA helps here: no XLA around it, no distribution strategy.

    (Replica and mirrored variables stay on TF's own path.)
    """
    return not tf.distribute.has_strategy() and not in_xla_context()


# Per owner (an optimizer), its compiled functions by key.
_compiled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_function(owner, key, make):
    """`tf.function(make(), jit_compile=True)`, made once per `(owner, key)`.

    A trace belongs to its owner: one made inside one model's train function
    must not be called from another's (TF then refers to the first model's
    variables).
    """
    functions = _compiled.setdefault(owner, {})
    function = functions.get(key)
    if function is None:
        function = functions[key] = tf.function(make(), jit_compile=True)
    return function
