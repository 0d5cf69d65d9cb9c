"""The memory wall: the largest table a device can train, from JAX's own accounting of a `fit` step.

A recommender (ids of shape (1024, 4), a 64-wide table, mean-pooled, a Dense head, the model compiled
with Keras's Adam), in four configurations:

- `keras_adam`: `keras.layers.Embedding` trained by Keras's Adam (the model's optimizer);
- `layer_fp32`: `kto.layers.Embedding(optimizer=kto.EmbeddingAdam(...))`, float32;
- `layer_bf16_nearest`: the same with `dtype="bfloat16"` (float32 slots, round to nearest);
- `layer_half`: `dtype="bfloat16"`, bfloat16 `momenta`, `second_moment="rowwise"`, stochastic rounding.

Memory: Keras's JAX train step (`model.train_step`, jitted with the state donated, as Keras's
trainer runs it) is compiled at two vocabulary sizes, on one device and split by rows over 8
devices (`ModelParallel`, a `LayoutMap` naming only the table); per device, the state's bytes (the
step's arguments) plus the compiled step's temporaries (`memory_analysis()`). Both grow linearly
with the rows: the slope is the bytes a row costs a device (XLA's CPU backend evaluates a
bfloat16 scatter in float32, so there a bfloat16 table's step holds float32 copies of it), and the largest vocabulary that fits
a device of 16 GiB and of 80 GiB follows. Quality: each configuration trains 400 steps at 65,536
rows on Zipf ids (exponent 1.1) to match a fixed random teacher of the same shape; the loss on
held-out batches at the end.

Usage: python integration/bench_memory_wall.py [--quick] [--json PATH]   (JAX; sets 8 CPU devices)
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import bench_common as bc  # noqa: E402

DIM, BATCH, IDS_PER_EXAMPLE, ZIPF = 64, 1024, 4, 1.1
CONFIGS = ("keras_adam", "layer_fp32", "layer_bf16_nearest", "layer_half")
BUDGETS_GIB = (16, 80)


def build(config: str, rows: int, seed: int = 0):
    import keras

    import keras_tpu_optim as kto

    keras.utils.set_random_seed(seed)
    ids = keras.Input((IDS_PER_EXAMPLE,), dtype="int32")
    initializer = keras.initializers.RandomNormal(stddev=0.05, seed=seed)
    if config == "keras_adam":
        table = keras.layers.Embedding(rows, DIM, embeddings_initializer=initializer, name="table")
    else:
        half = dict(momentum_dtype="bfloat16", second_moment="rowwise", stochastic_rounding=True)
        table = kto.layers.Embedding(
            rows,
            DIM,
            optimizer=kto.EmbeddingAdam(0.01, **(half if config == "layer_half" else {})),
            dtype="float32" if config == "layer_fp32" else "bfloat16",
            embeddings_initializer=initializer,
            name="table",
        )
    pooled = keras.ops.mean(keras.ops.cast(table(ids), "float32"), axis=1)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def step_bytes(config: str, rows: int, devices: int) -> dict:
    """Per device: the state's bytes and the compiled step's temporaries."""
    import jax
    import keras
    import numpy as np

    if devices > 1:
        mesh = keras.distribution.DeviceMesh(
            (1, devices), ("batch", "model"), keras.distribution.list_devices()[:devices]
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*table/embeddings"] = ("model", None)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
    try:
        model = build(config, rows)
        x = np.zeros((BATCH, IDS_PER_EXAMPLE), "int32")
        y = np.zeros((BATCH, 1), "float32")
        model.train_on_batch(x, y)  # builds the optimizer's state
        state = tuple(
            tuple(v.value for v in group)
            for group in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.optimizer.variables,
                model.metrics_variables,
            )
        )
        compiled = (
            jax.jit(model.train_step, donate_argnums=0)
            .lower(state, (jax.numpy.asarray(x), jax.numpy.asarray(y), None))
            .compile()
        )
        analysis = compiled.memory_analysis()
        leaves = jax.tree_util.tree_leaves(state)
        first = (
            leaves[0].sharding.device_set
            and sorted(leaves[0].sharding.device_set, key=lambda d: d.id)[0]
        )
        state_bytes = sum(
            s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == first
        )
        return {"state": state_bytes, "temporaries": analysis.temp_size_in_bytes}
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()


def final_loss(config: str, rows: int, steps: int) -> float:
    import keras
    import numpy as np

    rng = np.random.default_rng(1)
    teacher_table = rng.normal(size=(rows, DIM)).astype("float32")
    teacher_head = rng.normal(size=(DIM, 1)).astype("float32") / 8

    def batch(n):
        ids = ((rng.zipf(ZIPF, (n, IDS_PER_EXAMPLE)) - 1) % rows).astype("int32")
        return ids, teacher_table[ids].mean(axis=1) @ teacher_head

    model = build(config, rows)
    x, y = batch(steps * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    x, y = batch(8 * BATCH)
    loss = float(model.evaluate(x, y, batch_size=BATCH, verbose=0))
    keras.backend.clear_session()
    return loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small tables, 20 training steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = (4096, 8192) if args.quick else (1 << 17, 1 << 18)
    train_rows, steps = (4096, 20) if args.quick else (1 << 16, 400)
    records = []
    for config in CONFIGS:
        record = {"config": config}
        for devices in (1, 8):
            small, large = (step_bytes(config, rows, devices) for rows in sizes)
            total = lambda m: m["state"] + m["temporaries"]
            per_row = (total(large) - total(small)) / (sizes[1] - sizes[0])
            fixed = total(small) - per_row * sizes[0]
            record[f"bytes_per_row_{devices}"] = per_row
            record[f"state_per_row_{devices}"] = (large["state"] - small["state"]) / (
                sizes[1] - sizes[0]
            )
            record[f"temporaries_{devices}"] = large["temporaries"]
            for budget in BUDGETS_GIB:
                record[f"max_rows_{devices}_{budget}gib"] = (budget * 2**30 - fixed) / per_row
        record["final_loss"] = final_loss(config, train_rows, steps)
        records.append(record)
    base = next(r for r in records if r["config"] == "layer_fp32")
    rows = [
        [
            r["config"],
            bc.fmt(r["state_per_row_1"], ".1f"),
            bc.fmt(r["bytes_per_row_1"], ".1f"),
            bc.fmt(r["bytes_per_row_8"], ".1f"),
            *(f"{r[f'max_rows_{d}_{b}gib'] / 1e6:.0f}M" for d in (1, 8) for b in BUDGETS_GIB),
            bc.fmt(r["final_loss"], ".4f"),
            bc.fmt(r["final_loss"] / base["final_loss"], ".3f"),
        ]
        for r in records
    ]
    header = ["config", "state bytes/row", "bytes/row, 1 device", "bytes/row/device, 8"]
    header += [
        f"max rows, {d} device{'s' if d > 1 else ''}, {b} GiB each"
        for d in (1, 8)
        for b in BUDGETS_GIB
    ]
    header += ["final loss", "/ layer_fp32"]
    bc.print_table("The memory wall (JAX, dim 64)", header, rows)
    half = next(r for r in records if r["config"] == "layer_half")
    targets = [
        bc.target(
            "layer_half / layer_fp32 state bytes a row",
            half["state_per_row_1"] / base["state_per_row_1"],
            0.4,
        ),
        bc.target(
            "layer_fp32 / keras_adam bytes a row a device, 8 devices",
            base["bytes_per_row_8"]
            / next(r for r in records if r["config"] == "keras_adam")["bytes_per_row_8"],
            0.8,
        ),
        bc.target(
            "layer_half / layer_fp32 final loss", half["final_loss"] / base["final_loss"], 1.01
        ),
    ]
    bc.print_targets(targets)
    bc.write_json(
        args.json,
        {
            "bench": "memory_wall",
            "backend": "jax",
            "quick": args.quick,
            "machine": bc.machine_info(),
            "sizes": list(sizes),
            "train_rows": train_rows,
            "steps": steps,
            "records": records,
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
