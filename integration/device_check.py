"""The accelerator measurement: our optimizers against their peers on one CUDA GPU, in one table.

On a machine with one CUDA GPU (torch and JAX built for it, optax, Keras; no
TensorFlow needed, nothing downloaded) it prints, for each configuration, the
median step (ms) of every optimizer and its ratio to the configuration's first
peer:

- Adafactor on the BERT-base-like stack of `bench_adafactor.py`: on JAX ours,
  `keras.optimizers.Adafactor` and `optax.adafactor`, each under
  `jax.jit(stateless_apply)` with the state donated (as Keras's trainer runs
  it); on torch ours eager and under `torch.compile`, Keras's Adafactor and
  `torch.optim.Adafactor(foreach=True)`.
- EmbeddingAdam on 1M and 10M x 64 tables, 4096 ids a step: on JAX the dense
  gradient and a BCOO gradient against Keras's Adam (dense); on torch the
  dense gradient (eager and compiled) against Keras's Adam, and a sparse COO
  gradient against `torch.optim.SparseAdam`.
- The Criteo-shaped recommender of `bench_criteo.py` (26 tables, 5.57M rows, batch 2,048), a
  whole `train_on_batch` step on each backend: 26 `keras.layers.Embedding` trained by Keras's
  Adam (dense, the peer), `kto.layers.DistributedEmbedding` (the tables of a step updated
  together), 26 `kto.layers.Embedding` and one table of all rows; keras-rs's layer where keras-rs
  is installed. On a GPU every op is a kernel launch: these rows say whether the fused update
  beats dense Adam there.
- Each platform-gated kernel choice on vs off, so that the choice for GPUs is
  a measurement: ours with the CPU forms forced (`[CPU forms]`: JAX's CPU
  Adafactor evaluation, torch's blocked Adafactor step, torch's scaled-L2
  touched-row search) and with the grouped torch Adafactor step off
  (`[grouped off]`).

Each backend runs in its own process, within a share of `--budget-s` (default
320 s in all); a configuration that would start past its share is listed as
skipped. `--dry-run` runs the same code on this machine's CPU with tiny sizes
(the test suite runs it, so that it cannot rot); `--json PATH` also writes the
rows.

On the accelerator machine, Keras travels as a wheel: `pip download --no-deps
keras==<version>` into a folder, install it with `--no-deps --target`, put that
folder and the repository on `PYTHONPATH`, then
`python integration/device_check.py`.

Usage: python integration/device_check.py [--dry-run] [--budget-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the package itself, where it is not installed

import numpy as np  # noqa: E402

ROW_PREFIX = "DEVICE_CHECK_ROW "
BACKENDS = ("jax", "torch")
DIM, IDS = 64, 4096


class Budget:
    """A deadline: configurations that would start past it are reported as skipped."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()


def emit(section, config, optimizer, ms, note=""):
    print(
        ROW_PREFIX
        + json.dumps(
            {"section": section, "config": config, "optimizer": optimizer, "ms": ms, "note": note}
        ),
        flush=True,
    )


def measure(budget, section, config, name, make, steps, sync):
    """Build with `make()`, warm up (compiling), time `steps` steps; one row, or a skipped row past the budget."""
    import bench_common as bc

    if budget.left() <= 0:
        emit(section, config, name, None, "skipped: over the time budget")
        return
    try:
        step = make()
        start = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - start
        result = bc.time_steps(step, steps, warmup=1, sync=sync)
        emit(section, config, name, result["median_ms"], f"first call {first:.1f} s")
    except Exception as e:  # noqa: BLE001  (a row that failed says why; the others still run)
        emit(
            section,
            config,
            name,
            None,
            f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
        )


