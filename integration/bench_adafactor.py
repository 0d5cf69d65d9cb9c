"""Adafactor benchmark: keras_tpu_optim.Adafactor against its peers, side by side.

Runs on one Keras backend (KERAS_BACKEND), on a BERT-base-like stack
(a 32000x768 embedding, then 12 x [768x2304 + 2304, 768x768 + 768,
768x3072 + 3072, 3072x768 + 768, two 768 vectors]: 109.6M float32 parameters,
random-normal gradients). It prints, per optimizer, the optimizer-state size
over the parameter size and the median step time over `--steps` steps after
warm-up, the ratio of ours to each peer, the distance to the memory-bandwidth
floor, and the targets of issue 2 with PASS/MISS. Not a test: nothing is
asserted.

Peers, each run the way its own framework's trainer runs it:
- all backends: `keras.optimizers.Adafactor` (default arguments; ours too);
- JAX: Keras optimizers as `jax.jit(optimizer.stateless_apply,
  donate_argnums=(0, 2))` (optimizer variables and trainable variables
  donated, as Keras's JAX trainer); `optax.adafactor` under `jax.jit` with
  params and state donated, configured to Keras's defaults:
  `learning_rate=1e-3` (Keras: min(1e-3, 1/sqrt(t)) = 1e-3 for t < 1e6),
  `min_dim_size_to_factor=1` (Keras factors every variable of rank >= 2;
  optax's default 128 would not), `decay_rate=0.8` (Keras
  `beta_2_decay=-0.8`), `eps=1e-30` (`epsilon_1`), `clipping_threshold=1.0`
  (`clip_threshold`), `multiply_by_parameter_scale=True` (optax's floor 1e-3 =
  Keras's `epsilon_2`), `momentum=None`, `weight_decay_rate=None`;
- TensorFlow: Keras optimizers as `tf.function(optimizer.apply,
  jit_compile=True)` (what Keras's TF trainer does with jit_compile on, its
  default with a GPU or TPU), and without XLA (`jit_compile=False`: what
  `fit` runs on a machine without an accelerator, where Keras turns XLA off);
- torch: Keras optimizers eagerly, `optimizer.apply` under `torch.no_grad()`
  (as Keras's torch trainer); `torch.optim.Adafactor(lr=1e-3)` with torch's
  other defaults (beta2_decay=-0.8, eps=(None, 1e-3), d=1.0 — d is the update
  clipping threshold), both with its default loop (`foreach=None`, which on CPU
  is the per-parameter loop) and with `foreach=True`. The torch target is
  checked against the faster of the two.

The memory-bandwidth floor: an Adafactor step has to stream the gradient and
the parameters at least twice (statistics, then the update; RMS(param) and
RMS(update) are further reductions) and write the parameters once: about 24
bytes per float32 parameter. The floor is 24 B x params divided by
the copy bandwidth measured here with numpy (a copy of N bytes moves 2N).

Memory: after the interleaved timing, each optimizer alone runs `--mem-steps`
steps and the peak RSS above the RSS just before them is recorded (what a step
allocates and frees: temporaries). What a step keeps (a persistent scratch
buffer, state created lazily on the first step, compiled code) is already
resident by then; that shows in the RSS each optimizer's warm-up added,
recorded too.

Usage:
    KERAS_BACKEND=jax python integration/bench_adafactor.py [--steps 10] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np

os.environ.setdefault(
    "TF_CPP_MIN_LOG_LEVEL", "2"
)  # keep TensorFlow's start-up chatter out of the tables
import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)

BYTES_PER_PARAM = 24
OURS = "keras_tpu_optim.Adafactor"
KERAS = "keras.optimizers.Adafactor"
BLOCKED = " [CPU: every variable blocked]"


def stack_shapes(quick: bool):
    """The BERT-base-like stack of the README's benchmark section (or a tiny one for smoke tests)."""
    vocab, d, ff, layers = (1000, 64, 256, 2) if quick else (32000, 768, 3072, 12)
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, 3 * d), (3 * d,), (d, d), (d,), (d, ff), (ff,), (ff, d), (d,), (d,), (d,)]
    return shapes


