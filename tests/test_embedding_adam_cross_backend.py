"""One recommender, trained with EmbeddingAdam on TensorFlow, JAX and torch, ends with the same weights.

docs/algorithms.md#embeddingadam: the touched-row rule is the same on every backend (a sparse
gradient's indices on TensorFlow, the non-zero rows of the dense gradients on JAX
and torch), so the same model from the same weights gives the same numbers. The
test runs tests/_cross_backend_recommender.py in a TensorFlow and a torch subprocess
(TensorFlow and torch must not share a process) and, while they run, in the JAX session
itself, where it runs once.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.processes  # it starts other processes

SCRIPT = pathlib.Path(__file__).with_name("_cross_backend_recommender.py")
BACKENDS = ("tensorflow", "jax", "torch")
SUBPROCESS_BACKENDS = ("tensorflow", "torch")  # JAX trains in this process (the JAX pass)
VOCABULARY, DIM, IDS_PER_EXAMPLE, EXAMPLES = 40, 6, 4, 64


CASES = {
    "defaults": {},
    "rowwise_per_row": {"second_moment": "rowwise", "bias_correction": "per_row"},
    # The lazy EMA, installed in the weights every 3 steps and at the end of fit.
    "ema_overwrite": {"use_ema": True, "ema_overwrite_frequency": 3},
    # Row accumulation (TF IndexedSlices, torch sparse) against Keras's dense form (JAX).
    "accumulation_ema": {"gradient_accumulation_steps": 2, "use_ema": True},
}


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="runs once per suite, from the JAX session: it trains on JAX here and starts a TensorFlow and a torch subprocess",
)
def test_same_recommender_same_weights_on_tensorflow_jax_and_torch(tmp_path):
    """Every case trains in one process per backend (the three side by side: JAX in this one)."""
    rng = np.random.default_rng(7)
    initial = {
        "embedding": rng.uniform(-0.1, 0.1, (VOCABULARY, DIM)).astype(np.float32),
        "kernel": rng.uniform(-0.5, 0.5, (DIM, 1)).astype(np.float32),
        "bias": np.zeros((1,), np.float32),
    }
    # Ids 30..39 are never looked up: those rows must come back untouched everywhere.
    ids = rng.integers(0, 30, (EXAMPLES, IDS_PER_EXAMPLE)).astype(np.int32)
    targets = rng.normal(0.0, 1.0, (EXAMPLES, 1)).astype(np.float32)
    input_path = tmp_path / "input.npz"
    np.savez(input_path, ids=ids, targets=targets, **initial)

    repo_root = SCRIPT.parent.parent
    processes = {}
    for backend in SUBPROCESS_BACKENDS:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
        # Output to a file: a pipe nobody reads while JAX trains here could fill up.
        with open(tmp_path / f"{backend}.log", "w") as log:
            processes[backend] = subprocess.Popen(
                [
                    sys.executable,
                    str(SCRIPT),
                    str(input_path),
                    str(tmp_path / backend),
                    json.dumps(CASES),
                ],
                env=env,
                cwd=repo_root,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        import _cross_backend_recommender

        _cross_backend_recommender.main(str(input_path), str(tmp_path / "jax"), json.dumps(CASES))
        for backend, process in processes.items():
            process.wait(timeout=400)
            output = (tmp_path / f"{backend}.log").read_text(errors="replace")
            assert process.returncode == 0, f"{backend} run failed:\n{output[-4000:]}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()

    for case, options in CASES.items():
        results = {
            backend: dict(np.load(tmp_path / f"{backend}_{case}.npz")) for backend in BACKENDS
        }
        for backend, result in results.items():
            where = f"{case}, {backend}"
            assert int(result["iterations"]) == 3 * EXAMPLES // 16 // options.get(
                "gradient_accumulation_steps", 1
            ), where
            # Training really moved the looked-up rows and the dense layer...
            assert (
                np.abs(result["embedding"][:30] - initial["embedding"][:30]).max(axis=1) > 1e-4
            ).all(), where
            assert not np.allclose(result["kernel"], initial["kernel"]), where
            # ...and left the never-looked-up rows bit for bit.
            np.testing.assert_array_equal(
                result["embedding"][30:], initial["embedding"][30:], err_msg=where
            )
        for backend in ("tensorflow", "torch"):
            for name in ("embedding", "kernel", "bias"):
                np.testing.assert_allclose(
                    results[backend][name],
                    results["jax"][name],
                    rtol=0,
                    atol=1e-5,
                    err_msg=f"{case}: {name}: {backend} vs jax",
                )
