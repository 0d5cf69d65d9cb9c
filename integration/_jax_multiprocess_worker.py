"""One process of a JAX multi-process job (see test_multiprocess_jax.py).

    python _jax_multiprocess_worker.py JOB.json PROCESS_ID

JOB.json: {"port", "num_processes", "runs": [...], "out"}. With num_processes=2 each
process has 4 CPU devices and the (2, 4) mesh's "model" axis spans the two processes;
with 1 the same mesh is laid over 8 local devices. Each run is one of
  {"op": "train", "name", "steps", "save_at"?, "checkpoint"?}   fit from scratch (OrbaxCheckpoint at save_at)
  {"op": "resume", "name", "optimizer", "checkpoint", "resume_at"}  kto.load_checkpoint, fit the rest
  {"op": "expect_error", "name", "checkpoint", "optimizer"}    the same into another optimizer: must raise
  {"op": "save_keras", "name", "optimizer"}                    what model.save and our save_own_variables say
and writes OUT/<name>.npz (weights and optimizer state, process 0) and
OUT/<name>.p<id>.json (how much of the optimizer state this process holds).
"""

import json
import os
import sys
import traceback

import numpy as np

job = json.load(open(sys.argv[1]))
process_id = int(sys.argv[2])
num_processes = job["num_processes"]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import keras  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_tpu_optim as kto  # noqa: E402

if num_processes > 1:
    keras.distribution.initialize(f"127.0.0.1:{job['port']}", num_processes, process_id)
print(
    f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of {jax.device_count()} devices",
    flush=True,
)

BATCH = 16
TOTAL_STEPS = job.get("total_steps", 5)

OPTIMIZERS = {
    "embedding_adam_ema_accumulation": lambda: kto.EmbeddingAdam(
        0.01, max_touched_rows=8, use_ema=True, gradient_accumulation_steps=2
    ),
    "adafactor": lambda: kto.Adafactor(learning_rate=0.01),
    "adafactor_beta_1_ema_accumulation": lambda: kto.Adafactor(
        learning_rate=0.01, beta_1=0.9, use_ema=True, gradient_accumulation_steps=2
    ),
    # "adafactor" (and named so: checkpoints hold optimizer variables by path) with a schedule
    # of the same value, to resume a checkpoint with a float learning rate it has no variable for.
    # The table trained in its lookup by the layer's own EmbeddingAdam; Keras's Adam for the rest.
    "layer": lambda: keras.optimizers.Adam(0.01),
    "adafactor_constant_schedule": lambda: kto.Adafactor(
        learning_rate=keras.optimizers.schedules.PiecewiseConstantDecay([1000], [0.01, 0.01]),
        name="adafactor",
    ),
}


def data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, size=(TOTAL_STEPS * BATCH, 4)).astype("int32")
    targets = rng.normal(size=(TOTAL_STEPS * BATCH, 1)).astype("float32")
    return ids, targets


def make_model(config=None):
    keras.utils.set_random_seed(0)
    if config == "layer":
        table = kto.layers.Embedding(64, 16, optimizer=kto.EmbeddingAdam(0.01), name="embedding")
    else:
        table = keras.layers.Embedding(64, 16, name="embedding")
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            table,
            keras.layers.Flatten(),
            keras.layers.Dense(32, name="dense"),
            keras.layers.Dense(1, name="dense_out"),
        ],
        name="model",
    )


