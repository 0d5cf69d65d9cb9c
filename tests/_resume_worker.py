"""Subprocess side of the resume tests: runs on whatever KERAS_BACKEND it is given.

    python tests/_resume_worker.py job.json

job.json holds {"tasks": [...]}, each task one of
- {"op": "resume", "model": "m.keras", "data": "d.npz", "batch_size": b, "out": "w.npz"}:
  load the model (default safe_mode=True) in this fresh process, fit one epoch
  over the data in order, write its weights and optimizer state.
- {"op": "train_save", "kind": k, "optimizer": spec, "data": "d.npz", "steps": n,
   "batch_size": b, "save": "m.keras", "out": "ref.npz"}:
  build and compile a model, fit n steps, save it, fit the remaining data
  (the uninterrupted reference) and write the weights.
A task may name `"after": "path.keras"`, a file another process saves: it waits
(at most `WAIT_SECONDS`) until that process has finished saving it. Every saved
file is marked finished with `path.keras.done`.
"""

import json
import os
import sys
import time

import numpy as np

import keras  # noqa: E402

import keras_tpu_optim  # noqa: E402,F401  (registers the optimizers)
from _kto_models import (
    compile_model,
    fit_steps,
    make_model,
    make_optimizer,
    optimizer_state,
    weights_of,
)  # noqa: E402


def save_result(path, model):
    arrays = {f"w{i}": w for i, w in enumerate(weights_of(model))}
    arrays.update({f"o{i}": o for i, o in enumerate(optimizer_state(model.optimizer))})
    np.savez(path, **arrays)


WAIT_SECONDS = 400


def wait_for(path):
    """Wait until the process saving `path` marked it finished."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not os.path.exists(path + ".done"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not saved within {WAIT_SECONDS} s")
        time.sleep(0.2)


def run(task):
    if task.get("after"):
        wait_for(task["after"])
    data = np.load(task["data"])
    x, y = data["x"], data["y"]
    batch_size = task["batch_size"]
    if task["op"] == "resume":
        model = keras.saving.load_model(task["model"])
        fit_steps(model, x, y, batch_size)
        save_result(task["out"], model)
    elif task["op"] == "train_save":
        model = compile_model(
            make_model(task["kind"]), task["kind"], make_optimizer(task["optimizer"])
        )
        split = task["steps"] * batch_size
        fit_steps(model, x[:split], y[:split], batch_size)
        model.save(task["save"])
        open(task["save"] + ".done", "w").close()
        fit_steps(model, x[split:], y[split:], batch_size)
        save_result(task["out"], model)
    else:
        raise ValueError(f"unknown op {task['op']!r}")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    for task in job["tasks"]:
        run(task)
    print("done", keras.backend.backend())