def criteo_rows(dry_run, steps, budget, label):
    """The Criteo-shaped model's `train_on_batch` step per configuration of `bench_criteo.py`, the dense
    peer first (the step returns the loss to the host: each timed step is synchronised). A dry run builds
    the peer and the fused layer only, on tables capped at 1,000 rows, and on torch only (eager: no
    compilation; `test_bench_criteo_quick` runs the same model on every backend)."""
    import importlib.util

    import bench_criteo

    if dry_run and label.startswith("JAX"):
        return
    sizes = bench_criteo.cardinalities(quick=dry_run)
    config = f"Criteo-shaped fit step, {sum(sizes):,} rows x {bench_criteo.DIM} [{label}]"
    names = {
        "keras": "26 keras.layers.Embedding + keras.optimizers.Adam",
        "distributed": "kto.layers.DistributedEmbedding",
        "frozen": "kto.layers.DistributedEmbedding, tables not trained",
        "layers26": "26 kto.layers.Embedding",
        "one_table": "one kto.layers.Embedding of all rows",
        "keras_rs": "keras_rs.layers.DistributedEmbedding + keras.optimizers.Adam",
    }
    for name in ("keras", "distributed") if dry_run else tuple(names):
        if name == "keras_rs" and importlib.util.find_spec("keras_rs") is None:
            emit("Criteo", config, names[name], None, "skipped: keras-rs is not installed")
            continue

        def make(name=name):
            model = bench_criteo.build_model(name, sizes)
            batches = [
                (bench_criteo.model_inputs(name, ids, dense), labels)
                for ids, dense, labels in bench_criteo.make_data(sizes, 4)
            ]
            position = [0]

            def step():
                x, labels = batches[position[0] % len(batches)]
                position[0] += 1
                float(model.train_on_batch(x, labels))

            return step

        measure(budget, "Criteo", config, names[name], make, steps, lambda: None)


# ------------------------------------------------------------------------ JAX


