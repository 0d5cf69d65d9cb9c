"""End to end, on every backend: train, save, reload in a new process, continue.

For both optimizers (with EMA, gradient accumulation saved mid-accumulation and
a learning-rate schedule), the resumed run equals the uninterrupted one bit for
bit; and a file saved on one backend resumes on the other two. The worker and
the tiny models live in tests/ (`_resume_worker.py`, `_kto_models.py`).
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
from _kto_models import (
    compile_model,
    fit_steps,
    make_data,
    make_model,
    make_optimizer,
    optimizer_state,
    weights_of,
)  # noqa: E402

pytestmark = pytest.mark.processes  # it starts other processes

BACKEND = keras.backend.backend()
WORKER = os.path.join(TESTS, "_resume_worker.py")


def _run_worker(backend, tasks, tmp_path, name):
    """A worker process on `backend`; its output goes to a log file (a pipe nobody reads could fill up)."""
    job = tmp_path / f"{name}.json"
    job.write_text(json.dumps({"tasks": tasks}))
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    log = open(tmp_path / f"{name}.log", "w")
    process = subprocess.Popen(
        [sys.executable, WORKER, str(job)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    process.log = tmp_path / f"{name}.log"
    return process


def _output(process):
    return process.log.read_text(errors="replace")[-4000:]


def _saved_by(process, path, timeout=400):
    """Wait until `process` has saved `path`; fail at once, with its output, if it exited without."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path + ".done"):
        if process.poll() is not None and not os.path.exists(path + ".done"):
            raise AssertionError(
                f"exited {process.returncode} before saving {path}:\n{_output(process)}"
            )
        assert time.monotonic() < deadline, f"{path} was not saved within {timeout} s"
        time.sleep(0.2)


def _wait(process, timeout=240):
    process.wait(timeout=timeout)
    assert process.returncode == 0, _output(process)


def _load_result(path):
    data = np.load(path)
    weights = [data[f"w{i}"] for i in range(sum(k.startswith("w") for k in data.files))]
    state = [data[f"o{i}"] for i in range(sum(k.startswith("o") for k in data.files))]
    return weights, state


RESUME_SCENARIOS = {
    # name: (model kind, optimizer spec, steps before the save); 3 steps with
    # accumulation over 2 means the save holds one accumulated micro-step.
    "adafactor_schedule_momentum_accumulation_mid": (
        "mlp",
        {
            "class": "Adafactor",
            "kwargs": {"beta_1": 0.9, "gradient_accumulation_steps": 2},
            "schedule": 0.1,
        },
        3,
    ),
    "adafactor_ema": (
        "mlp",
        {
            "class": "Adafactor",
            "kwargs": {"learning_rate": 0.1, "use_ema": True, "ema_overwrite_frequency": 2},
        },
        3,
    ),
    "embedding_adam_schedule_ema_accumulation_mid": (
        "recommender",
        {
            "class": "EmbeddingAdam",
            "kwargs": {
                "use_ema": True,
                "ema_overwrite_frequency": 2,
                "gradient_accumulation_steps": 2,
            },
            "schedule": 0.05,
        },
        3,
    ),
}


