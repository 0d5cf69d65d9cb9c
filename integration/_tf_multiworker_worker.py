"""One worker of a TensorFlow MultiWorkerMirroredStrategy job (see test_multiworker_tf.py).

    TF_CONFIG=... python _tf_multiworker_worker.py JOB.json WORKER_INDEX

JOB.json: {"num_workers", "runs", "out"}; with num_workers=1 there is no TF_CONFIG and
the default strategy is used (the single-worker reference). Runs:
  {"op": "train", "name", "optimizer", "save_at", "save"}  fit save_at steps, model.save, fit the rest
  {"op": "resume", "name", "load", "resume_at"}            load_model under the strategy, fit the rest
Writes OUT/<name>.npz (weights and optimizer state) and OUT/<name>.w<i>.json.
"""

import json
import os
import sys
import traceback

import numpy as np

job = json.load(open(sys.argv[1]))
worker = int(sys.argv[2])
num_workers = job["num_workers"]

import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

keras.config.disable_traceback_filtering()

import keras_tpu_optim as kto  # noqa: E402

if num_workers > 1:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.get_strategy()
print(
    f"worker {worker}/{num_workers}: {strategy.num_replicas_in_sync} replicas in sync", flush=True
)

BATCH = 16
TOTAL_STEPS = 5

OPTIMIZERS = {
    "embedding_adam": lambda: kto.EmbeddingAdam(0.01),
    "embedding_adam_ema": lambda: kto.EmbeddingAdam(0.01, use_ema=True),
    "adafactor_beta_1_ema": lambda: kto.Adafactor(learning_rate=0.01, beta_1=0.9, use_ema=True),
    # The table trained in its lookup by the layer's own EmbeddingAdam; Keras's Adam for the rest.
    "layer": lambda: keras.optimizers.Adam(0.01),
}


def data(steps=TOTAL_STEPS, batch=BATCH, rows=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, rows, size=(steps * batch, 4)).astype("int32")
    targets = rng.normal(size=(steps * batch, 1)).astype("float32")
    return ids, targets


def make_model(config, rows=64, dim=16):
    keras.utils.set_random_seed(0)
    if config == "layer":
        table = kto.layers.Embedding(rows, dim, optimizer=kto.EmbeddingAdam(0.01), name="embedding")
    else:
        table = keras.layers.Embedding(rows, dim, name="embedding")
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


def spy_on_gradients(optimizer, seen):
    """Record the type of each variable's gradient as the update step is traced."""
    update_step = optimizer.update_step

    def recording_update_step(gradient, variable, learning_rate):
        # The update step may see Keras's variable or the tf.Variable behind it.
        seen[getattr(variable, "path", None) or variable.name] = type(gradient).__name__
        return update_step(gradient, variable, learning_rate)

    optimizer.update_step = recording_update_step


def dump(name, model, extra=None):
    arrays = {f"w{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.weights)}
    arrays.update(
        {
            f"o{i}": keras.ops.convert_to_numpy(v.value)
            for i, v in enumerate(model.optimizer.variables)
        }
    )
    if worker == 0:
        np.savez(os.path.join(job["out"], f"{name}.npz"), **arrays)
    with open(os.path.join(job["out"], f"{name}.w{worker}.json"), "w") as f:
        json.dump(extra or {}, f)


def save_path(path):
    # Every worker must take part in saving; only the chief's file is kept.
    return (
        path
        if worker == 0
        else os.path.join(os.path.dirname(path), f"worker{worker}_{os.path.basename(path)}")
    )


def batches(ids, targets):
    """The global batches in order, each replica taking its contiguous part."""

    def per_pipeline(context):
        per_replica = context.get_per_replica_batch_size(BATCH)
        first = context.input_pipeline_id * per_replica
        dataset = tf.data.Dataset.from_tensor_slices((ids, targets)).batch(BATCH)
        return dataset.map(
            lambda x, y: (x[first : first + per_replica], y[first : first + per_replica])
        )

    return strategy.distribute_datasets_from_function(per_pipeline)


def train_function(model):
    """A custom training step run by the strategy: Keras's `fit` under
    MultiWorkerMirroredStrategy fails in Keras 3.15 before the first step
    (`_maybe_symbolic_build` reduces the (x, y) batch with `strategy.reduce`,
    which MultiWorkerMirroredStrategy cannot do on a tuple)."""
    per_example_loss = keras.losses.MeanSquaredError(reduction=None)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example_loss(y, model(x, training=True)), global_batch_size=BATCH
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.run(replica_step, args=batch)

    return step


def fit(model, ids, targets, step):
    for batch in batches(ids, targets):
        step(batch)


def run(spec):
    ids, targets = data()
    seen = {}
    if spec["op"] == "train":
        with strategy.scope():
            model = make_model(spec["optimizer"])
            model.compile(optimizer=OPTIMIZERS[spec["optimizer"]](), loss="mse")
        spy_on_gradients(model.optimizer, seen)
        step = train_function(model)  # traced once, for both parts
        split = spec["save_at"] * BATCH
        fit(model, ids[:split], targets[:split], step)
        if spec.get("save"):
            model.save(save_path(spec["save"]))
        fit(model, ids[split:], targets[split:], step)
        dump(spec["name"], model, {"gradients": seen})
    elif spec["op"] == "resume":
        with strategy.scope():
            model = keras.saving.load_model(spec["load"])
        spy_on_gradients(model.optimizer, seen)
        counter = model.optimizer.variables[0]
        assert counter.name == "iteration" and int(counter.numpy()) == spec["resume_at"], (
            counter.name,
            counter.numpy(),
        )
        split = spec["resume_at"] * BATCH
        fit(model, ids[split:], targets[split:], train_function(model))
        dump(spec["name"], model, {"gradients": seen})
    else:
        raise ValueError(spec["op"])


for spec in job["runs"]:
    print(f"run {spec['name']} ({spec['op']})", flush=True)
    try:
        run(spec)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait at a collective the other worker will never reach
print("done", flush=True)
sys.stdout.flush()
os._exit(0)
