"""A Criteo-shaped recommender trained by `fit` steps: many tables in one layer against the peers.

The model (DLRM-shaped, the interaction a concatenation): 26 categorical
features, one id each (one input each; the one table takes them stacked), in tables of Criteo's 26 cardinalities capped at 1M
rows (5.57M rows in all; `--quick`: capped at 1,000), 16 wide; 13 dense
features through a Dense(64)-Dense(16) bottom; the 27 vectors concatenated
into a Dense(64)-Dense(1) top, sigmoid cross-entropy; batch 2,048; Zipf
distributed ids; labels drawn from a logistic model of the ids and dense
features (a learnable signal). The dense layers are trained by Keras's Adam
(the model's optimizer) in every configuration. Each configuration runs in its
own process (`KERAS_BACKEND` from the environment):

- `distributed`: `kto.layers.DistributedEmbedding` of the 26 tables, trained by
  `kto.EmbeddingAdam(sum_inside_sqrt=False)` (Adam's numbers) in the lookup;
- `layers26`: 26 `kto.layers.Embedding`, each with that optimizer;
- `frozen`: `distributed` with its tables not trained (`trainable=False`): the
  step's floor without any table update (Keras's handling of 27 inputs, the
  lookups and the MLP), against which every table update is measured;
- `one_table`: one `kto.layers.Embedding` of all 5.57M rows, the 26 ids offset
  into it (the same model with one table: the floor for a fused update);
- `keras_rs`: `keras_rs.layers.DistributedEmbedding` off TPU (one
  `keras.layers.Embedding` per table), its tables trained by the model's Adam;
- `keras`: 26 `keras.layers.Embedding` trained by the model's Adam.

Per configuration: the median `train_on_batch` step (ms) after a warm-up (ours:
the process of median time among `--rounds` alternated ones, each process's
median kept: processes of one configuration vary by up to 30% here); the
mean loss of the first and last steps; on torch the aten ops one step
dispatches (each a kernel launch on a GPU; `TorchDispatchMode`); on JAX the
instructions of the compiled train step's entry computation other than
parameters, constants, tuples and bitcasts (each a kernel or a copy on a GPU).

Usage: KERAS_BACKEND=jax python integration/bench_criteo.py [--quick] [--steps N] [--rounds N] [--json PATH] [--in-process]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_common as bc

CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
DIM, DENSE_FEATURES, BATCH = 16, 13, 2048
CONFIGS = ("distributed", "frozen", "layers26", "one_table", "keras_rs", "keras")
# Ours, run in alternated rounds (`--rounds`); the peers, an order of magnitude slower, once.
ROUNDS_CONFIGS = ("distributed", "frozen", "layers26", "one_table")
LEARNING_RATE = 0.01


def cardinalities(quick: bool) -> list:
    cap = 1000 if quick else 1_000_000
    return [min(c, cap) for c in CRITEO_CARDINALITIES]


def make_data(sizes, batches, seed=0):
    """`batches` of (ids (batch, 26) int32, dense (batch, 13), labels (batch, 1)): Zipf ids, logistic labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    id_weights = [rng.normal(size=min(n, 10_000)) for n in sizes]
    dense_weights = rng.normal(size=DENSE_FEATURES)
    data = []
    for _ in range(batches):
        ids = np.stack([np.minimum(rng.zipf(1.2, BATCH), n) - 1 for n in sizes], axis=1)
        dense = rng.normal(size=(BATCH, DENSE_FEATURES)).astype("float32")
        logit = sum(w[np.minimum(ids[:, i], len(w) - 1)] for i, w in enumerate(id_weights))
        logit = 0.3 * logit + dense @ dense_weights
        labels = (rng.uniform(size=BATCH) < 1 / (1 + np.exp(-logit))).astype("float32")[:, None]
        data.append((ids.astype("int32"), dense, labels))
    return data


