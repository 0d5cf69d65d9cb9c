"""JAX across processes: two processes x 4 CPU devices (gloo collectives, coordinator on a
127.0.0.1 port picked at run time), a (2, 4) ("model", "batch") mesh whose "model" axis spans
the two processes, an embedding table's rows and a kernel's columns split on "model".

One test, four jobs in two rounds of two side by side (each process runs every optimizer
configuration in turn, so the start-up and the distributed handshake are paid once per job):
  1. two processes: fit 5 steps, `keras.callbacks.OrbaxCheckpoint` saving after step 3
     (mid-accumulation for the accumulating configurations): the uninterrupted run;
  2. one process x 8 devices, same mesh: the reference fit, no checkpoint;
  3. two processes rebuild the model, restore with `keras_tpu_optim.load_checkpoint` and fit the
     last 2 steps (Adafactor also with a schedule in place of its float learning rate); then
     load_weights into a differently configured optimizer must raise;
  4. one process x 8 devices resumes the two-process checkpoint (the schedule too).
Every wait is bounded, every child is ended on failure and each one's log is shown.
"""

import json
import os
import time

import keras
import numpy as np
import pytest

from _procs import ProcessGroup, child_env, free_ports, run_arrays

BACKEND = keras.backend.backend()
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_jax_multiprocess_worker.py")
# EmbeddingAdam's plain step runs inside its EMA and accumulation configuration's updates.
CONFIGS = [
    "embedding_adam_ema_accumulation",
    "adafactor",
    "adafactor_beta_1_ema_accumulation",
    # `kto.layers.Embedding` trained in its lookup, the LayoutMap naming only its table.
    "layer",
]
SAVE_AT, TOTAL = 3, 5
JOB_TIMEOUT = 400

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        BACKEND != "jax",
        reason=f"JAX multi-process training runs in the JAX pass; this pass is {BACKEND}",
    ),
]