def make_arrays(shapes, seed=0):
    rng = np.random.default_rng(seed)
    params = [(0.02 * rng.standard_normal(s, dtype=np.float32)).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    return params, grads


def nbytes_of(x) -> int:
    shape = tuple(int(d) for d in x.shape)
    import keras

    itemsize = np.dtype(keras.backend.standardize_dtype(x.dtype)).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


# ------------------------------------------------------------------- runners
# A runner builds its optimizer and its own copy of the parameters; step() runs
# one optimizer step; sync() waits for it; state_bytes() is the optimizer state.


class KerasJaxRunner:
    def __init__(self, name, make_opt, params_np, grads):
        import jax
        import keras

        self.name = name
        variables = [keras.Variable(p, name=f"v{i}") for i, p in enumerate(params_np)]
        opt = make_opt()
        opt.build(variables)
        self.state = sum(nbytes_of(v) for v in opt.variables)
        self.opt_vals = [v.value for v in opt.variables]
        self.train_vals = [v.value for v in variables]
        self.grads = grads
        self.fn = bc.jit_stateless_apply(opt)
        self._jax = jax
        del variables

    def step(self):
        self.opt_vals, self.train_vals = self.fn(self.opt_vals, self.grads, self.train_vals)

    def sync(self):
        self._jax.block_until_ready((self.train_vals, self.opt_vals))

    def state_bytes(self):
        return self.state


class OptaxRunner:
    def __init__(self, name, params_np, grads):
        import jax
        import jax.numpy as jnp
        import optax

        self.name = name
        self.tx = optax.adafactor(
            learning_rate=1e-3,
            min_dim_size_to_factor=1,
            decay_rate=0.8,
            decay_offset=0,
            multiply_by_parameter_scale=True,
            clipping_threshold=1.0,
            momentum=None,
            weight_decay_rate=None,
            eps=1e-30,
            factored=True,
        )
        self.params = [jnp.asarray(p) for p in params_np]
        self.opt_state = self.tx.init(self.params)
        self.state = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self.opt_state))
        self.grads = grads
        tx = self.tx

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self.fn = jax.jit(step, donate_argnums=(0, 1))
        self._jax = jax

    def step(self):
        self.params, self.opt_state = self.fn(self.params, self.opt_state, self.grads)

    def sync(self):
        self._jax.block_until_ready((self.params, self.opt_state))

    def state_bytes(self):
        return self.state


class KerasTFRunner:
    def __init__(self, name, make_opt, params_np, grads, jit_compile):
        import keras
        import tensorflow as tf

        self.name = name
        self.variables = [keras.Variable(p, name=f"v{i}") for i, p in enumerate(params_np)]
        self.opt = make_opt()
        self.opt.build(self.variables)
        self.state = sum(nbytes_of(v) for v in self.opt.variables)
        self.grads = grads
        opt, variables = self.opt, self.variables
        self.fn = tf.function(lambda g: opt.apply(g, variables), jit_compile=jit_compile)

    def step(self):
        self.fn(self.grads)

    def sync(self):
        pass  # tf.function calls return once the update ran.

    def state_bytes(self):
        return self.state


class KerasTorchRunner:
    def __init__(self, name, make_opt, params_np, grads):
        import keras

        self.name = name
        self.variables = [keras.Variable(p, name=f"v{i}") for i, p in enumerate(params_np)]
        self.opt = make_opt()
        self.opt.build(self.variables)
        self.state = sum(nbytes_of(v) for v in self.opt.variables)
        self.grads = grads

    def step(self):
        import torch

        with torch.no_grad():
            self.opt.apply(self.grads, self.variables)

    def sync(self):
        pass

    def state_bytes(self):
        return self.state


class KerasTorchBlockedRunner(KerasTorchRunner):
    """Ours with every variable on the CPU path stepped in blocks, none grouped: the neighbour of the
    CPU's grouped-step threshold (`CPU_GROUPED_ELEMENTS`), the row that earns it its place."""

    def step(self):
        from keras_tpu_optim._backend import torch as torch_backend

        threshold, torch_backend.CPU_GROUPED_ELEMENTS = torch_backend.CPU_GROUPED_ELEMENTS, 0
        try:
            super().step()
        finally:
            torch_backend.CPU_GROUPED_ELEMENTS = threshold


class TorchAdafactorRunner:
    def __init__(self, name, params_np, grads_t, foreach):
        import torch

        self.name = name
        self.params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params_np]
        for p, g in zip(self.params, grads_t):
            p.grad = g
        self.opt = torch.optim.Adafactor(self.params, lr=1e-3, foreach=foreach)

    def step(self):
        self.opt.step()

    def sync(self):
        pass

    def state_bytes(self):
        # torch creates its state lazily, on the first step.
        total = 0
        for st in self.opt.state.values():
            for v in st.values():
                if hasattr(v, "nbytes"):
                    total += v.nbytes
        return total


# ---------------------------------------------------------------------- main


