"""Prints the RSS a large XLA compilation leaves behind, with or without one of our optimizers built first.

Run in its own process by `test_compile_heap.py` (a process's RSS is its own).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def many_ops(xs):
    out = []
    for x in xs:
        for k in range(12):
            x = jnp.tanh(x @ x.T) * (1.0 + k) + jnp.sum(x, axis=0) * 0.5
        out.append(x)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "built":
        import keras

        import keras_tpu_optim as kto

        kto.Adafactor().build([keras.Variable(np.zeros((4, 4), "float32"))])
    xs = [jnp.ones((8 + i % 5, 8 + i % 5)) for i in range(40)]
    jax.block_until_ready(xs)
    before = rss_mb()
    jax.jit(many_ops).lower(xs).compile()
    print(f"KEPT_MB {rss_mb() - before:.1f}")