def _xla_flags(devices):
    """The test run's XLA flags (dev/test.sh: its faster-compiling CPU code) with `devices` host devices."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *kept])


def _jobs(tmp_path, name, jobs):
    """Run `jobs` (`(job name, num_processes, runs)`, independent of each other) side by side; wait for all."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    started = time.monotonic()
    with ProcessGroup(tmp_path / "logs", name) as group:
        for job, num_processes, runs in jobs:
            (port,) = free_ports(1)
            spec = tmp_path / f"{job}.json"
            spec.write_text(
                json.dumps(
                    {"port": port, "num_processes": num_processes, "runs": runs, "out": str(out)}
                )
            )
            env = child_env(KERAS_BACKEND="jax", XLA_FLAGS=_xla_flags(8 // num_processes))
            for process_id in range(num_processes):
                group.start(f"{job}_p{process_id}", [WORKER, str(spec), str(process_id)], env)
        group.wait(JOB_TIMEOUT)
    print(f"{name}: {time.monotonic() - started:.1f} s")
    return out


def _held(out, name, process_id):
    return json.loads((out / f"{name}.p{process_id}.json").read_text())


def test_two_processes_fit_checkpoint_and_resume(tmp_path):
    checkpoint = {c: str(tmp_path / f"ckpt_{c}") for c in CONFIGS}
    train = [
        {
            "op": "train",
            "name": f"{c}_2x4",
            "optimizer": c,
            "save_at": SAVE_AT,
            "checkpoint": checkpoint[c],
        }
        for c in CONFIGS
    ]
    reference = [{"op": "train", "name": f"{c}_1x8", "optimizer": c} for c in CONFIGS]
    out = _jobs(tmp_path, "train", [("train", 2, train), ("reference", 1, reference)])
    resume_runs = [
        {
            "op": "resume",
            "name": f"{c}_resumed",
            "optimizer": c,
            "checkpoint": checkpoint[c],
            "resume_at": SAVE_AT,
        }
        for c in CONFIGS
    ]
    # A checkpoint from a differently configured optimizer (no beta_1, EMA or
    # accumulation) must raise on load, naming the difference, and change nothing.
    resume_runs.append(
        {
            "op": "expect_error",
            "name": "wrong_optimizer",
            "checkpoint": checkpoint["adafactor_beta_1_ema_accumulation"],
            "optimizer": "adafactor",
        }
    )
    # The same checkpoint resumed with a schedule of the same value in place of the float
    # learning rate: the saved learning_rate has no variable here and is skipped.
    schedule_runs = {
        job: {
            "op": "resume",
            "name": f"adafactor_schedule_resumed_{job}",
            "optimizer": "adafactor_constant_schedule",
            "checkpoint": checkpoint["adafactor"],
            "resume_at": SAVE_AT,
        }
        for job in ("2x4", "1x8")
    }
    resume_runs.append(schedule_runs["2x4"])
    resume_runs.append(
        {"op": "save_keras", "name": "save_keras", "optimizer": "embedding_adam_ema_accumulation"}
    )
    resume_1x8 = [
        {
            "op": "resume",
            "name": f"{c}_resumed_1x8",
            "optimizer": c,
            "checkpoint": checkpoint[c],
            "resume_at": SAVE_AT,
        }
        for c in CONFIGS
    ]
    resume_1x8.append(schedule_runs["1x8"])
    _jobs(tmp_path, "resume", [("resume", 2, resume_runs), ("resume_1x8", 1, resume_1x8)])

    for c in CONFIGS:
        weights, state = run_arrays(out, f"{c}_2x4")
        # Two processes equal one process with the same mesh.
        ref_weights, ref_state = run_arrays(out, f"{c}_1x8")
        for got, want in zip(weights, ref_weights):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-7, err_msg=c)
        # Resuming from the checkpoint, on two processes or on one, ends where the
        # uninterrupted run ends: weights and every optimizer variable.
        for resumed in (f"{c}_resumed", f"{c}_resumed_1x8"):
            got_weights, got_state = run_arrays(out, resumed)
            assert len(got_state) == len(state), resumed
            for got, want in zip(got_weights + got_state, weights + state):
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-7, err_msg=resumed)

        if c == "layer":
            # Each process holds half the table and the state that trains it.
            for process_id in range(2):
                share = _held(out, f"{c}_2x4", process_id)["table_share"]
                assert share <= 0.55, (process_id, share)
            continue
        # Each process holds half of the table's and the kernel's optimizer state.
        for process_id in range(2):
            held = _held(out, f"{c}_2x4", process_id)["held"]
            split = {
                p: h
                for p, h in held.items()
                if "_embedding_embeddings" in p or "_dense_kernel" in p
            }
            assert len(split) >= 4, held
            for path, (local, total, spec) in split.items():
                if "_embedding_embeddings_column" in path or "_dense_kernel_row" in path:
                    continue  # Adafactor's statistics along the axis that is not split
                if (
                    "_dense_kernel_average_steps" in path
                    or "_dense_kernel_accumulation_window" in path
                ):
                    continue  # EmbeddingAdam's per-row int32 counters (EMA, accumulation): the kernel's rows are not split
                assert local * 2 == total, (c, path, local, total, spec)

    weights, state = run_arrays(out, "adafactor_2x4")
    paths = _held(out, "adafactor_2x4", 0)["paths"]
    kept = [
        i for i, path in enumerate(paths) if path != "adafactor/learning_rate"
    ]  # a schedule has no variable
    paths, state = [paths[i] for i in kept], [state[i] for i in kept]
    for run in schedule_runs.values():
        got_weights, got_state = run_arrays(out, run["name"])
        assert _held(out, run["name"], 0)["paths"] == paths
        for got, want in zip(got_weights + got_state, weights + state, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-7, err_msg=run["name"])

    # model.save cannot write state no process holds whole; our part says what to use.
    for process_id in range(2):
        errors = _held(out, "save_keras", process_id)
        print(f"process {process_id}: model.save -> {errors['model.save']}")
        assert errors["model.save"], errors
        assert (
            "OrbaxCheckpoint" in errors["optimizer"] and "load_checkpoint" in errors["optimizer"]
        ), errors

    wrong = [_held(out, "wrong_optimizer", p) for p in range(2)]
    for result in wrong:
        assert result["error"] and "beta_1" in result["error"], result
        assert result["unchanged"], result