def test_exact_resume_in_a_fresh_process(tmp_path):
    """Train N steps, save, load in a new process, train M more == N+M uninterrupted, bit for bit."""
    batch_size, more_steps = 16, 3
    tasks, references = [], {}
    for name, (kind, spec, steps) in RESUME_SCENARIOS.items():
        x, y = make_data(kind, (steps + more_steps) * batch_size, seed=3)
        split = steps * batch_size
        np.savez(tmp_path / f"{name}_rest.npz", x=x[split:], y=y[split:])
        model = compile_model(make_model(kind), kind, make_optimizer(spec))
        fit_steps(model, x[:split], y[:split], batch_size)
        model.save(str(tmp_path / f"{name}.keras"))
        fit_steps(model, x[split:], y[split:], batch_size)
        references[name] = (weights_of(model), optimizer_state(model.optimizer))
        if not spec.get("kwargs", {}).get("use_ema"):
            # Two fit calls are one run (EMA aside: fit ends by installing the averages).
            single = compile_model(make_model(kind), kind, make_optimizer(spec))
            fit_steps(single, x, y, batch_size)
            for a, b in zip(weights_of(single), references[name][0]):
                np.testing.assert_array_equal(a, b)
        tasks.append(
            {
                "op": "resume",
                "model": str(tmp_path / f"{name}.keras"),
                "data": str(tmp_path / f"{name}_rest.npz"),
                "batch_size": batch_size,
                "out": str(tmp_path / f"{name}_resumed.npz"),
            }
        )
    _wait(_run_worker(BACKEND, tasks, tmp_path, "resume"))
    for name, (want_weights, want_state) in references.items():
        got_weights, got_state = _load_result(tmp_path / f"{name}_resumed.npz")
        assert len(got_weights) == len(want_weights) and len(got_state) == len(want_state), name
        for got, want in zip(got_weights + got_state, want_weights + want_state):
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.skipif(
    BACKEND != "jax", reason="drives all three backends (subprocesses); runs once, under JAX"
)
def test_file_saved_on_one_backend_resumes_on_the_others(tmp_path):
    """Each backend saves files that another resumes, and resumes another's, in a cycle: JAX (here)
    saves first; a TensorFlow process resumes JAX's files and saves its own; a torch process, started
    beside it, saves its own and resumes TensorFlow's once they are saved; JAX resumes torch's. Each
    resumed run is compared with the saving backend's own uninterrupted run."""
    scenarios = {
        "adafactor": (
            "mlp",
            {"class": "Adafactor", "kwargs": {"learning_rate": 0.1, "beta_1": 0.5}},
        ),
        # A schedule, and the per-table slots besides the table-shaped ones: rowwise velocities
        # (rows,), int32 row_steps and average_steps, the lazy EMA's averages.
        "embedding_adam_schedule_rowwise_per_row_ema": (
            "recommender",
            {
                "class": "EmbeddingAdam",
                "schedule": 0.05,
                "kwargs": {
                    "second_moment": "rowwise",
                    "bias_correction": "per_row",
                    "use_ema": True,
                },
            },
        ),
    }
    steps, more_steps, batch_size = 2, 2, 16

    def saved(name, backend):
        return str(tmp_path / f"{name}_{backend}.keras")

    def train_save(name, backend):
        kind, spec = scenarios[name]
        return {
            "op": "train_save",
            "kind": kind,
            "optimizer": spec,
            "data": str(tmp_path / f"{name}.npz"),
            "steps": steps,
            "batch_size": batch_size,
            "save": saved(name, backend),
            "out": str(tmp_path / f"{name}_{backend}_reference.npz"),
        }

    def resume(name, source, target):
        return {
            "op": "resume",
            "model": saved(name, source),
            "after": saved(name, source),
            "data": str(tmp_path / f"{name}_rest.npz"),
            "batch_size": batch_size,
            "out": str(tmp_path / f"{name}_{source}_on_{target}.npz"),
        }

    for name, (kind, _) in scenarios.items():
        x, y = make_data(kind, (steps + more_steps) * batch_size, seed=5)
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        np.savez(
            tmp_path / f"{name}_rest.npz", x=x[steps * batch_size :], y=y[steps * batch_size :]
        )

    import _resume_worker

    for name in scenarios:
        _resume_worker.run(train_save(name, "jax"))
    cycle = {"jax": "tensorflow", "tensorflow": "torch", "torch": "jax"}  # saver: resumer
    tasks = {
        "tensorflow": [resume(n, "jax", "tensorflow") for n in scenarios]
        + [train_save(n, "tensorflow") for n in scenarios],
        "torch": [train_save(n, "torch") for n in scenarios]
        + [resume(n, "tensorflow", "torch") for n in scenarios],
    }
    workers = {b: _run_worker(b, t, tmp_path, b) for b, t in tasks.items()}
    try:
        for name in scenarios:
            _saved_by(workers["torch"], saved(name, "torch"))
            keras.backend.clear_session()
            _resume_worker.run(resume(name, "torch", "jax"))
        for process in workers.values():
            _wait(process, timeout=600)
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.kill()

    for name in scenarios:
        for source, target in cycle.items():
            want_weights, want_state = _load_result(tmp_path / f"{name}_{source}_reference.npz")
            got_weights, got_state = _load_result(tmp_path / f"{name}_{source}_on_{target}.npz")
            assert len(got_state) == len(want_state)
            for got, want in zip(got_weights + got_state, want_weights + want_state):
                np.testing.assert_allclose(
                    got, want, rtol=1e-4, atol=1e-6, err_msg=f"{name} {source}->{target}"
                )
