"""`model.fit` steps of a recommender: tables trained in the lookup (`kto.layers.Embedding`) against the peers.

The model: ids of shape (1024, 4), a 64-wide table, the looked-up rows
mean-pooled, a Dense head; the model compiled with Keras's Adam. Each
configuration runs in its own process (`KERAS_BACKEND` from the environment):

- `layer`: `kto.layers.Embedding(rows, 64, optimizer=kto.EmbeddingAdam(...))`,
  the table trained in the lookup's backward pass (at 1M and 10M rows);
- `layer_not_lazy`: the same with `lazy_adam=False` (ordinary Adam, skipped steps caught up in
  closed form when a row is read; at 1M and 10M rows);
- `layer_half`: `layer` with a bfloat16 table, bfloat16 `momenta`, `second_moment="rowwise"` and
  stochastic rounding (a third of its bytes a row; at 1M and 10M rows);
- `keras_adam`: `keras.layers.Embedding` trained by Keras's Adam (the model's
  optimizer);
- `dense_path`: `keras.layers.Embedding` trained by `kto.EmbeddingAdam` as the
  model's optimizer (on JAX and torch `fit` hands it a dense, table-sized
  gradient).

The table layers' processes run `--rounds` times (default 3), the configurations alternating
and their order reversed each round: processes of one configuration vary by up to 30% on a
small machine, so a step's time is the median over its rounds (each round's own median kept).

Per configuration: the median `train_on_batch` step (ms) after a warm-up; the
peak RSS of the process over all the steps (the first, which compiles and
builds the model's optimizer, included), beyond what they keep (the model
optimizer's variables), as a multiple of the table's bytes; and the peak over
building the model, beyond the bytes of its weights (Keras's initializers: a
random table is generated through table-sized temporaries, for
`keras.layers.Embedding` alike). Each peak is reset through
`/proc/self/clear_refs` before it is measured.

Usage: KERAS_BACKEND=jax python integration/bench_recommender.py [--quick] [--steps N] [--rounds N]
       [--json PATH] [--in-process]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_common as bc

DIM, BATCH, IDS_PER_EXAMPLE = 64, 1024, 4
CONFIGS = ("layer", "layer_not_lazy", "layer_half", "keras_adam", "dense_path")
TABLE_CONFIGS = ("layer", "layer_not_lazy", "layer_half")
# `layer_half`: a bfloat16 table, bfloat16 momenta, row-wise v, stochastic rounding.
HALF_WIDTH = dict(
    momentum_dtype="bfloat16", second_moment="rowwise", stochastic_rounding=True, seed=0
)


def sizes_of(config: str, quick: bool) -> list:
    if quick:
        return [1000, 10_000] if config in TABLE_CONFIGS else [1000]
    return [1_000_000, 10_000_000] if config in TABLE_CONFIGS else [1_000_000]


def worker(config: str, rows: int, steps: int, warmup: int) -> dict:
    """One configuration in this process: build, warm up, time `steps` steps, report the peak."""
    import keras
    import numpy as np

    import keras_tpu_optim as kto

    def bytes_of(variables):
        return sum(
            int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in variables
        )

    bc._reset_hwm()
    before_model = bc.rss_bytes()
    ids = keras.Input((IDS_PER_EXAMPLE,), dtype="int32")
    if config in TABLE_CONFIGS:
        half = config == "layer_half"
        optimizer = kto.EmbeddingAdam(
            0.01, lazy_adam=config != "layer_not_lazy", **(HALF_WIDTH if half else {})
        )
        table = kto.layers.Embedding(
            rows, DIM, optimizer=optimizer, name="table", dtype="bfloat16" if half else None
        )
    else:
        table = keras.layers.Embedding(rows, DIM, name="table")
    output = keras.layers.Dense(1)(keras.ops.mean(table(ids), axis=1))
    model = keras.Model(ids, output)
    optimizer = kto.EmbeddingAdam(0.01) if config == "dense_path" else keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss="mse")
    for variable in model.weights:  # JAX initialises asynchronously: wait for every value
        keras.ops.convert_to_numpy(keras.ops.sum(keras.ops.cast(variable, "float32")))
    creation_peak = (bc._hwm_bytes() or bc.rss_bytes()) - before_model - bytes_of(model.weights)
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.integers(0, rows, (BATCH, IDS_PER_EXAMPLE)).astype("int32"),
            rng.normal(size=(BATCH, 1)).astype("float32"),
        )
        for _ in range(8)
    ]
    position = [0]

    def step():
        x, y = batches[position[0] % len(batches)]
        position[0] += 1
        model.train_on_batch(x, y)

    bc._reset_hwm()
    before_steps = bc.rss_bytes()
    timing = bc.time_steps(step, steps, warmup)
    # Beyond what the steps keep: the model optimizer's state, created at the first step.
    steps_peak = (
        (bc._hwm_bytes() or bc.rss_bytes()) - before_steps - bytes_of(model.optimizer.variables)
    )
    table_bytes = rows * DIM * 4
    return {
        "config": config,
        "rows": rows,
        "median_ms": timing["median_ms"],
        "steps_ms": timing["steps_ms"],
        "table_mb": table_bytes / 2**20,
        "state_mb": bytes_of(list(model.weights) + list(model.optimizer.variables)) / 2**20,
        "creation_peak_beyond_state_mb": creation_peak / 2**20,
        "peak_beyond_state_mb": steps_peak / 2**20,
        "peak_beyond_state_x_table": steps_peak / table_bytes,
    }


def run_worker(config: str, rows: int, args) -> dict | None:
    if args.in_process:
        return worker(config, rows, args.steps, args.warmup)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        config,
        "--rows",
        str(rows),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    return bc.json_of_worker(command, f"{config} at {rows} rows", timeout=1800)


def report(backend: str, records: list) -> dict:
    by = {(r["config"], r["rows"]): r for r in records}
    rows = [
        [
            r["config"],
            r["rows"],
            bc.fmt(r["median_ms"], ".2f"),
            bc.fmt(r["peak_beyond_state_mb"], ".0f"),
            bc.fmt(r["peak_beyond_state_x_table"], ".3f"),
            bc.fmt(r["creation_peak_beyond_state_mb"], ".0f"),
        ]
        for r in records
    ]
    bc.print_table(
        f"Recommender fit steps ({backend})",
        ["config", "rows", "step ms", "steps' peak MB", "x table", "creation peak MB"],
        rows,
    )
    small, large = (
        sorted({r["rows"] for r in records if r["config"] == "layer"})[:2]
        if records
        else (None, None)
    )
    layer_small, layer_large = by.get(("layer", small)), by.get(("layer", large))
    exact_small, exact_large = by.get(("layer_not_lazy", small)), by.get(("layer_not_lazy", large))
    half_small = by.get(("layer_half", small))
    adam_small = by.get(("keras_adam", small))
    ratio = lambda a, b: None if a is None or b is None else a["median_ms"] / b["median_ms"]
    targets = [
        bc.target("layer time(10M) / time(1M)", ratio(layer_large, layer_small), 1.3),
        bc.target("layer / Keras's Adam at 1M", ratio(layer_small, adam_small), 0.05),
        bc.target("not lazy / lazy layer at 1M", ratio(exact_small, layer_small), 1.25),
        bc.target("not lazy layer time(10M) / time(1M)", ratio(exact_large, exact_small), 2.0),
        bc.target("half-width / float32 layer at 1M", ratio(half_small, layer_small), 1.3),
        bc.target(
            "layer steps' peak beyond the state / table bytes at 10M",
            None if layer_large is None else layer_large["peak_beyond_state_x_table"],
            0.1,
        ),
    ]
    bc.print_targets(targets)
    return {"records": records, "targets": targets}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny tables (a smoke run)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=3, help="processes per table layer configuration (alternated)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="every configuration in this process, one after another (a smoke run: peaks not comparable)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.steps, args.warmup)))
        return 0
    if args.quick:
        args.steps, args.warmup, args.rounds = min(args.steps, 3), 1, min(args.rounds, 2)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    runs = {}  # (config, rows): the records of its rounds
    tables = [(c, rows) for c in TABLE_CONFIGS for rows in sizes_of(c, args.quick)]
    others = [
        (c, rows) for c in CONFIGS if c not in TABLE_CONFIGS for rows in sizes_of(c, args.quick)
    ]
    for config, rows in bc.alternated(tables, args.rounds) + others:
        record = run_worker(config, rows, args)
        if record is not None:
            runs.setdefault((config, rows), []).append(record)
            print(
                f"{config} {rows}: {record['median_ms']:.2f} ms, steps' peak beyond the state "
                f"{record['peak_beyond_state_mb']:.0f} MB",
                flush=True,
            )
    records = []
    for key in [(c, rows) for c in CONFIGS for rows in sizes_of(c, args.quick)]:
        if key in runs:
            records.append(bc.median_round(runs[key]))
    payload = {
        "bench": "recommender",
        "backend": backend,
        "quick": args.quick,
        "machine": bc.machine_info(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        **report(backend, records),
    }
    bc.write_json(args.json, payload)
    return 0 if len(records) == sum(len(sizes_of(c, args.quick)) for c in CONFIGS) else 1


if __name__ == "__main__":
    sys.exit(main())
