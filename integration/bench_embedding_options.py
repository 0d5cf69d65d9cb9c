"""EmbeddingAdam's options at the cost of the rows touched: EMA, gradient accumulation, row-wise `v`.

Runs on one Keras backend (KERAS_BACKEND). A float32 table of 1M rows x 64 and
4096 ids a step (about a quarter duplicates), as `bench_embedding_adam.py`. For
each option it prints the median step time of `keras_tpu_optim.EmbeddingAdam`
and of `keras.optimizers.Adam` with the same option, the ratio of each of ours to
our plain step, and the optimizer state's bytes:

- plain: defaults (lazy Adam);
- `use_ema=True` (Keras's EMA; ours lazy, caught up where read);
- `gradient_accumulation_steps=4` (timed over whole windows of 4 steps);
- `second_moment="rowwise"` (ours only: one `v` per row);
- `bias_correction="per_row"` (ours only).

The gradient is what each backend's sparse path takes: `tf.IndexedSlices` on
TensorFlow (`tf.function(apply)`, `jit_compile=False`, fit's path on a CPU),
`jax.experimental.sparse.BCOO` on JAX (ours, under `jax.jit` with the state
donated; Keras's Adam takes the dense gradient), a sparse COO tensor on torch
(ours; Keras's Adam takes the dense gradient). On TensorFlow ours also runs
on a 10M-row table with EMA: the EMA's cost must not grow with the
table. Targets (issue 12): on TensorFlow and torch each option's step at most
1.5x our plain step; time(10M)/time(1M) at most 1.3 on TensorFlow with EMA on;
the row-wise state at most 0.52x the full one. Not a test: nothing is asserted.

Usage:
    KERAS_BACKEND=tensorflow python integration/bench_embedding_options.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)
import bench_embedding_adam as bea  # noqa: E402

OPTIONS = {
    "plain": {},
    "use_ema": {"use_ema": True},
    "accumulation=4": {"gradient_accumulation_steps": 4},
    "rowwise": {"second_moment": "rowwise"},
    "per_row": {"bias_correction": "per_row"},
}
KERAS_OPTIONS = ("plain", "use_ema", "accumulation=4")  # what keras.optimizers.Adam has


def optimizer_factory(cls_name, options):
    def make():
        import keras

        import keras_tpu_optim

        cls = keras_tpu_optim.EmbeddingAdam if cls_name == "ours" else keras.optimizers.Adam
        return cls(bea.LR, **OPTIONS[options])

    return make


def state_bytes(make_opt, rows, dim):
    """Bytes of an optimizer's state for a rows x dim table (its scalars left out)."""
    import keras

    variable = keras.Variable(np.zeros((rows, dim), np.float32), name="table")
    optimizer = make_opt()
    optimizer.build([variable])
    total = sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in optimizer.variables
        if len(v.shape)
    )
    del optimizer, variable
    gc.collect()
    return total


def make_run(backend, who, options, table, batches):
    import keras

    label = f"{'ours' if who == 'ours' else 'keras Adam'} {options}"
    make_opt = optimizer_factory(who, options)
    rows, dim = table.shape
    if backend == "tensorflow":
        return lambda: bea.KerasTFRun(label, make_opt, table, batches, jit_compile=False)
    if backend == "jax":
        if who == "ours":
            return lambda: bea.KerasJaxBCOORun(label, make_opt, table, batches)
        return lambda: bea.KerasJaxRun(
            label, make_opt, table, [bea.densify(rows, dim, i, v) for i, v in batches[:2]]
        )
    if who == "ours":
        return lambda: bea.KerasTorchRun(
            label, make_opt, table, bea.torch_sparse_grads(rows, dim, batches), "sparse COO"
        )
    dense = [keras.ops.convert_to_tensor(bea.densify(rows, dim, i, v)) for i, v in batches[:2]]
    return lambda: bea.KerasTorchRun(label, make_opt, table, dense, "dense")


