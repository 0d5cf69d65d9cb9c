"""The TensorFlow pass's one `MirroredStrategy`, over the two logical CPU devices tests/conftest.py makes.

One for the whole process: strategies made one after another number their
collectives alike, and an all-reduce of another dtype or shape then meets the
first one's cached parameters.
"""

import functools

import pytest


@functools.cache
def _strategy():
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def mirrored_strategy():
    import tensorflow as tf

    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip(
            "needs two logical CPU devices (tests/conftest.py splits the CPU in the TensorFlow pass)"
        )
    return _strategy()
