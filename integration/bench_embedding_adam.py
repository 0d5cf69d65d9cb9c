"""EmbeddingAdam benchmark: cost follows the rows touched, not the table.

Runs on one Keras backend (KERAS_BACKEND). A float32 table of `--sizes` rows
(default 100k, 1M, 10M) x 64, and a gradient on 4096 ids a step, about a
quarter of them duplicates. Per size it prints the median step time of
`keras_tpu_optim.EmbeddingAdam` (default arguments: lazy) and of its peers on
the same gradient, the peak memory of the step, the ratios, and the targets of
issue 3 with PASS/MISS. Not a test: nothing is asserted.

What runs where, as each framework's trainer runs it:
- TensorFlow: the gradient is a `tf.IndexedSlices`; ours and
  `keras.optimizers.Adam` run as `tf.function(optimizer.apply)` with
  `jit_compile=False` and with `jit_compile=True` (both reported).
  `torch.optim.SparseAdam` on the same ids and values is measured in a
  subprocess that imports torch only (TensorFlow and torch never share a
  process).
- JAX: the gradient is dense (what `jax.grad` of an embedding lookup gives);
  ours and `keras.optimizers.Adam` run as `jax.jit(optimizer.stateless_apply,
  donate_argnums=(0, 2))`, optimizer and trainable variables donated and
  returned in input order (as Keras's JAX trainer), so they update in place.
  Ours also runs on a `jax.experimental.sparse.BCOO` gradient
  (`BCOO((values [ids, dim], ids[:, None]), shape=(rows, dim))`, duplicates
  kept) under the same jit, against Adam on the dense gradient; skipped (and
  said so) where the installed keras_tpu_optim cannot apply a BCOO gradient.
- torch: dense gradient (what Keras's torch backend produces), ours and
  `keras.optimizers.Adam` eagerly (`optimizer.apply` under `torch.no_grad()`);
  and a sparse COO gradient (uncoalesced, duplicates kept), ours against
  `torch.optim.SparseAdam`.

Peak memory: the resident set (RSS) of the process during the timed steps,
above the RSS after the warm-up steps: what a step adds to the model and the
optimizer state. (Taken before warm-up it counted compilation, and the first
touch of zero-initialised slots: on JAX ~1.3 GB at 1M rows, for buffers that
were already allocated and are updated in place.) On CPU every backend's
buffers live in the process, so this is comparable across backends.

Usage:
    KERAS_BACKEND=tensorflow python integration/bench_embedding_adam.py [--sizes 100k,1M,10M] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault(
    "TF_CPP_MIN_LOG_LEVEL", "2"
)  # keep TensorFlow's start-up chatter out of the tables
import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)

OURS = "keras_tpu_optim.EmbeddingAdam"
ADAM = "keras.optimizers.Adam"
SPARSE_ADAM = "torch.optim.SparseAdam"
LR = 1e-3


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 10**3, "m": 10**6}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * mult)


def size_label(n: int) -> str:
    if n >= 10**6 and n % 10**6 == 0:
        return f"{n // 10**6}M"
    if n >= 10**3 and n % 10**3 == 0:
        return f"{n // 10**3}k"
    return str(n)


def make_id_batches(rows, n_ids, n_batches, dim, seed=0):
    """`n_batches` of (ids, values): ~1/4 of the ids repeat others of the same batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        base = rng.integers(0, rows, n_ids - n_ids // 4)
        dup = rng.choice(base, n_ids // 4)
        ids = rng.permutation(np.concatenate([base, dup])).astype(np.int64)
        vals = rng.standard_normal((n_ids, dim), dtype=np.float32)
        out.append((ids, vals))
    return out


def densify(rows, dim, ids, vals):
    dense = np.zeros((rows, dim), np.float32)
    np.add.at(dense, ids, vals)
    return dense


def available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryWatchdog:
    """Stops this process cleanly before it exhausts the machine's memory.

    A shared machine must not meet the kernel's OOM killer (it may pick someone
    else's process). A thread samples RSS every few ms; past the budget it calls
    `on_exceed()` (which records the configuration as an error and writes the
    report so far) and exits with status 3.
    """

    def __init__(self, budget_bytes, on_exceed):
        import threading

        self.budget = budget_bytes
        self.on_exceed = on_exceed
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            rss = bc.rss_bytes()
            if rss > self.budget:
                try:
                    self.on_exceed(rss)
                finally:
                    os._exit(3)
            time.sleep(0.003)


# ------------------------------------------------------------------- runners


class Run:
    """One optimizer on one table: `step(i)` applies gradient batch i."""

    name = ""
    grad_kind = ""

    def sync(self):
        pass


# `--huge-pages`: ours' tables and row slots advised for huge pages after build (JAX, cpu_tuning.py).
ADVISE_HUGE_PAGES = False


class KerasJaxRun(Run):
    grad_kind = "dense"

    def __init__(self, name, make_opt, table_np, dense_grads):
        import jax
        import jax.numpy as jnp
        import keras

        self.name = name
        var = keras.Variable(table_np, name="table")
        opt = make_opt()
        opt.build([var])
        if ADVISE_HUGE_PAGES:
            import cpu_tuning
            import keras_tpu_optim

            if isinstance(opt, keras_tpu_optim.EmbeddingAdam):
                cpu_tuning.advise_huge_pages([var], collapse=True)
                cpu_tuning.advise_huge_pages(
                    [v for v in opt.variables if v.shape and v.shape[0] == var.shape[0]]
                )
        self.opt_vals = [v.value for v in opt.variables]
        self.train_vals = [var.value]
        self.grads = [jnp.asarray(g) for g in dense_grads]
        self.fn = bc.jit_stateless_apply(opt)
        self._jax = jax

    def step(self, i):
        g = self.grads[i % len(self.grads)]
        self.opt_vals, self.train_vals = self.fn(self.opt_vals, [g], self.train_vals)

    def sync(self):
        self._jax.block_until_ready((self.train_vals, self.opt_vals))


class KerasJaxBCOORun(KerasJaxRun):
    """Ours under the same jit as KerasJaxRun, on a BCOO gradient naming the step's ids (duplicates kept)."""

    grad_kind = "BCOO"

    def __init__(self, name, make_opt, table_np, batches):
        import jax.numpy as jnp
        from jax.experimental import sparse as jax_sparse

        rows, dim = table_np.shape
        bcoo = [
            jax_sparse.BCOO((jnp.asarray(v), jnp.asarray(i, jnp.int32)[:, None]), shape=(rows, dim))
            for i, v in batches
        ]
        super().__init__(name, make_opt, table_np, [])
        self.grads = bcoo


def bcoo_supported(make_opt):
    """None if this keras_tpu_optim applies a BCOO gradient under jax.jit, else why not (older versions cannot)."""
    try:
        import jax.numpy as jnp
        from jax.experimental import sparse as jax_sparse

        table = np.zeros((8, 2), np.float32)
        run = KerasJaxRun("probe", make_opt, table, [])
        g = jax_sparse.BCOO(
            (jnp.ones((2, 2), jnp.float32), jnp.asarray([[1], [1]], jnp.int32)), shape=(8, 2)
        )
        run.grads = [g]
        run.step(0)
        run.sync()
        return None
    except Exception as e:  # noqa: BLE001  (any failure means: not supported by this version)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


class KerasTFRun(Run):
    grad_kind = "IndexedSlices"

    def __init__(self, name, make_opt, table_np, batches, jit_compile):
        import keras
        import tensorflow as tf

        self.name = name
        rows, dim = table_np.shape
        self.var = keras.Variable(table_np, name="table")
        self.opt = make_opt()
        self.opt.build([self.var])
        shape = tf.constant([rows, dim], tf.int64)
        self.grads = [tf.IndexedSlices(tf.constant(v), tf.constant(i), shape) for i, v in batches]
        opt, var = self.opt, self.var
        self.fn = tf.function(lambda g: opt.apply([g], [var]), jit_compile=jit_compile)

    def step(self, i):
        self.fn(self.grads[i % len(self.grads)])


class KerasTorchRun(Run):
    def __init__(self, name, make_opt, table_np, grads, grad_kind):
        import keras

        self.name = name
        self.grad_kind = grad_kind
        self.var = keras.Variable(table_np, name="table")
        self.opt = make_opt()
        self.opt.build([self.var])
        self.grads = grads

    def step(self, i):
        import torch

        with torch.no_grad():
            self.opt.apply([self.grads[i % len(self.grads)]], [self.var])


class SparseAdamRun(Run):
    grad_kind = "sparse COO"

    def __init__(self, table_np, sparse_grads):
        import torch

        self.name = SPARSE_ADAM
        self.param = torch.nn.Parameter(torch.from_numpy(table_np.copy()))
        self.opt = torch.optim.SparseAdam([self.param], lr=LR)
        self.grads = sparse_grads

    def step(self, i):
        self.param.grad = self.grads[i % len(self.grads)]
        self.opt.step()


def torch_sparse_grads(rows, dim, batches):
    import torch

    return [
        torch.sparse_coo_tensor(
            torch.from_numpy(ids)[None, :],
            torch.from_numpy(vals),
            (rows, dim),
            check_invariants=False,
        )
        for ids, vals in batches
    ]


def measure(make_run, steps, warmup, max_seconds):
    """Build, warm up, then time up to `steps` steps (at least 3, at most ~max_seconds)."""
    mem = bc.PeakRSS()
    gc.collect()
    try:
        run = make_run()
        for i in range(warmup):
            run.step(i)
            run.sync()
        gc.collect()
        mem.baseline()
        mem.start()
        times = []
        t_start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            run.step(warmup + i)
            run.sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if len(times) >= 3 and time.perf_counter() - t_start > max_seconds:
                break
        peak = mem.stop()
    except Exception as e:  # report, keep going with the other configurations
        if mem._base is not None:
            mem.stop()
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        print(f"    ERROR: {msg}", flush=True)
        return {"error": msg}
    record = timing_record(run, times)
    del run
    gc.collect()
    return {**record, **peak}


def timing_record(run, times):
    """A run's step times (ms): median, extremes and each step."""
    return {
        "name": run.name,
        "grad": run.grad_kind,
        "median_ms": float(np.median(times)),
        "min_ms": float(min(times)),
        "max_ms": float(max(times)),
        "steps_ms": [round(t, 3) for t in times],
    }


def measure_interleaved(makers, steps, warmup):
    """Build every run, then time them a step each in turn: load drift hits all sizes alike.

    `makers` lists `(rows, make_run)`; returns one record per run, as `measure` does
    (without the peak memory, which steps taken in turn cannot attribute).
    """
    runs = [(rows, make()) for rows, make in makers]
    for i in range(warmup):
        for _, run in runs:
            run.step(i)
            run.sync()
    times = [[] for _ in runs]
    for i in range(steps):
        for k, (_, run) in enumerate(runs):
            t0 = time.perf_counter()
            run.step(warmup + i)
            run.sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return [
        {**timing_record(run, t), "rows": rows, "interleaved": True, "peak_delta_mb": None}
        for (rows, run), t in zip(runs, times)
    ]


# -------------------------------------------------- the torch-only subprocess


def sparse_adam_peer(args):
    """Measure torch.optim.SparseAdam only (imports torch, never keras/TF); JSON on stdout."""
    out = {}
    for rows in args.sizes:
        table = np.random.default_rng(1).standard_normal((rows, args.dim), dtype=np.float32)
        batches = make_id_batches(rows, args.ids, 4, args.dim)
        grads = torch_sparse_grads(rows, args.dim, batches)
        out[str(rows)] = measure(
            lambda table=table, grads=grads: SparseAdamRun(table, grads),
            args.steps,
            args.warmup,
            args.max_seconds,
        )
        del table, grads
        gc.collect()
    print("SPARSEADAM_JSON " + json.dumps(out), flush=True)


def sparse_adam_in_subprocess(args):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_sparse-adam-peer",
        "--sizes",
        ",".join(str(s) for s in args.sizes),
        "--ids",
        str(args.ids),
        "--dim",
        str(args.dim),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--max-seconds",
        str(args.max_seconds),
    ]
    env = dict(os.environ, KERAS_BACKEND="torch")
    print(f"measuring {SPARSE_ADAM} in a torch-only subprocess ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("SPARSEADAM_JSON "):
            return {int(k): v for k, v in json.loads(line[len("SPARSEADAM_JSON ") :]).items()}
    print(f"    torch subprocess failed (rc {proc.returncode}): {proc.stderr[-500:]}", flush=True)
    return {}


# ---------------------------------------------------------------------- main


OURS_BCOO = OURS + " [BCOO]"


def configs_for(backend, rows, dim, batches, skip_peers=False, bcoo=False, only=None):
    """(label, factory) pairs for one table size on this backend (only those whose label contains `only`, if given)."""
    out = _configs_for(backend, rows, dim, batches, skip_peers, bcoo, only)
    return [(label, f) for label, f in out if only is None or only in label]


def _configs_for(backend, rows, dim, batches, skip_peers, bcoo, only):
    import keras

    import keras_tpu_optim

    ours = lambda: keras_tpu_optim.EmbeddingAdam(LR)  # noqa: E731
    adam = lambda: keras.optimizers.Adam(LR)  # noqa: E731
    rng = np.random.default_rng(1)
    table = rng.standard_normal((rows, dim), dtype=np.float32)
    out = []
    if backend == "tensorflow":
        for jit in (False, True):
            tag = f" [jit_compile={jit}]"
            out.append(
                (
                    OURS + tag,
                    lambda jit=jit, tag=tag: KerasTFRun(OURS + tag, ours, table, batches, jit),
                )
            )
            if not skip_peers:
                out.append(
                    (
                        ADAM + tag,
                        lambda jit=jit, tag=tag: KerasTFRun(ADAM + tag, adam, table, batches, jit),
                    )
                )
    elif backend == "jax":
        # Dense V x 64 gradients: keep at most ~1 GB of them.
        n = max(1, min(len(batches), int(1e9 // (rows * dim * 4))))
        # (No dense gradients when only the BCOO configuration runs: they are table-sized.)
        dense = [] if only == "[BCOO]" else [densify(rows, dim, i, v) for i, v in batches[:n]]
        out.append((OURS, lambda: KerasJaxRun(OURS, ours, table, dense)))
        if bcoo:
            out.append((OURS_BCOO, lambda: KerasJaxBCOORun(OURS_BCOO, ours, table, batches)))
        if not skip_peers:
            out.append((ADAM, lambda: KerasJaxRun(ADAM, adam, table, dense)))
    elif backend == "torch":
        n = max(1, min(len(batches), int(1e9 // (rows * dim * 4))))
        dense = [keras.ops.convert_to_tensor(densify(rows, dim, i, v)) for i, v in batches[:n]]
        sparse = torch_sparse_grads(rows, dim, batches)
        out.append(
            (
                OURS + " [dense]",
                lambda: KerasTorchRun(OURS + " [dense]", ours, table, dense, "dense"),
            )
        )
        if not skip_peers:
            out.append(
                (
                    ADAM + " [dense]",
                    lambda: KerasTorchRun(ADAM + " [dense]", adam, table, dense, "dense"),
                )
            )
        out.append(
            (
                OURS + " [sparse]",
                lambda: KerasTorchRun(OURS + " [sparse]", ours, table, sparse, "sparse COO"),
            )
        )
        if not skip_peers:
            out.append((SPARSE_ADAM, lambda: SparseAdamRun(table, sparse)))
    else:
        raise SystemExit(f"unsupported backend {backend!r}")
    return out


def need_bytes(backend, rows, dim, only=None):
    table = rows * dim * 4
    if backend == "jax" and only == "[BCOO]":  # table, m, v and the numpy table; no dense gradient
        return table * 4 + (2 << 30)
    # table + m + v of one optimizer, plus a dense gradient and a table-sized temporary;
    # Keras's Adam on eager torch allocates about three more table-sized temporaries
    # (measured: +732 MB at 1M rows), which at 10M rows passed the budget of a 24 GiB machine.
    # (A rough pre-check; the watchdog enforces the budget while running.)
    extra = {"jax": 2, "torch": 5}.get(backend, 1)
    return table * (3 + extra) + (2 << 30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        default=None,
        help="table rows, comma-separated (default 100k,1M,10M; quick: 10k,100k)",
    )
    ap.add_argument(
        "--dim", type=int, default=None, help="embedding dimension (default 64; quick: 16)"
    )
    ap.add_argument("--ids", type=int, default=None, help="ids per step (default 4096; quick: 512)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per configuration (default 100, within --max-seconds; quick: 3)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop timing a configuration after this long, once it has 3 steps (default 20)",
    )
    ap.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="stop (exit 3, report written) if this process's RSS passes this; "
        "default: memory available at start minus 3 GiB",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="run only the configurations whose label contains this, e.g. '[BCOO]' "
        "(on JAX: then no dense gradients are built, so larger tables fit)",
    )
    ap.add_argument("--quick", action="store_true", help="small tables, for smoke tests")
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="JAX: advise ours' tables for huge pages after build (cpu_tuning.py)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="with --only: build every size's run first, then time them a step each in turn "
        "(all sizes in memory at once; growth figures without load drift between sizes)",
    )
    ap.add_argument("--json", default=None, help="write the results as JSON to this path")
    ap.add_argument("--_sparse-adam-peer", dest="peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global ADVISE_HUGE_PAGES
    ADVISE_HUGE_PAGES = args.huge_pages
    args.sizes = [
        parse_size(s)
        for s in (args.sizes or ("10k,100k" if args.quick else "100k,1M,10M")).split(",")
    ]
    args.dim = args.dim or (16 if args.quick else 64)
    args.ids = args.ids or (512 if args.quick else 4096)
    args.steps = args.steps or (3 if args.quick else 100)
    args.max_seconds = args.max_seconds or (5.0 if args.quick else 20.0)

    if args.peer:
        return sparse_adam_peer(args)

    import keras

    backend = keras.backend.backend()
    machine = bc.machine_info()
    print(f"EmbeddingAdam benchmark — backend {backend}, keras {keras.__version__}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB; load {machine['loadavg']}"
    )
    print(
        f"tables: {', '.join(size_label(s) for s in args.sizes)} rows x {args.dim} float32; "
        f"{args.ids} ids a step (~25% duplicates); up to {args.steps} timed steps after {args.warmup} warm-up\n",
        flush=True,
    )

    records = []  # {rows, name, grad, median_ms, ..., peak_delta_mb} or {rows, name, error}
    skipped = []
    current = {}
    avail0 = available_bytes() or (8 << 30)
    budget = (
        int(args.mem_budget_gb * 2**30)
        if args.mem_budget_gb
        else bc.rss_bytes() + avail0 - (3 << 30)
    )

    def on_exceed(rss):
        msg = f"stopped: process RSS {rss / 2**30:.1f} GiB passed the memory budget {budget / 2**30:.1f} GiB"
        print(f"    ERROR: {msg}", flush=True)
        if current:
            records.append({**current, "error": msg})
        report(backend, args, machine, list(records), skipped)

    MemoryWatchdog(budget, on_exceed)
    print(
        f"memory budget for this process: {budget / 2**30:.1f} GiB (--mem-budget-gb)\n", flush=True
    )
    bcoo = False
    if backend == "jax":
        import keras_tpu_optim

        why = bcoo_supported(lambda: keras_tpu_optim.EmbeddingAdam(LR))
        bcoo = why is None
        if not bcoo:
            msg = f"skipping {OURS_BCOO}: this keras_tpu_optim cannot apply a BCOO gradient ({why})"
            print(msg + "\n", flush=True)
            skipped.append({"rows": None, "name": OURS_BCOO, "reason": msg})
    if args.interleave:
        if not args.only:
            ap.error("--interleave needs --only (every size's runs are held in memory at once)")
        makers = [
            (rows, factory)
            for rows in args.sizes
            for label, factory in configs_for(
                backend,
                rows,
                args.dim,
                make_id_batches(rows, args.ids, 4, args.dim),
                bcoo=bcoo,
                only=args.only,
            )
        ]
        print(
            f"interleaved: {', '.join(size_label(r) for r, _ in makers)} a step each in turn\n",
            flush=True,
        )
        records = measure_interleaved(makers, args.steps, args.warmup)
        for rec in records:
            print(
                f"{size_label(rec['rows']):>5} rows: {rec['name']}: {rec['median_ms']:.2f} ms "
                f"(median of {len(rec['steps_ms'])})",
                flush=True,
            )
    for rows in [] if args.interleave else args.sizes:
        avail = available_bytes()
        # The same 3 GiB of headroom as the watchdog's default budget.
        need = need_bytes(backend, rows, args.dim, args.only)
        if avail is not None and need > avail - (3 << 30):
            msg = (
                f"skipping {size_label(rows)} rows: needs ~{need / 2**30:.1f} GiB, "
                f"{avail / 2**30:.1f} GiB available (3 GiB kept free)"
            )
            print(msg, flush=True)
            skipped.append({"rows": rows, "reason": msg})
            continue
        batches = make_id_batches(rows, args.ids, 4, args.dim)
        for label, factory in configs_for(
            backend, rows, args.dim, batches, bcoo=bcoo, only=args.only
        ):
            print(f"{size_label(rows):>5} rows: {label} ...", flush=True)
            current.update(name=label, rows=rows)
            rec = measure(factory, args.steps, args.warmup, args.max_seconds)
            current.clear()
            rec.setdefault("name", label)
            rec["rows"] = rows
            records.append(rec)
            if "error" not in rec:
                print(
                    f"      {rec['median_ms']:.2f} ms (median of {len(rec['steps_ms'])}), "
                    f"peak +{rec['peak_delta_mb']:.0f} MB",
                    flush=True,
                )
        del batches, label, factory  # the closures hold this size's table
        gc.collect()

    if backend == "tensorflow":
        measured = [r for r in args.sizes if r not in {s["rows"] for s in skipped}]
        if measured:
            peer_args = argparse.Namespace(**{**vars(args), "sizes": measured})
            for rows, rec in sparse_adam_in_subprocess(peer_args).items():
                rec.setdefault("name", SPARSE_ADAM)
                rec["name"] = SPARSE_ADAM + " (torch subprocess)"
                rec["rows"] = rows
                records.append(rec)

    report(backend, args, machine, records, skipped)


def report(backend, args, machine, records, skipped):
    def get(name, rows):
        for r in records:
            if r["name"] == name and r["rows"] == rows and "error" not in r:
                return r
        return None

    names = list(dict.fromkeys(r["name"] for r in records))
    sizes = [s for s in args.sizes if any(r["rows"] == s for r in records)]
    print()
    bc.print_table(
        f"EmbeddingAdam on {backend}: step time, ms (median)",
        ["optimizer", "gradient"] + [size_label(s) for s in sizes],
        [
            [n, next((r.get("grad", "") for r in records if r["name"] == n and "grad" in r), "")]
            + [
                (
                    "ERROR"
                    if any(r["name"] == n and r["rows"] == s and "error" in r for r in records)
                    else bc.fmt(get(n, s)["median_ms"], ".2f")
                    if get(n, s)
                    else "-"
                )
                for s in sizes
            ]
            for n in names
        ],
    )
    bc.print_table(
        f"Peak memory of the step (RSS above the RSS after warm-up, MB; {records[0].get('method', 'RSS') if records else ''})",
        ["optimizer"] + [size_label(s) for s in sizes],
        [
            [n] + [bc.fmt(get(n, s)["peak_delta_mb"], ".0f") if get(n, s) else "-" for s in sizes]
            for n in names
        ],
    )

    # ours -> peers, per backend
    if backend == "tensorflow":
        pairs = []
        for jit in (False, True):
            tag = f" [jit_compile={jit}]"
            pairs += [(OURS + tag, ADAM + tag), (OURS + tag, SPARSE_ADAM + " (torch subprocess)")]
    elif backend == "jax":
        pairs = [(OURS, ADAM)] + ([(OURS_BCOO, ADAM)] if OURS_BCOO in names else [])
    else:
        pairs = [
            (OURS + " [dense]", ADAM + " [dense]"),
            (OURS + " [sparse]", SPARSE_ADAM),
            (OURS + " [sparse]", ADAM + " [dense]"),
        ]
    ratios = []
    for mine, peer in pairs:
        for s in sizes:
            a, b = get(mine, s), get(peer, s)
            ratios.append(
                {
                    "ours": mine,
                    "peer": peer,
                    "rows": s,
                    "time_ratio": a["median_ms"] / b["median_ms"] if a and b else None,
                }
            )
    bc.print_table(
        "Ratios, ours / peer step time (lower is better)",
        ["ours", "peer"] + [size_label(s) for s in sizes],
        [
            [m, p]
            + [
                bc.fmt(
                    next(
                        x["time_ratio"]
                        for x in ratios
                        if x["ours"] == m and x["peer"] == p and x["rows"] == s
                    )
                )
                for s in sizes
            ]
            for m, p in pairs
        ],
    )
    # growth with the table
    growth = []
    for n in names:
        pts = [(s, get(n, s)) for s in sizes if get(n, s)]
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            growth.append(
                {"name": n, "from": s0, "to": s1, "ratio": r1["median_ms"] / r0["median_ms"]}
            )
    if growth:
        bc.print_table(
            "Growth with the table: time(larger) / time(smaller)",
            ["optimizer", "sizes", "time ratio"],
            [
                [
                    g["name"],
                    f"{size_label(g['to'])}/{size_label(g['from'])}",
                    bc.fmt(g["ratio"], ".2f"),
                ]
                for g in growth
            ],
        )

    # targets, at 1M rows (or the largest measured size in a quick run)
    ref = 1_000_000 if 1_000_000 in sizes else (max(sizes) if sizes else None)
    small = (
        100_000
        if (ref == 1_000_000 and 100_000 in sizes)
        else (max([s for s in sizes if s < ref], default=None) if ref else None)
    )
    at = f" @{size_label(ref)}" if ref else ""

    def ratio(mine, peer, s=ref):
        return next(
            (
                x["time_ratio"]
                for x in ratios
                if x["ours"] == mine and x["peer"] == peer and x["rows"] == s
            ),
            None,
        )

    targets = []
    if backend == "tensorflow":
        for jit in (False, True):
            tag = f" [jit_compile={jit}]"
            targets.append(
                bc.target(f"TF{tag} ours / {ADAM}{at}", ratio(OURS + tag, ADAM + tag), 0.05)
            )
            targets.append(
                bc.target(
                    f"TF{tag} ours / {SPARSE_ADAM}{at}",
                    ratio(OURS + tag, SPARSE_ADAM + " (torch subprocess)"),
                    1.0,
                )
            )
            a, b = get(OURS + tag, ref), get(OURS + tag, small) if small else None
            targets.append(
                bc.target(
                    f"TF{tag} ours time({size_label(ref)})/time({size_label(small) if small else '?'})",
                    a["median_ms"] / b["median_ms"] if a and b else None,
                    1.3,
                )
            )
    elif backend == "jax":
        targets.append(bc.target(f"JAX ours / {ADAM}{at}", ratio(OURS, ADAM), 0.25))
        if OURS_BCOO in names:
            targets.append(
                bc.target(f"JAX ours [BCOO] / {ADAM} [dense]{at}", ratio(OURS_BCOO, ADAM), 0.05)
            )
            big = 10 * ref if ref and 10 * ref in sizes else None
            a, b = (get(OURS_BCOO, big), get(OURS_BCOO, ref)) if big else (None, None)
            targets.append(
                bc.target(
                    f"JAX ours [BCOO] time({size_label(big) if big else size_label(10 * ref) if ref else '?'})"
                    f"/time({size_label(ref) if ref else '?'})",
                    a["median_ms"] / b["median_ms"] if a and b else None,
                    1.3,
                    "" if a and b else "larger table not measured",
                )
            )
    else:
        targets.append(
            bc.target(
                f"torch dense ours / {ADAM}{at}", ratio(OURS + " [dense]", ADAM + " [dense]"), 0.1
            )
        )
        targets.append(
            bc.target(
                f"torch sparse ours / {SPARSE_ADAM}{at}",
                ratio(OURS + " [sparse]", SPARSE_ADAM),
                1.0,
                "informational (issue 3 sets this target on TF)",
            )
        )
    bc.print_targets(targets)

    errors = [r for r in records if "error" in r]
    if errors:
        print("Errors:")
        for r in errors:
            print(f"  {r['name']} @ {size_label(r['rows'])}: {r['error']}")
    bc.write_json(
        args.json,
        {
            "bench": "embedding_adam",
            "backend": backend,
            "quick": args.quick,
            "machine": machine,
            "dim": args.dim,
            "ids": args.ids,
            "sizes": sizes,
            "skipped": skipped,
            "records": records,
            "ratios": ratios,
            "growth": growth,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
