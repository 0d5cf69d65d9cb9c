"""One touched-row rule for dense gradients on every backend and path: a row with any entry non-zero or NaN.

The edge values are the ones where formulations part: tiny normal floats (a
squared norm underflows), NaN (a max-reduction with fast min/max drops it),
infinities of both signs in one row (their sum is NaN), float32's largest
values (their sum overflows) and -0.0 (zero). The expected rows are computed
here from the rule itself, entry by entry; what the optimizer did is read
from its per-row update counter (`bias_correction="per_row"`) and from the
untouched rows' bits.
"""

import math

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
DIM = 4
EDGE_ROWS = [
    [0.0, 0.0, 0.0, 0.0],
    [1e-30, 0.0, 0.0, 0.0],
    [0.0, -1.2e-38, 0.0, 0.0],  # just above float32's smallest normal
    [math.nan, 0.0, 0.0, 0.0],
    [0.0, 0.0, math.inf, 0.0],
    [-0.0, -0.0, -0.0, -0.0],
    [0.0, 0.0, 0.0, -1e-30],
    [3e38, 3e38, 3e38, 3e38],
    [-math.inf, math.inf, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
]
GRADIENT = np.array(EDGE_ROWS, np.float32)
EXPECTED = [i for i, row in enumerate(EDGE_ROWS) if any(x != 0 or math.isnan(x) for x in row)]


def paths():
    if BACKEND == "tensorflow":
        return ["eager", "tf.function", "jit_compile"]
    if BACKEND == "jax":
        return ["eager", "jax.jit"]
    return ["eager", "torch.compile"]


def step(optimizer, table, gradient, path):
    if path == "eager":
        optimizer.apply([gradient], [table])
    elif path in ("tf.function", "jit_compile"):
        import tensorflow as tf

        tf.function(lambda g: optimizer.apply([g], [table]), jit_compile=path == "jit_compile")(
            gradient
        )
    elif path == "jax.jit":
        from bench_common import jit_stateless_apply

        values, (new_table,) = jit_stateless_apply(optimizer)(
            [v.value for v in optimizer.variables], [gradient], [table.value]
        )
        for variable, value in zip(optimizer.variables, values):
            variable.assign(value)
        table.assign(new_table)
    else:
        import torch

        torch.compile(lambda g: optimizer.apply([g], [table]), backend="eager", fullgraph=False)(
            gradient
        )


@pytest.mark.parametrize("accumulation", [None, 2], ids=["plain", "accumulated"])
@pytest.mark.parametrize("path", paths())
def test_a_row_is_touched_when_any_entry_is_non_zero_or_nan(path, accumulation):
    init = np.arange(len(EDGE_ROWS) * DIM, dtype=np.float32).reshape(-1, DIM) / 7.0 + 1.0
    table = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(
        0.01, bias_correction="per_row", gradient_accumulation_steps=accumulation
    )
    optimizer.build([table])
    gradient = keras.ops.convert_to_tensor(GRADIENT)
    for _ in range(accumulation or 1):
        step(optimizer, table, gradient, path)
    (row_steps,) = [v for v in optimizer.variables if v.path.endswith("row_steps")]
    counts = keras.ops.convert_to_numpy(row_steps)
    assert np.flatnonzero(counts).tolist() == EXPECTED, counts
    untouched = [i for i in range(len(EDGE_ROWS)) if i not in EXPECTED]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(table)[untouched], init[untouched])
