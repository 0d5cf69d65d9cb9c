"""TensorFlow across processes: two workers under MultiWorkerMirroredStrategy (TF_CONFIG on
127.0.0.1 ports picked at run time, one CPU replica each) against one worker.

Jobs: the single-worker reference; two workers training 3 steps, saving with `model.save`
(with EMA state for two of them), training 2 more; two workers
restarting from the saved file under the strategy and training the last 2 steps.
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
WORKER = os.path.join(HERE, "_tf_multiworker_worker.py")
# No gradient accumulation: Keras 3.15 applies accumulated gradients inside an
# `ops.cond`, where a tf.distribute strategy cannot synchronise ("merge_call called
# while defining a new graph"), whatever the optimizer.
# `layer`: `kto.layers.Embedding` trained in its lookup (every replica's rows reach one update).
CONFIGS = ["embedding_adam", "embedding_adam_ema", "adafactor_beta_1_ema", "layer"]
SAVE_AT = 3
JOB_TIMEOUT = 240

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        BACKEND != "tensorflow",
        reason=f"MultiWorkerMirroredStrategy runs in the TensorFlow pass; this pass is {BACKEND}",
    ),
]


def _job(tmp_path, name, num_workers, runs):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"num_workers": num_workers, "runs": runs, "out": str(out)}))
    ports = free_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    started = time.monotonic()
    with ProcessGroup(tmp_path / "logs", name) as group:
        for index in range(num_workers):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            env = child_env(
                KERAS_BACKEND="tensorflow",
                TF_CONFIG=tf_config if num_workers > 1 else None,
                CUDA_VISIBLE_DEVICES="",
                TF_NUM_INTEROP_THREADS="1",
                TF_NUM_INTRAOP_THREADS="1",
            )
            group.start(f"w{index}", [WORKER, str(spec), str(index)], env)
        group.wait(JOB_TIMEOUT)
    print(f"{name}: {time.monotonic() - started:.1f} s")
    return out


def _table_gradient(gradients):
    (kind,) = [kind for variable, kind in gradients.items() if "embedding" in variable]
    return kind


def _json(out, name, worker):
    return json.loads((out / f"{name}.w{worker}.json").read_text())


def test_two_workers_match_one_and_resume(tmp_path):
    saved = {c: str(tmp_path / f"{c}.keras") for c in CONFIGS}
    out = _job(
        tmp_path,
        "single",
        1,
        [
            {"op": "train", "name": f"{c}_single", "optimizer": c, "save_at": SAVE_AT}
            for c in CONFIGS
        ],
    )
    _job(
        tmp_path,
        "train",
        2,
        [
            {
                "op": "train",
                "name": f"{c}_mwms",
                "optimizer": c,
                "save_at": SAVE_AT,
                "save": saved[c],
            }
            for c in CONFIGS
        ],
    )
    _job(
        tmp_path,
        "resume",
        2,
        [
            {"op": "resume", "name": f"{c}_resumed", "load": saved[c], "resume_at": SAVE_AT}
            for c in CONFIGS
        ],
    )

    for c in CONFIGS:
        weights, state = run_arrays(out, f"{c}_mwms")
        single_weights, _ = run_arrays(out, f"{c}_single")
        for got, want in zip(weights, single_weights):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=c)
        resumed_weights, resumed_state = run_arrays(out, f"{c}_resumed")
        assert len(resumed_state) == len(state), c
        for got, want in zip(resumed_weights + resumed_state, weights + state):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=c)
        if c == "layer":  # the table is not the model optimizer's: only its step count is
            continue
        for worker in range(2):
            for run in (f"{c}_mwms", f"{c}_resumed"):
                gradients = _json(out, run, worker)["gradients"]
                assert _table_gradient(gradients) == "IndexedSlices", (run, gradients)