def interleaved(backend, plan, table, batches, steps, max_seconds, with_state=True):
    """Time `plan`'s configurations on one table, taking turns a window of 4 steps at a time.

    Taking turns spreads a shared machine's drift over every configuration
    alike (timed one after the other, a busy minute lands on one of them).
    """
    rows, dim = table.shape
    runs, records = [], []
    for who, options in plan:
        record = {"who": who, "options": options, "rows": rows, "steps_ms": []}
        try:
            run = make_run(backend, who, options, table, batches)()
            for i in range(4):
                run.step(i)
                run.sync()
            if with_state and (who == "ours" or options == "plain"):
                record["state_bytes"] = state_bytes(optimizer_factory(who, options), rows, dim)
        except Exception as e:  # report, keep going with the other configurations
            record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[
                :300
            ]
            print(
                f"  {bea.size_label(rows)} rows: {who} {options}: ERROR {record['error']}",
                flush=True,
            )
            run = None
        runs.append(run)
        records.append(record)
    started = time.perf_counter()
    for window in range(max(1, steps // 4)):
        for run, record in zip(runs, records):
            if run is None:
                continue
            for i in range(4):
                t0 = time.perf_counter()
                run.step(4 + 4 * window + i)
                run.sync()
                record["steps_ms"].append((time.perf_counter() - t0) * 1e3)
        if window >= 2 and time.perf_counter() - started > max_seconds * len(plan):
            break
    for record in records:
        if "error" not in record:
            print(
                f"  {bea.size_label(rows)} rows: {record['who']} {record['options']}: "
                f"{np.mean(record['steps_ms']):.2f} ms (mean of {len(record['steps_ms'])})",
                flush=True,
            )
    del runs
    gc.collect()
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="table rows (default 1M; quick: 20k)")
    ap.add_argument(
        "--big", default=None, help="TensorFlow's larger table (default 10M; quick: 200k; 0: none)"
    )
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--ids", type=int, default=None)
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps per configuration (default 48)"
    )
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--no-peers", action="store_true", help="ours only")
    ap.add_argument("--quick", action="store_true", help="small tables, for smoke tests")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = bea.parse_size(args.rows or ("20k" if args.quick else "1M"))
    big = bea.parse_size(args.big or ("200k" if args.quick else "10M"))
    dim = args.dim or (16 if args.quick else 64)
    n_ids = args.ids or (256 if args.quick else 4096)
    steps = args.steps or (8 if args.quick else 48)  # whole windows of 4
    max_seconds = args.max_seconds or (5.0 if args.quick else 15.0)

    import keras

    backend = keras.backend.backend()
    machine = bc.machine_info()
    print(f"EmbeddingAdam options benchmark — backend {backend}, keras {keras.__version__}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores; load {machine['loadavg']}")
    print(f"table {bea.size_label(rows)} x {dim} float32, {n_ids} ids a step\n", flush=True)

    records = []
    if backend == "tensorflow" and big:
        # First, while the process holds nothing else: a 10M-row table with EMA state is ~15 GB.
        # (No state_bytes here: it builds a second optimizer.)
        table = np.random.default_rng(1).standard_normal((big, dim), dtype=np.float32)
        batches = bea.make_id_batches(big, n_ids, 4, dim)
        records += interleaved(
            backend, [("ours", "use_ema")], table, batches, steps, max_seconds, with_state=False
        )
        del table, batches
        gc.collect()
    table = np.random.default_rng(1).standard_normal((rows, dim), dtype=np.float32)
    batches = bea.make_id_batches(rows, n_ids, 4, dim)
    plan = [("ours", o) for o in OPTIONS] + (
        [] if args.no_peers else [("keras", o) for o in KERAS_OPTIONS]
    )
    records += interleaved(backend, plan, table, batches, steps, max_seconds)
    del table
    gc.collect()
    report(backend, rows, big, records, args, machine)


def report(backend, rows, big, records, args, machine):
    def get(who, options, size=rows):
        return next(
            (
                r
                for r in records
                if r["who"] == who
                and r["options"] == options
                and r["rows"] == size
                and "error" not in r
            ),
            None,
        )

    def ms(rec):
        # Mean over whole accumulation windows: the update step and the micro-steps each count once.
        return float(np.mean(rec["steps_ms"])) if rec else None

    plain = get("ours", "plain")
    full_state = plain["state_bytes"] if plain else None
    table_rows = []
    for options in OPTIONS:
        ours, peer = get("ours", options), get("keras", options)
        table_rows.append(
            [
                options,
                bc.fmt(ms(ours), ".2f"),
                bc.fmt(ms(peer), ".2f") if options in KERAS_OPTIONS else "n/a",
                bc.fmt(ms(ours) / ms(plain), ".2f") if ours and plain else "-",
                bc.fmt(ms(ours) / ms(peer), ".3f") if ours and peer else "-",
                bc.fmt(ours["state_bytes"] / 2**20, ".0f") if ours else "-",
                bc.fmt(ours["state_bytes"] / full_state, ".3f") if ours and full_state else "-",
            ]
        )
    print()
    bc.print_table(
        f"EmbeddingAdam options on {backend}, {bea.size_label(rows)} rows: step time, ms (mean of whole windows)",
        [
            "option",
            "ours",
            "keras Adam",
            "ours / ours plain",
            "ours / keras",
            "state MB",
            "state / plain",
        ],
        table_rows,
    )
    targets = []
    if backend in ("tensorflow", "torch"):
        for options in OPTIONS:
            if options == "plain":
                continue
            ours = get("ours", options)
            targets.append(
                bc.target(
                    f"{backend} ours {options} / ours plain @{bea.size_label(rows)}",
                    ms(ours) / ms(plain) if ours and plain else None,
                    1.5,
                )
            )
    if backend == "tensorflow" and big:
        a, b = get("ours", "use_ema", big), get("ours", "use_ema")
        growth = ms(a) / ms(b) if a and b else None
        targets.append(
            bc.target(
                f"tensorflow ours use_ema time({bea.size_label(big)})/time({bea.size_label(rows)})",
                growth,
                1.3,
            )
        )
    rowwise = get("ours", "rowwise")
    targets.append(
        bc.target(
            "rowwise state / full state",
            rowwise["state_bytes"] / full_state if rowwise and full_state else None,
            0.52,
        )
    )
    bc.print_targets(targets)
    errors = [r for r in records if "error" in r]
    for r in errors:
        print(f"ERROR {r['who']} {r['options']} @ {bea.size_label(r['rows'])}: {r['error']}")
    bc.write_json(
        args.json,
        {
            "bench": "embedding_options",
            "backend": backend,
            "quick": args.quick,
            "machine": machine,
            "records": records,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
