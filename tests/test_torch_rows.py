"""torch's row step (`_backend/torch/rows.py`): the touched rows of sparse COO and dense
gradients, gathered, updated by the one row function and copied back, checked against the numpy
reference (`tests/reference/numpy_embedding_adam.py`), eagerly and under `torch.compile`.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from tests.reference.numpy_embedding_adam import NumpyEmbeddingAdam

BACKEND = keras.backend.backend()
if BACKEND != "torch":
    _REASON = f"torch's row kernel needs KERAS_BACKEND=torch; this run is {BACKEND}"
    print(f"{__name__}: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

import torch  # noqa: E402


ROWS, DIM = 50, 6
OPTIONS = {
    "default": {},
    "clips_and_decay": dict(
        clipvalue=(-0.05, 0.08),
        clip_weight_min=-0.12,
        clip_weight_max=0.12,
        weight_decay_factor=0.2,
        multiply_weight_decay_factor_by_learning_rate=True,
    ),
    "outside_sqrt_plain_decay": dict(sum_inside_sqrt=False, weight_decay_factor=0.01),
    "rowwise_per_row": dict(second_moment="rowwise", bias_correction="per_row"),
}


def _sparse(ids, values):
    return torch.sparse_coo_tensor(
        torch.tensor(np.asarray(ids))[None],
        torch.tensor(values),
        size=(ROWS, DIM),
        check_invariants=True,
    )


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_touched_rows_match_numpy(name, kind):
    options = OPTIONS[name]
    rng = np.random.default_rng(0)
    table = rng.uniform(-0.1, 0.1, (ROWS, DIM)).astype(np.float32)
    variable = keras.Variable(table)
    optimizer = kto.EmbeddingAdam(0.05, **options)
    reference = NumpyEmbeddingAdam(table, learning_rate=0.05, **options)
    optimizer.build([variable])

    for step in range(4):
        ids = rng.integers(
            0, ROWS // 2 + 5 * step, 12
        )  # duplicates; rows touched again, and new ones
        values = rng.normal(0, 0.5, (12, DIM)).astype(np.float32)
        if kind == "sparse":
            optimizer.apply([_sparse(ids, values)], [variable])
            reference.apply_sparse(ids, values)
        else:
            dense = np.zeros((ROWS, DIM), np.float32)
            np.add.at(dense, ids, values)
            optimizer.apply([torch.tensor(dense)], [variable])
            reference.apply_dense(dense)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(variable), reference.weights, rtol=2e-6, atol=2e-7
    )
    momenta, velocities = optimizer._state_of(variable).slots[:2]
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(momenta), reference.momenta, rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(velocities), reference.velocities, rtol=1e-5, atol=1e-12
    )
    # Rows never touched keep their initial values exactly (not a vacuous comparison: others moved).
    untouched = np.ones(ROWS, bool)
    untouched[: ROWS // 2 + 15] = False
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable)[untouched], table[untouched])
    assert not np.allclose(keras.ops.convert_to_numpy(variable)[:10], table[:10])


COMPILED_OPTIONS = {
    "clips_and_decay": OPTIONS["clips_and_decay"],
    "rowwise_per_row_ema": dict(
        second_moment="rowwise", bias_correction="per_row", use_ema=True, ema_momentum=0.9
    ),
}


@pytest.mark.processes  # inductor compiles its C++ kernels in compiler subprocesses
@pytest.mark.parametrize("name", list(COMPILED_OPTIONS))
def test_compiled_dense_step_is_one_graph_with_the_numpy_numbers(name):
    """Under `torch.compile` (Keras's `jit_compile=True`) a dense gradient's lazy step has static shapes:
    one graph, no break (eager finds the touched rows with `nonzero`, whose shape depends on the data),
    compiled once for every step, and the reference's numbers, untouched rows bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    options = COMPILED_OPTIONS[name]
    rng = np.random.default_rng(2)
    table = rng.uniform(-0.1, 0.1, (ROWS, DIM)).astype(np.float32)
    reference = NumpyEmbeddingAdam(
        table, learning_rate=0.05, **{k: v for k, v in options.items() if "ema" not in k}
    )
    gradients = []
    for step in range(4):
        ids = rng.integers(0, ROWS // 2 + 5 * step, 12)
        dense = np.zeros((ROWS, DIM), np.float32)
        np.add.at(dense, ids, rng.normal(0, 0.5, (12, DIM)).astype(np.float32))
        dense[ROWS - 1, 0] = 1e-30 if step == 3 else 0.0  # a row of one tiny entry is touched
        gradients.append(dense)

    def new_step():
        variable = keras.Variable(table)
        optimizer = kto.EmbeddingAdam(0.05, **options)
        optimizer.build([variable])
        return variable, optimizer, lambda gradient: optimizer.apply([gradient], [variable])

    explained = torch._dynamo.explain(new_step()[2])(torch.tensor(gradients[0]))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    variable, optimizer, step = new_step()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for dense in gradients:
        compiled(torch.tensor(dense))
        reference.apply_dense(dense)
    assert counter.frame_count == 1
    weights = keras.ops.convert_to_numpy(variable)
    np.testing.assert_allclose(weights, reference.weights, rtol=2e-6, atol=2e-7)
    momenta, velocities = optimizer._state_of(variable).slots[:2]
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(momenta), reference.momenta, rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(velocities), reference.velocities, rtol=1e-5, atol=1e-12
    )
    untouched = np.ones(ROWS, bool)
    untouched[: ROWS // 2 + 15] = False
    untouched[ROWS - 1] = False
    np.testing.assert_array_equal(weights[untouched], table[untouched])
    assert keras.ops.convert_to_numpy(momenta)[ROWS - 1, 0] != 0  # the tiny row was updated