def distribution():
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ["model", "batch"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embedding/embeddings"] = ("model", None)
    layout_map[".*dense/kernel"] = (None, "model")
    result = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    # The batch is split over "batch", which lies inside each process: every
    # process feeds the whole global batch, so Keras must not shard it again.
    result.auto_shard_dataset = False
    return result


def fetch(value):
    if value.is_fully_addressable:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def dump(name, model):
    optimizer = model.optimizer
    arrays = {f"w{i}": fetch(v.value) for i, v in enumerate(model.trainable_variables)}
    arrays.update({f"o{i}": fetch(v.value) for i, v in enumerate(optimizer.variables)})
    if process_id == 0:
        np.savez(os.path.join(job["out"], f"{name}.npz"), **arrays)
    held = {}
    for v in optimizer.variables:
        value = v.value
        shards = {str(s.index): s.data.size for s in value.addressable_shards}
        held[v.path] = [int(sum(shards.values())), int(value.size), str(value.sharding.spec)]
    layer = model.get_layer("embedding")
    table_state = layer.table_state().values() if hasattr(layer, "table_state") else []
    # The distinct parts each process holds (its devices' copies of one part counted once).
    local = sum(
        sum({str(s.index): s.data.nbytes for s in v.value.addressable_shards}.values())
        for v in table_state
    )
    share = local / max(1, sum(v.value.nbytes for v in table_state))
    with open(os.path.join(job["out"], f"{name}.p{process_id}.json"), "w") as f:
        json.dump(
            {"paths": [v.path for v in optimizer.variables], "held": held, "table_share": share}, f
        )


def run(spec):
    ids, targets = data()
    if spec["op"] == "train":
        model = make_model(spec["optimizer"])
        model.compile(optimizer=OPTIMIZERS[spec["optimizer"]](), loss="mse")
        callbacks = []
        if spec.get("save_at"):
            callbacks.append(
                keras.callbacks.OrbaxCheckpoint(
                    spec["checkpoint"], save_freq=spec["save_at"], save_on_background=False
                )
            )
        model.fit(
            ids, targets, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
        )
        dump(spec["name"], model)
    elif spec["op"] == "resume":
        # The model and optimizer as they were built for training, under the current
        # distribution, then the checkpoint read onto their layout.
        model = make_model(spec["optimizer"])
        model.compile(optimizer=OPTIMIZERS[spec["optimizer"]](), loss="mse")
        kto.load_checkpoint(model, spec["checkpoint"])
        counter = model.optimizer.variables[0]  # the micro-step counter (also with accumulation)
        assert counter.name == "iteration", counter.name
        done = int(fetch(counter.value))
        assert done == spec["resume_at"], (done, spec["resume_at"])
        start = done * BATCH
        model.fit(
            ids[start:], targets[start:], batch_size=BATCH, epochs=1, verbose=0, shuffle=False
        )
        dump(spec["name"], model)
    elif spec["op"] == "expect_error":
        model = make_model(spec["optimizer"])
        model.compile(optimizer=OPTIMIZERS[spec["optimizer"]](), loss="mse")
        model.optimizer.build(model.trainable_variables)
        before = [fetch(v.value) for v in model.variables + model.optimizer.variables]
        try:
            kto.load_checkpoint(model, spec["checkpoint"])
        except ValueError as error:
            message = str(error)
        else:
            message = None
        after = [fetch(v.value) for v in model.variables + model.optimizer.variables]
        unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
        with open(os.path.join(job["out"], f"{spec['name']}.p{process_id}.json"), "w") as f:
            json.dump({"error": message, "unchanged": unchanged}, f)
    elif spec["op"] == "save_keras":
        # model.save needs every value on one process; what each part says.
        model = make_model(spec["optimizer"])
        model.compile(optimizer=OPTIMIZERS[spec["optimizer"]](), loss="mse")
        model.fit(
            ids[:BATCH], targets[:BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False
        )
        errors = {}
        path = os.path.join(job["out"], f"p{process_id}_m.keras")
        for what, call in [
            ("model.save", lambda: model.save(path)),
            ("optimizer", lambda: model.optimizer.save_own_variables({})),
        ]:
            try:
                call()
                errors[what] = None
            except Exception as error:
                errors[what] = f"{type(error).__name__}: {error}"
        with open(os.path.join(job["out"], f"{spec['name']}.p{process_id}.json"), "w") as f:
            json.dump(errors, f)
    else:
        raise ValueError(spec["op"])


keras.distribution.set_distribution(distribution())
for spec in job["runs"]:
    print(f"run {spec['name']} ({spec['op']})", flush=True)
    try:
        run(spec)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait at a collective the other process will never reach
print("done", flush=True)
if num_processes > 1:
    jax.distributed.shutdown()
sys.stdout.flush()
os._exit(0)