def run_jax(dry_run, steps, budget):
    import jax
    import jax.numpy as jnp
    import keras

    import bench_common as bc
    import keras_tpu_optim as kto
    from bench_adafactor import make_arrays, stack_shapes
    from bench_embedding_adam import densify, make_id_batches

    platform = jax.devices()[0].platform
    if not dry_run and platform != "gpu":
        raise SystemExit(
            f"device_check: JAX sees no GPU (its devices are {platform}); use --dry-run on a CPU"
        )

    def sync_of(holder):
        return lambda: jax.block_until_ready(holder["state"])

    def keras_jit(make_opt, params, grads, platforms=None):
        holder = {}
        variables = [keras.Variable(p) for p in params]
        opt = make_opt()
        opt.build(variables)
        if platforms:
            opt._platforms = [platforms] * len(variables)
        fn = bc.jit_stateless_apply(opt)
        holder["state"] = ([v.value for v in opt.variables], [v.value for v in variables])
        del variables

        def step():
            opt_values, train_values = holder["state"]
            holder["state"] = fn(opt_values, grads, train_values)

        return step, sync_of(holder)

    def optax_jit(params, grads):
        import optax

        tx = optax.adafactor(
            learning_rate=1e-3,
            min_dim_size_to_factor=1,
            decay_rate=0.8,
            eps=1e-30,
            clipping_threshold=1.0,
        )
        holder = {"state": ([jnp.asarray(p) for p in params], None)}
        holder["state"] = (holder["state"][0], tx.init(holder["state"][0]))

        def update(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        fn = jax.jit(update, donate_argnums=(0, 1))

        def step():
            holder["state"] = fn(*holder["state"], grads)

        return step, sync_of(holder)

    def row(section, config, name, built):
        holder = {}

        def make():
            step, holder["sync"] = built()
            return step

        measure(budget, section, config, name, make, steps, lambda: holder["sync"]())

    shapes = stack_shapes(dry_run)
    params, grads_np = make_arrays(shapes)
    grads = [jnp.asarray(g) for g in grads_np]
    config = (
        f"BERT-like, {sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M params [JAX, jit, donated]"
    )
    row(
        "Adafactor",
        config,
        "keras.optimizers.Adafactor",
        lambda grads=grads: keras_jit(keras.optimizers.Adafactor, params, grads),
    )
    row("Adafactor", config, "optax.adafactor", lambda grads=grads: optax_jit(params, grads))
    row(
        "Adafactor",
        config,
        "keras_tpu_optim.Adafactor",
        lambda grads=grads: keras_jit(kto.Adafactor, params, grads),
    )
    row(
        "Adafactor",
        config,
        "keras_tpu_optim.Adafactor [CPU forms]",
        lambda grads=grads: keras_jit(kto.Adafactor, params, grads, platforms="cpu"),
    )
    del grads
    for rows in (2_000, 20_000) if dry_run else (1_000_000, 10_000_000):
        table = [np.random.default_rng(0).standard_normal((rows, DIM), dtype=np.float32)]
        ids, values = make_id_batches(rows, IDS, 1, DIM)[0]
        dense = [jnp.asarray(densify(rows, DIM, ids, values))]
        from jax.experimental import sparse as jax_sparse

        bcoo = [
            jax_sparse.BCOO(
                (jnp.asarray(values), jnp.asarray(ids, jnp.int32)[:, None]), shape=(rows, DIM)
            )
        ]
        config = f"{rows:,} x {DIM} table [JAX, jit, donated]"
        row(
            "EmbeddingAdam",
            config,
            "keras.optimizers.Adam [dense]",
            lambda dense=dense: keras_jit(lambda: keras.optimizers.Adam(1e-3), table, dense),
        )
        row(
            "EmbeddingAdam",
            config,
            "keras_tpu_optim.EmbeddingAdam [dense]",
            lambda dense=dense: keras_jit(lambda: kto.EmbeddingAdam(1e-3), table, dense),
        )
        row(
            "EmbeddingAdam",
            config,
            "keras_tpu_optim.EmbeddingAdam [BCOO]",
            lambda bcoo=bcoo: keras_jit(lambda: kto.EmbeddingAdam(1e-3), table, bcoo),
        )
        del dense, bcoo
    criteo_rows(dry_run, steps, budget, "JAX, fit")


# ---------------------------------------------------------------------- torch


def run_torch(dry_run, steps, budget):
    import torch

    import keras_tpu_optim as kto
    from bench_adafactor import make_arrays, stack_shapes
    from bench_embedding_adam import make_id_batches
    from bench_torch_launches import KerasStep, TorchOptimStep
    from keras_tpu_optim._backend import torch as torch_backend
    from keras_tpu_optim._backend.torch import rows as torch_rows

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("device_check: torch sees no CUDA device; use --dry-run on a CPU")
    import keras

    import bench_torch_launches

    if dry_run:
        bench_torch_launches.COMPILE_BACKEND = (
            "eager"  # traced as inductor would be, without its code generation
        )
    device = "cpu" if dry_run else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    grouped_rule = torch_backend.grouped_adafactor_applies
    norms_rule = torch_rows.scaled_norms_apply

    def on(arrays):
        return [torch.from_numpy(a).to(device) for a in arrays]

    def keras_row(
        section, config, name, make_opt, params, grads, compiled=False, platform=None, patch=None
    ):
        def make():
            runner = KerasStep(make_opt, params, grads, device, compiled, platform)
            if patch is None:
                return runner.step

            def patched():  # the kernel choice forced for this optimizer's steps only
                saved = patch()
                try:
                    runner.step()
                finally:
                    saved()

            return patched

        measure(budget, section, config, name, make, steps, sync)

    def grouped_off():
        torch_backend.grouped_adafactor_applies = lambda platform, size: False
        return lambda: setattr(torch_backend, "grouped_adafactor_applies", grouped_rule)

    def cpu_norms():
        torch_rows.scaled_norms_apply = lambda device_type: True
        return lambda: setattr(torch_rows, "scaled_norms_apply", norms_rule)

    shapes = stack_shapes(dry_run)
    params, grads_np = make_arrays(shapes)
    grads = on(grads_np)
    config = f"BERT-like, {sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M params [torch]"
    keras_row(
        "Adafactor", config, "keras.optimizers.Adafactor", keras.optimizers.Adafactor, params, grads
    )
    measure(
        budget,
        "Adafactor",
        config,
        "torch.optim.Adafactor(foreach=True)",
        lambda grads=grads: (
            TorchOptimStep(
                lambda ps: torch.optim.Adafactor(ps, lr=1e-3, foreach=True), params, grads, device
            ).step
        ),
        steps,
        sync,
    )
    keras_row("Adafactor", config, "keras_tpu_optim.Adafactor", kto.Adafactor, params, grads)
    keras_row(
        "Adafactor",
        config,
        "keras_tpu_optim.Adafactor [torch.compile]",
        kto.Adafactor,
        params,
        grads,
        compiled=True,
    )
    keras_row(
        "Adafactor",
        config,
        "keras_tpu_optim.Adafactor [grouped off]",
        kto.Adafactor,
        params,
        grads,
        patch=grouped_off,
    )
    keras_row(
        "Adafactor",
        config,
        "keras_tpu_optim.Adafactor [CPU forms]",
        kto.Adafactor,
        params,
        grads,
        platform="cpu",
    )
    del grads
    for rows in (2_000, 20_000) if dry_run else (1_000_000, 10_000_000):
        table = [np.random.default_rng(0).standard_normal((rows, DIM), dtype=np.float32)]
        ids, values = make_id_batches(rows, IDS, 1, DIM)[0]
        dense = [
            torch.zeros(rows, DIM, device=device).index_add_(
                0, torch.from_numpy(ids).to(device), torch.from_numpy(values).to(device)
            )
        ]
        sparse = [
            torch.sparse_coo_tensor(
                torch.from_numpy(ids)[None], torch.from_numpy(values), (rows, DIM)
            ).to(device)
        ]
        config = f"{rows:,} x {DIM} table [torch]"
        adam, ours = (lambda: keras.optimizers.Adam(1e-3)), (lambda: kto.EmbeddingAdam(1e-3))
        keras_row("EmbeddingAdam", config, "keras.optimizers.Adam [dense]", adam, table, dense)
        keras_row(
            "EmbeddingAdam", config, "keras_tpu_optim.EmbeddingAdam [dense]", ours, table, dense
        )
        keras_row(
            "EmbeddingAdam",
            config,
            "keras_tpu_optim.EmbeddingAdam [dense, torch.compile]",
            ours,
            table,
            dense,
            compiled=True,
        )
        keras_row(
            "EmbeddingAdam",
            config,
            "keras_tpu_optim.EmbeddingAdam [dense, CPU forms]",
            ours,
            table,
            dense,
            patch=cpu_norms,
        )
        measure(
            budget,
            "EmbeddingAdam",
            config,
            "torch.optim.SparseAdam [sparse]",
            lambda sparse=sparse: (
                TorchOptimStep(
                    lambda ps: torch.optim.SparseAdam(ps, lr=1e-3), table, sparse, device
                ).step
            ),
            steps,
            sync,
        )
        keras_row(
            "EmbeddingAdam", config, "keras_tpu_optim.EmbeddingAdam [sparse]", ours, table, sparse
        )
        del dense, sparse
    criteo_rows(dry_run, steps, budget, "torch, fit")


# ---------------------------------------------------------------------- driver


def table_of(rows) -> str:
    """One markdown table: each row's ms and its ratio to the first measured row of its configuration."""
    lines = [
        "| section | configuration | optimizer | step ms | / first peer | note |",
        "|---|---|---|---|---|---|",
    ]
    first = {}
    for r in rows:
        base = first.setdefault(r["config"], r["ms"])
        ratio = f"{r['ms'] / base:.3f}" if r["ms"] is not None and base else "n/a"
        ms = "n/a" if r["ms"] is None else f"{r['ms']:.3f}"
        lines.append(
            f"| {r['section']} | {r['config']} | `{r['optimizer']}` | {ms} | {ratio} | {r['note']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="this machine's CPU, tiny sizes")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for all the rows (default 320; dry run 50)",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps a row (default 10; dry run 2)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--part", choices=BACKENDS, help=argparse.SUPPRESS
    )  # one backend, in this process
    args = ap.parse_args(argv)
    budget_s = args.budget_s or (50.0 if args.dry_run else 320.0)
    steps = args.steps or (2 if args.dry_run else 10)
    if args.part:
        budget = Budget(budget_s)
        (run_jax if args.part == "jax" else run_torch)(args.dry_run, steps, budget)
        return 0
    rows, failures = [], []
    start = time.monotonic()
    for index, backend in enumerate(BACKENDS):
        share = (budget_s - (time.monotonic() - start)) / (len(BACKENDS) - index)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--part",
            backend,
            "--budget-s",
            str(share),
            "--steps",
            str(steps),
        ] + (["--dry-run"] if args.dry_run else [])
        env = dict(
            os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"
        )
        if args.dry_run:
            env["JAX_PLATFORMS"] = "cpu"
        try:
            # The share bounds the rows started; a row already started may overrun it by its own length.
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=share + 120)
        except subprocess.TimeoutExpired as e:
            failures.append(f"{backend}: stopped after {share + 120:.0f} s")
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        else:
            out = done.stdout
            if done.returncode != 0:
                failures.append(
                    f"{backend}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
                )
        rows += [
            json.loads(line[len(ROW_PREFIX) :])
            for line in out.splitlines()
            if line.startswith(ROW_PREFIX)
        ]
    print(table_of(rows))
    print(
        f"\n{len(rows)} rows in {time.monotonic() - start:.0f} s"
        + ("" if not failures else f"; {failures}")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failures": failures}, f, indent=1)
    failed_rows = [r for r in rows if r["note"].startswith("failed")]
    return 1 if failures or failed_rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
