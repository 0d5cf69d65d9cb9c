"""Small TensorFlow helpers shared by the TF fast paths (imported only on that backend)."""

from __future__ import annotations

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