def build_model(config: str, sizes):
    import keras
    from keras import ops

    import keras_tpu_optim as kto

    def table_optimizer():
        return kto.EmbeddingAdam(LEARNING_RATE, sum_inside_sqrt=False)

    dense = keras.Input((DENSE_FEATURES,), name="dense_features")
    # One input per feature (as a recommender's data has them), but for the one table, which takes them stacked.
    if config == "one_table":
        ids = keras.Input((len(sizes),), dtype="int32", name="ids")
    else:
        ids = {
            f"f{i:02d}": keras.Input((), dtype="int32", name=f"f{i:02d}") for i in range(len(sizes))
        }
        columns = [ids[f"f{i:02d}"] for i in range(len(sizes))]
    if config == "one_table":
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        table = kto.layers.Embedding(sum(sizes), DIM, optimizer=table_optimizer(), name="table")
        shifted = ids + ops.convert_to_tensor(offsets, "int32")
        vectors = [ops.reshape(table(shifted), (-1, len(sizes) * DIM))]
    elif config in ("distributed", "frozen", "keras_rs"):
        if config == "keras_rs":
            import keras_rs

            layers = keras_rs.layers
        else:
            layers = kto.layers
        features = {}
        for i, n in enumerate(sizes):
            table = layers.TableConfig(
                f"t{i:02d}", n, DIM, optimizer="adam" if config == "keras_rs" else None
            )
            features[f"f{i:02d}"] = layers.FeatureConfig(
                f"f{i:02d}", table, input_shape=(BATCH,), output_shape=(BATCH, DIM)
            )
        if config != "keras_rs":
            layer = kto.layers.DistributedEmbedding(features, optimizer=table_optimizer())
            layer.trainable = config == "distributed"
        else:
            layer = keras_rs.layers.DistributedEmbedding(features)
        outputs = layer({f"f{i:02d}": c for i, c in enumerate(columns)})
        vectors = [outputs[f"f{i:02d}"] for i in range(len(sizes))]
    else:
        vectors = [
            (
                kto.layers.Embedding(n, DIM, optimizer=table_optimizer(), name=f"t{i:02d}")
                if config == "layers26"
                else keras.layers.Embedding(n, DIM, name=f"t{i:02d}")
            )(c)
            for i, (n, c) in enumerate(zip(sizes, columns))
        ]
    bottom = keras.layers.Dense(DIM, activation="relu")(
        keras.layers.Dense(64, activation="relu")(dense)
    )
    joined = ops.concatenate(vectors + [bottom], axis=-1)
    top = keras.layers.Dense(1)(keras.layers.Dense(64, activation="relu")(joined))
    model = keras.Model([ids, dense], top)
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


def model_inputs(config: str, ids, dense):
    """The model's inputs for a batch of `make_data`: the ids stacked for the one table, else one per feature."""
    if config == "one_table":
        return [ids, dense]
    return [{f"f{i:02d}": ids[:, i].copy() for i in range(ids.shape[1])}, dense]


def torch_ops_of_a_step(model, x, y) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    with counter:
        model.train_on_batch(x, y)
    return counter.count


def jax_kernels_of_the_step(model, x, y) -> int:
    """Instructions of the compiled train step's entry computation, less parameters, constants, tuples, bitcasts."""
    import jax

    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    data = (x, y, None)
    text = jax.jit(model.train_step).lower(state, data).compile().as_text()
    entry = text[text.index("\nENTRY ") :]
    body = entry[entry.index("{") + 1 : entry.index("\n}")]
    skipped = ("parameter(", "constant(", "tuple(", "get-tuple-element(", "bitcast(")
    return sum(
        1
        for line in body.splitlines()
        if "=" in line and not any(f" {op}" in line.split("=", 1)[1][:80] for op in skipped)
    )