def build_runners(backend, params_np, grads_np, skip_peers=False):
    import keras

    import keras_tpu_optim

    ours = keras_tpu_optim.Adafactor
    theirs = keras.optimizers.Adafactor
    runners = []
    if backend == "jax":
        import jax.numpy as jnp

        grads = [jnp.asarray(g) for g in grads_np]
        runners.append(KerasJaxRunner(OURS, ours, params_np, grads))
        if not skip_peers:
            runners.append(KerasJaxRunner(KERAS, theirs, params_np, grads))
            runners.append(OptaxRunner("optax.adafactor", params_np, grads))
    elif backend == "tensorflow":
        import tensorflow as tf

        grads = [tf.constant(g) for g in grads_np]
        runners.append(KerasTFRunner(OURS, ours, params_np, grads, jit_compile=True))
        if not skip_peers:
            runners.append(KerasTFRunner(KERAS, theirs, params_np, grads, jit_compile=True))
        runners.append(KerasTFRunner(OURS + " (no XLA)", ours, params_np, grads, jit_compile=False))
        if not skip_peers:
            runners.append(
                KerasTFRunner(KERAS + " (no XLA)", theirs, params_np, grads, jit_compile=False)
            )
    elif backend == "torch":
        import torch

        grads = [keras.ops.convert_to_tensor(g) for g in grads_np]
        runners.append(KerasTorchRunner(OURS, ours, params_np, grads))
        runners.append(KerasTorchBlockedRunner(OURS + BLOCKED, ours, params_np, grads))
        if not skip_peers:
            runners.append(KerasTorchRunner(KERAS, theirs, params_np, grads))
            tgrads = [torch.from_numpy(g) for g in grads_np]
            runners.append(
                TorchAdafactorRunner("torch.optim.Adafactor", params_np, tgrads, foreach=None)
            )
            runners.append(
                TorchAdafactorRunner(
                    "torch.optim.Adafactor(foreach=True)", params_np, tgrads, foreach=True
                )
            )
    else:
        raise SystemExit(f"unsupported backend {backend!r}")
    return runners


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per optimizer (default 10; 3 with --quick)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    ap.add_argument(
        "--mem-steps",
        type=int,
        default=2,
        help="steps per optimizer for the peak-memory measurement, after the timing (default 2)",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny stack, for smoke tests")
    ap.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 10)

    import keras

    backend = keras.backend.backend()
    shapes = stack_shapes(args.quick)
    n_params = int(sum(np.prod(s) for s in shapes))
    machine = bc.machine_info()
    print(f"Adafactor benchmark — backend {backend}, keras {keras.__version__}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB; load {machine['loadavg']}"
    )
    print(
        f"stack: {'quick' if args.quick else 'BERT-base-like'}, {len(shapes)} variables, "
        f"{n_params / 1e6:.1f}M float32 params; {steps} timed steps after {args.warmup} warm-up\n",
        flush=True,
    )

    bw = bc.memcpy_bandwidth(64 * 2**20 if args.quick else 512 * 2**20)
    floor_ms = BYTES_PER_PARAM * n_params / bw["bytes_moved_per_s_best"] * 1e3
    print(
        f"memcpy bandwidth (numpy, bytes moved = 2 x copied): {bw['gbps']:.1f} GB/s best "
        f"({bw['gbps_median']:.1f} median); "
        f"floor = {BYTES_PER_PARAM} B/param x {n_params / 1e6:.1f}M = {floor_ms:.1f} ms\n",
        flush=True,
    )

    params_np, grads_np = make_arrays(shapes)
    runners = build_runners(backend, params_np, grads_np)
    del params_np
    gc.collect()

    # Warm up (compile) every runner, then interleave the timed steps so that
    # load changes on a shared machine hit every optimizer alike. The RSS a
    # runner's warm-up adds is recorded: it holds what a step keeps once made
    # (lazily created state, a persistent scratch buffer) and, on JAX and TF
    # with XLA, compilation.
    warmup_growth = {}
    for r in runners:
        print(f"warming up {r.name} ...", flush=True)
        gc.collect()
        rss0 = bc.rss_bytes()
        for _ in range(args.warmup):
            r.step()
            r.sync()
        gc.collect()
        warmup_growth[r.name] = (bc.rss_bytes() - rss0) / 2**20
    import time

    times = {r.name: [] for r in runners}
    for _ in range(steps):
        for r in runners:
            t0 = time.perf_counter()
            r.step()
            r.sync()
            times[r.name].append((time.perf_counter() - t0) * 1e3)

    # Peak memory of a step: one optimizer at a time (others idle, so their
    # temporaries cannot mix in), RSS above the RSS just before its steps.
    peaks = {}
    for r in runners:
        gc.collect()
        mem = bc.PeakRSS()
        mem.baseline()
        mem.start()
        for _ in range(args.mem_steps):
            r.step()
            r.sync()
        peaks[r.name] = mem.stop()
        print(
            f"peak memory of a step, {r.name}: +{peaks[r.name]['peak_delta_mb']:.0f} MB "
            f"({peaks[r.name]['method']}); warm-up added {warmup_growth[r.name]:.0f} MB",
            flush=True,
        )

    results = {}
    for r in runners:
        ts = times[r.name]
        med = float(np.median(ts))
        results[r.name] = {
            "state_bytes": r.state_bytes(),
            "state_over_params": r.state_bytes() / (4 * n_params),
            "median_ms": med,
            "min_ms": float(min(ts)),
            "max_ms": float(max(ts)),
            "steps_ms": [round(t, 3) for t in ts],
            "over_floor": med / floor_ms,
            "peak_delta_mb": peaks[r.name]["peak_delta_mb"],
            "rss_before_mb": peaks[r.name]["rss_before_mb"],
            "peak_method": peaks[r.name]["method"],
            "warmup_rss_growth_mb": warmup_growth[r.name],
        }
    print()
    bc.print_table(
        f"Adafactor on {backend}: {n_params / 1e6:.1f}M params, median of {steps} steps",
        [
            "optimizer",
            "state/params",
            "step ms (median)",
            "min",
            "max",
            "x floor",
            "step peak MB",
            "warm-up MB",
        ],
        [
            [
                n,
                bc.fmt(v["state_over_params"], ".4f"),
                bc.fmt(v["median_ms"], ".1f"),
                bc.fmt(v["min_ms"], ".1f"),
                bc.fmt(v["max_ms"], ".1f"),
                bc.fmt(v["over_floor"], ".2f"),
                bc.fmt(v["peak_delta_mb"], ".0f"),
                bc.fmt(v["warmup_rss_growth_mb"], ".0f"),
            ]
            for n, v in results.items()
        ]
        + [["memory-bandwidth floor", "-", bc.fmt(floor_ms, ".1f"), "", "", "1.00", "", ""]],
    )
    print(
        "step peak MB: RSS during the step above the RSS before it, one optimizer at a time after the timing; "
        "warm-up MB: RSS the warm-up steps added (persistent buffers, lazily created state, compilation).\n",
        flush=True,
    )

    ours = results[OURS]
    ratios = []
    for name, v in results.items():
        if name.startswith(OURS):
            continue
        mine = results[OURS + " (no XLA)"] if name.endswith("(no XLA)") else ours
        ratios.append(
            {
                "ours": OURS + (" (no XLA)" if name.endswith("(no XLA)") else ""),
                "peer": name,
                "time_ratio": mine["median_ms"] / v["median_ms"],
                "state_ratio": (mine["state_bytes"] / v["state_bytes"])
                if v["state_bytes"]
                else None,
            }
        )
    if OURS + BLOCKED in results:
        blocked = results[OURS + BLOCKED]
        ratios.append(
            {
                "ours": OURS,
                "peer": OURS + BLOCKED,
                "time_ratio": ours["median_ms"] / blocked["median_ms"],
                "state_ratio": ours["state_bytes"] / blocked["state_bytes"],
            }
        )
    bc.print_table(
        "Ratios, ours / peer (lower is better)",
        ["ours", "peer", "step time", "state"],
        [[x["ours"], x["peer"], bc.fmt(x["time_ratio"]), bc.fmt(x["state_ratio"])] for x in ratios],
    )

    def ratio_to(peer):
        return next((x["time_ratio"] for x in ratios if x["peer"] == peer), None)

    targets = [bc.target("state/params", ours["state_over_params"], 0.003)]
    targets.append(
        bc.target(
            f"step / {KERAS}", ratio_to(KERAS), 0.6, "XLA path" if backend == "tensorflow" else ""
        )
    )
    if backend == "tensorflow":
        targets.append(
            bc.target(
                f"step / {KERAS} (no XLA)",
                ratio_to(KERAS + " (no XLA)"),
                0.6,
                "fit's path on CPU-only machines",
            )
        )
    if backend == "jax":
        targets.append(bc.target("step / optax.adafactor", ratio_to("optax.adafactor"), 0.8))
    if backend == "torch":
        t1, t2 = ratio_to("torch.optim.Adafactor"), ratio_to("torch.optim.Adafactor(foreach=True)")
        cands = [t for t in (t1, t2) if t is not None]
        targets.append(
            bc.target(
                "step / torch.optim.Adafactor",
                max(cands) if cands else None,
                1.0,
                "vs the faster of foreach=None/True",
            )
        )
        targets.append(
            bc.target(
                "step / ours with every variable blocked",
                ratio_to(OURS + BLOCKED),
                1.0,
                "the CPU's grouped step for variables of at most 2^15 elements",
            )
        )
    if backend in ("jax", "tensorflow"):
        targets.append(bc.target("step / bandwidth floor", ours["over_floor"], 2.0))
    bc.print_targets(targets)

    bc.write_json(
        args.json,
        {
            "bench": "adafactor",
            "backend": backend,
            "keras": keras.__version__,
            "quick": args.quick,
            "machine": machine,
            "n_params": n_params,
            "steps": steps,
            "warmup": args.warmup,
            "bandwidth": bw,
            "bytes_per_param": BYTES_PER_PARAM,
            "floor_ms": floor_ms,
            "results": results,
            "ratios": ratios,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
