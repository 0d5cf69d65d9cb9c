"""torch: the ops a step dispatches (each one a kernel launch on a GPU) and eager against `torch.compile` steps.

Runs on the torch backend only (KERAS_BACKEND=torch).

- Ops a step: the aten ops one warm `apply` (or `torch.optim` `step`)
  dispatches, counted with a `TorchDispatchMode`. Ours is counted on the path a
  CUDA user runs (its variables' platform set to `"gpu"`: the grouped
  Adafactor step) and on the CPU path. Configurations: 10 and 40 variables in
  2 shapes ((64, 32) and (32,)), the BERT-base-like stack of
  `bench_adafactor.py` (121 variables in 8 shapes), and EmbeddingAdam on 1 and
  4 tables of 20,000 x 64 with a dense or a sparse COO gradient of 4096 ids.
- Step times, ms (median of `--steps` after 2 warm-up steps, on this
  machine's device): on the BERT-like stack ours, `keras.optimizers.Adafactor`,
  `keras.optimizers.Adam` and `torch.optim.Adafactor(foreach=True)`, each eager
  and under `torch.compile` (as Keras's `jit_compile=True` compiles the train
  step; the first call's compilation is reported in seconds); EmbeddingAdam on
  a 1M x 64 table with a dense gradient against Keras's Adam, eager and
  compiled.
- `torch._dynamo.explain` of ours: graphs and breaks of one `apply`.

`integration/device_check.py` runs the same steps on a CUDA GPU.

Usage: KERAS_BACKEND=torch python integration/bench_torch_launches.py [--quick] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)
from bench_adafactor import make_arrays, stack_shapes

OURS_ADAFACTOR = "keras_tpu_optim.Adafactor"
OURS_EMBEDDING = "keras_tpu_optim.EmbeddingAdam"
EMBEDDING_ROWS, EMBEDDING_IDS, DIM = 20_000, 4096, 64
# `torch.compile`'s backend; `--quick` (and `device_check.py --dry-run`) trace with "eager", which checks that
# the steps trace in seconds where inductor's code generation takes minutes on a small CPU.
COMPILE_BACKEND = "inductor"


def op_counter():
    """A `TorchDispatchMode` whose `count` is the aten ops dispatched inside it (views and copies included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


class KerasStep:
    """A Keras optimizer's `apply` on its own copy of the variables, eager or `torch.compile`d.

    `platform` sets our optimizers' variables' platform (the kernel choice) after `build`.
    """

    def __init__(self, make_opt, params_np, grads, device, compiled=False, platform=None):
        import keras
        import torch

        with keras.device(device):
            self.variables = [keras.Variable(p, name=f"v{i}") for i, p in enumerate(params_np)]
        self.opt = make_opt()
        self.opt.build(self.variables)
        if platform is not None:
            self.opt._platforms = [platform] * len(self.variables)
        self.grads = grads
        opt, variables = self.opt, self.variables

        def apply():
            with torch.no_grad():
                opt.apply(grads, variables)

        self.apply = apply
        self.step = torch.compile(apply, backend=COMPILE_BACKEND) if compiled else apply


class TorchOptimStep:
    """A `torch.optim` optimizer's `step` on its own parameters (their `.grad` set once), eager or compiled."""

    def __init__(self, make_opt, params_np, grads, device, compiled=False):
        import torch

        self.params = [torch.nn.Parameter(torch.from_numpy(p.copy()).to(device)) for p in params_np]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = make_opt(self.params)
        self.apply = self.opt.step
        self.step = (
            torch.compile(self.opt.step, backend=COMPILE_BACKEND) if compiled else self.opt.step
        )


def count_ops(runner) -> int:
    for _ in range(2):  # warm: state created, plans made
        runner.apply()
    with op_counter() as counter:
        runner.apply()
    return counter.count


def explain(runner) -> tuple:
    """(graphs, breaks) of `torch._dynamo.explain` on one `apply` (a step of its own: run it on a spare runner)."""
    import torch

    explained = torch._dynamo.explain(runner.apply)()
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count


def adafactor_lineup(device):
    """(name, make_runner(params, grads, compiled, platform)) for the Adafactor comparisons."""
    import keras
    import torch

    import keras_tpu_optim as kto

    def keras_step(make):
        return lambda p, g, compiled=False, platform=None: KerasStep(
            make, p, _on(g, device), device, compiled, platform
        )

    def optim_step(make):
        return lambda p, g, compiled=False, platform=None: TorchOptimStep(
            make, p, _on(g, device), device, compiled
        )

    return [
        (OURS_ADAFACTOR, keras_step(kto.Adafactor)),
        ("keras.optimizers.Adafactor", keras_step(keras.optimizers.Adafactor)),
        ("keras.optimizers.Adam", keras_step(keras.optimizers.Adam)),
        (
            "torch.optim.Adafactor(foreach=True)",
            optim_step(lambda ps: torch.optim.Adafactor(ps, lr=1e-3, foreach=True)),
        ),
        (
            "torch.optim.Adam(foreach=True)",
            optim_step(lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
        ),
    ]


def _on(arrays, device):
    import torch

    return [torch.from_numpy(a).to(device) for a in arrays]


def embedding_gradients(tables, rows, kind, device, seed=0):
    """One gradient a table: 4096 ids (about a quarter duplicates), dense or sparse COO (duplicates kept)."""
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tables):
        ids = rng.integers(0, rows, EMBEDDING_IDS)
        values = rng.standard_normal((EMBEDDING_IDS, DIM), dtype=np.float32)
        if kind == "sparse":
            out.append(
                torch.sparse_coo_tensor(
                    torch.from_numpy(ids)[None], torch.from_numpy(values), (rows, DIM)
                ).to(device)
            )
        else:
            dense = np.zeros((rows, DIM), np.float32)
            np.add.at(dense, ids, values)
            out.append(torch.from_numpy(dense).to(device))
    return out


def embedding_lineup(device, kind):
    import keras
    import torch

    import keras_tpu_optim as kto

    ours = (
        OURS_EMBEDDING,
        lambda p, g, compiled=False: KerasStep(
            lambda: kto.EmbeddingAdam(1e-3), p, g, device, compiled
        ),
    )
    if kind == "sparse":
        peer = (
            "torch.optim.SparseAdam",
            lambda p, g, compiled=False: TorchOptimStep(
                lambda ps: torch.optim.SparseAdam(ps, lr=1e-3), p, g, device
            ),
        )
    else:
        peer = (
            "keras.optimizers.Adam",
            lambda p, g, compiled=False: KerasStep(
                lambda: keras.optimizers.Adam(1e-3), p, g, device, compiled
            ),
        )
    return [ours, peer]


def timed(runner, steps, sync) -> dict:
    start = time.perf_counter()
    runner.step()  # the first call compiles under torch.compile
    sync()
    first_s = time.perf_counter() - start
    result = bc.time_steps(runner.step, steps, warmup=1, sync=sync)
    return {"median_ms": result["median_ms"], "first_call_s": first_s}


def measure_counts(quick) -> list:
    records = []
    two_shapes = {f"{n} variables, 2 shapes": [(64, 32), (32,)] * (n // 2) for n in (10, 40)}
    stacks = {
        **two_shapes,
        f"BERT-like ({len(stack_shapes(quick))} variables, 8 shapes)": stack_shapes(quick),
    }
    for config, shapes in stacks.items():
        params, grads = make_arrays(shapes)
        for name, make in adafactor_lineup("cpu"):
            platforms = ["gpu", "cpu"] if name == OURS_ADAFACTOR else [None]
            for platform in platforms:
                label = name + {"gpu": " [GPU path]", "cpu": " [CPU path]", None: ""}[platform]
                ops = count_ops(make(params, grads, platform=platform))
                records.append(
                    {
                        "section": "ops",
                        "config": config,
                        "optimizer": label,
                        "ops": ops,
                        "variables": len(shapes),
                    }
                )
                print(f"{config:40s} {label:48s} {ops:6d} ops", flush=True)
    rows = 2000 if quick else EMBEDDING_ROWS
    for kind in ("dense", "sparse"):
        for tables in (1, 4):
            table_np = [
                np.random.default_rng(t).standard_normal((rows, DIM), dtype=np.float32)
                for t in range(tables)
            ]
            grads = embedding_gradients(tables, rows, kind, "cpu")
            for name, make in embedding_lineup("cpu", kind):
                ops = count_ops(make(table_np, grads))
                config = f"{tables} table(s) {rows}x{DIM}, {kind} gradient"
                records.append(
                    {
                        "section": "ops",
                        "config": config,
                        "optimizer": name,
                        "ops": ops,
                        "variables": tables,
                    }
                )
                print(f"{config:40s} {name:48s} {ops:6d} ops", flush=True)
    return records


# The timed stack: the BERT-like stack's first layers, at full width (compiling all 12 layers takes
# minutes on a small CPU: the compiler's time follows the ops, the step's the bytes).
TIMED_LAYERS = 2


def measure_times(quick, steps, device="cpu", sync=lambda: None, lineup=None) -> list:
    records = []
    shapes = stack_shapes(quick)
    shapes = shapes[: 1 + 10 * TIMED_LAYERS]
    params, grads = make_arrays(shapes)
    config = f"BERT-like, {TIMED_LAYERS} layers ({len(shapes)} variables, {sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M parameters)"
    for name, make in lineup or adafactor_lineup(device):
        if name == "torch.optim.Adam(foreach=True)":
            continue  # counted above; its step time is not an Adafactor comparison
        for compiled in (
            (False, True) if name == OURS_ADAFACTOR or not quick else (False,)
        ):  # quick: trace ours only
            result = timed(make(params, grads, compiled=compiled), steps, sync)
            records.append(
                {
                    "section": "times",
                    "config": config,
                    "optimizer": name,
                    "mode": "compiled" if compiled else "eager",
                    **result,
                }
            )
            print(
                f"{config:32s} {name:40s} {records[-1]['mode']:8s} {result['median_ms']:9.2f} ms "
                f"(first call {result['first_call_s']:.1f} s)",
                flush=True,
            )
    rows = 20_000 if quick else 1_000_000
    table_np = [np.random.default_rng(0).standard_normal((rows, DIM), dtype=np.float32)]
    grads = embedding_gradients(1, rows, "dense", device)
    for name, make in embedding_lineup(device, "dense"):
        for compiled in (False, True) if name == OURS_EMBEDDING or not quick else (False,):
            result = timed(make(table_np, grads, compiled=compiled), steps, sync)
            records.append(
                {
                    "section": "times",
                    "config": f"{bench_size(rows)} x {DIM} table, dense gradient",
                    "optimizer": name,
                    "mode": "compiled" if compiled else "eager",
                    **result,
                }
            )
            print(
                f"{records[-1]['config']:32s} {name:40s} {records[-1]['mode']:8s} {result['median_ms']:9.2f} ms "
                f"(first call {result['first_call_s']:.1f} s)",
                flush=True,
            )
    return records


def bench_size(rows):
    return f"{rows // 10**6}M" if rows % 10**6 == 0 else f"{rows // 1000}k"


def measure_graphs(quick) -> list:
    import keras_tpu_optim as kto

    records = []
    params, grads = make_arrays(stack_shapes(True))
    for platform in ("gpu", "cpu"):
        runner = KerasStep(kto.Adafactor, params, _on(grads, "cpu"), "cpu", platform=platform)
        runner.apply()
        graphs, breaks = explain(runner)
        records.append(
            {
                "section": "graphs",
                "optimizer": f"{OURS_ADAFACTOR} [{platform.upper()} path]",
                "graphs": graphs,
                "breaks": breaks,
            }
        )
    for kind in ("dense", "sparse"):
        table = [np.zeros((2000, DIM), np.float32)]
        runner = embedding_lineup("cpu", kind)[0][1](
            table, embedding_gradients(1, 2000, kind, "cpu")
        )
        runner.apply()
        graphs, breaks = explain(runner)
        records.append(
            {
                "section": "graphs",
                "optimizer": f"{OURS_EMBEDDING} [{kind} gradient]",
                "graphs": graphs,
                "breaks": breaks,
            }
        )
    for r in records:
        print(f"{r['optimizer']:48s} {r['graphs']} graph(s), {r['breaks']} break(s)", flush=True)
    return records


def targets_of(records) -> list:
    def ops(config_start, optimizer):
        return next(
            (
                r["ops"]
                for r in records
                if r["section"] == "ops"
                and r["config"].startswith(config_start)
                and r["optimizer"] == optimizer
            ),
            None,
        )

    gpu = OURS_ADAFACTOR + " [GPU path]"
    graphs = {r["optimizer"]: r["breaks"] for r in records if r["section"] == "graphs"}
    return [
        bc.target("ops, 40 variables in 2 shapes (GPU path)", ops("40 variables", gpu), 140),
        bc.target("ops, BERT-like stack (GPU path)", ops("BERT-like", gpu), 600),
        bc.target(
            "ops(40 variables) - ops(10 variables) (GPU path)",
            None if ops("40", gpu) is None else ops("40", gpu) - ops("10", gpu),
            0,
        ),
        bc.target("graph breaks, Adafactor apply (GPU path)", graphs.get(gpu), 0),
        bc.target(
            "graph breaks, EmbeddingAdam apply (dense gradient)",
            graphs.get(OURS_EMBEDDING + " [dense gradient]"),
            0,
        ),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps (default 10; 3 with --quick)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import keras

    if keras.backend.backend() != "torch":
        print(
            f"bench_torch_launches: torch only; this run is {keras.backend.backend()} (nothing measured)"
        )
        return 0
    steps = args.steps or (3 if args.quick else 10)
    global COMPILE_BACKEND
    if args.quick:
        COMPILE_BACKEND = "eager"
    machine = bc.machine_info()
    records = (
        measure_counts(args.quick) + measure_graphs(args.quick) + measure_times(args.quick, steps)
    )
    targets = targets_of(records)
    bc.print_targets(targets)
    bc.write_json(
        args.json,
        {
            "machine": machine,
            "keras": keras.__version__,
            "steps": steps,
            "compile_backend": COMPILE_BACKEND,
            "records": records,
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