def worker(config: str, quick: bool, steps: int, warmup: int) -> dict:
    import keras

    sizes = cardinalities(quick)
    model = build_model(config, sizes)
    batches = make_data(sizes, 8)
    position = [0]
    losses = []

    batches = [(model_inputs(config, ids, dense), labels) for ids, dense, labels in batches]

    def step():
        x, labels = batches[position[0] % len(batches)]
        position[0] += 1
        losses.append(float(model.train_on_batch(x, labels)))

    timing = bc.time_steps(step, steps, warmup)
    x, labels = batches[0]
    record = {
        "config": config,
        "rows": sum(sizes),
        "median_ms": timing["median_ms"],
        "steps_ms": timing["steps_ms"],
        "first_loss": sum(losses[:3]) / 3,
        "last_loss": sum(losses[-3:]) / 3,
    }
    backend = keras.backend.backend()
    if backend == "torch":
        record["torch_ops"] = torch_ops_of_a_step(model, x, labels)
    elif backend == "jax":
        record["jax_kernels"] = jax_kernels_of_the_step(model, x, labels)
    return record


def run_worker(config: str, args) -> dict | None:
    if args.in_process:
        return worker(config, args.quick, args.steps, args.warmup)
    command = [sys.executable, os.path.abspath(__file__), "--worker", config]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--quick"] if args.quick else []
    return bc.json_of_worker(command, config, timeout=3600)


def report(backend: str, records: list) -> dict:
    by = {r["config"]: r for r in records}
    count = "torch_ops" if backend == "torch" else "jax_kernels" if backend == "jax" else None
    header = ["config", "rows", "step ms", "loss first 3", "loss last 3"]
    header += [count.replace("_", " ")] if count else []
    bc.print_table(
        f"Criteo-shaped fit steps ({backend})",
        header,
        [
            [
                r["config"],
                r["rows"],
                bc.fmt(r["median_ms"], ".2f"),
                bc.fmt(r["first_loss"], ".4f"),
                bc.fmt(r["last_loss"], ".4f"),
            ]
            + ([r.get(count)] if count else [])
            for r in records
        ],
    )

    def ratio(a, b, key="median_ms"):
        a, b = by.get(a), by.get(b)
        return None if a is None or b is None or a.get(key) is None else a[key] / b[key]

    targets = [
        bc.target(
            "distributed / keras-rs with the model's Adam", ratio("distributed", "keras_rs"), 0.05
        ),
        bc.target("distributed / 26 kto.layers.Embedding", ratio("distributed", "layers26"), 1.0),
    ]
    if "frozen" in by:
        # Not a goal: the part of the first target that no table update can remove.
        floor = ratio("frozen", "keras_rs")
        targets[0]["note"] = "" if floor is None else f"no table trained: {floor:.3g}"
    if count:
        targets += [
            bc.target(
                f"distributed / one table, {count}", ratio("distributed", "one_table", count), 1.5
            ),
            bc.target(
                f"distributed / Keras's dense model, {count}",
                ratio("distributed", "keras", count),
                1.0,
            ),
        ]
    bc.print_targets(targets)
    return {"records": records, "targets": targets}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tables capped at 1,000 rows (a smoke run)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="processes per configuration of ours")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--in-process", action="store_true", help="every configuration in this process")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.quick, args.steps, args.warmup)))
        return 0
    if args.quick or args.in_process:
        args.rounds = 1
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), 1
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    configs = args.configs.split(",")
    ours = [c for c in configs if c in ROUNDS_CONFIGS]
    runs = {}
    for config in bc.alternated(ours, args.rounds) + [c for c in configs if c not in ours]:
        record = run_worker(config, args)
        if record is not None:
            runs.setdefault(config, []).append(record)
            print(f"{config}: {record['median_ms']:.2f} ms", flush=True)
    records = [bc.median_round(runs[c]) for c in configs if c in runs]
    payload = {
        "bench": "criteo",
        "backend": backend,
        "quick": args.quick,
        "machine": bc.machine_info(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        **report(backend, records),
    }
    bc.write_json(args.json, payload)
    return 0 if len(records) == len(configs) else 1


if __name__ == "__main__":
    sys.exit(main())
