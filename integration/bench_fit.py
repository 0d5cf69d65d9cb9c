"""End-to-end `fit` benchmark: peak memory and step time of a whole training step, per optimizer.

A GPT-2-shaped language model built from Keras layers (token + position
embedding, 2 pre-LayerNorm blocks of MultiHeadAttention(12 heads) and a
3072-wide MLP, width 768, vocabulary 32000, LM head tied to the token
embedding: 38.8M float32 parameters, 155 MB) trains with `model.fit` on a
fixed synthetic dataset (a random bigram language), batch 2 x 128 tokens.

Each optimizer runs in its own subprocess (so that one's allocations cannot
hide another's peak): SGD, keras_tpu_optim.Adafactor, keras.optimizers.Adafactor
and keras.optimizers.Adam. In each, after the model is built and compiled and
`--warmup` steps ran (compilation, lazily created state, a persistent scratch
buffer), the RSS is the baseline; the peak RSS above it over the `--steps`
measured steps of one more `fit` (VmHWM, reset through /proc/self/clear_refs,
and a sampling thread) is the "step peak": what a training step allocates and
frees. The "fit peak" is the peak over the warm-up and the measured steps
above the RSS of the built model: it adds what the first steps keep (compiled
code and the compiler's freed-but-retained heap, optimizer state, a persistent
scratch, allocator pools). "warm-up MB" is what the warm-up added (noisy). The
target of issue 13: ours' peak <= SGD's + 0.25 x the parameter bytes, checked
on both.

Then bfloat16 weights (`keras.config.set_dtype_policy("bfloat16")`, so the
variables themselves are bfloat16): ours with and without
`stochastic_rounding=True`, learning rate 0.01, `--bf16-steps` steps on the
same data, beside float32 weights with the same settings; step time and the
loss on fixed held-out batches after training.

The parent process imports no framework; each worker imports one backend
(KERAS_BACKEND), so TensorFlow and torch never share a process. Backends:
`--backends` (default: KERAS_BACKEND if set, else all three). Not a test:
nothing is asserted.

Usage:
    KERAS_BACKEND=jax python integration/bench_fit.py [--steps 6] [--quick] [--json out.json]
    python integration/bench_fit.py --backends tensorflow,jax,torch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
# Measure the checkout this script belongs to, whatever keras_tpu_optim is installed.
sys.path.insert(1, os.path.dirname(HERE))
BACKENDS = ("tensorflow", "jax", "torch")
SGD, OURS, KERAS, ADAM = (
    "keras.optimizers.SGD",
    "keras_tpu_optim.Adafactor",
    "keras.optimizers.Adafactor",
    "keras.optimizers.Adam",
)
# The rounding comparison: learning rate 0.01 (the demo's), float32 as the reference.
OURS_F32_REF = "ours(lr=0.01), float32 weights"
OURS_BF16 = "ours(lr=0.01), bf16 weights"
OURS_BF16_SR = "ours(lr=0.01, stochastic_rounding=True), bf16 weights"
ROUNDING_RUNS = (OURS_F32_REF, OURS_BF16, OURS_BF16_SR)
MEMORY_RUNS = (SGD, OURS, KERAS, ADAM)
TARGET_FRACTION = 0.25  # ours' step peak <= SGD's + 0.25 x param bytes


def shape_of(quick: bool) -> dict:
    if quick:
        return dict(vocab=256, seq=16, width=32, heads=2, ff=64, layers=1, batch=2)
    return dict(vocab=32000, seq=128, width=768, heads=12, ff=3072, layers=2, batch=2)


# ------------------------------------------------------------------- worker


def _layers():
    import keras
    from keras import ops

    class ReversibleEmbedding(keras.layers.Embedding):
        """A token embedding that also computes the tied LM head (`reverse=True`: logits over the vocabulary)."""

        def call(self, inputs, reverse=False):
            if reverse:
                return ops.matmul(inputs, ops.transpose(ops.cast(self.embeddings, inputs.dtype)))
            return super().call(inputs)

        def compute_output_spec(self, inputs, reverse=False):
            if reverse:
                return keras.KerasTensor(
                    tuple(inputs.shape[:-1]) + (self.input_dim,), dtype=inputs.dtype
                )
            return super().compute_output_spec(inputs)

    class PositionEmbedding(keras.layers.Layer):
        def build(self, input_shape):
            self.positions = self.add_weight(
                shape=tuple(input_shape[1:]),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
                name="positions",
            )

        def call(self, x):
            return x + ops.cast(self.positions, x.dtype)

    return ReversibleEmbedding, PositionEmbedding


def build_model(s: dict):
    import keras

    ReversibleEmbedding, PositionEmbedding = _layers()
    keras.utils.set_random_seed(0)
    tokens = keras.Input((s["seq"],), dtype="int32")
    embedding = ReversibleEmbedding(
        s["vocab"],
        s["width"],
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
        name="token_embedding",
    )
    x = PositionEmbedding(name="position_embedding")(embedding(tokens))
    for i in range(s["layers"]):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(
            s["heads"], s["width"] // s["heads"], name=f"block{i}_attention"
        )(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(s["ff"], activation="gelu", name=f"block{i}_mlp_in")(h)
        x = x + keras.layers.Dense(s["width"], name=f"block{i}_mlp_out")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = embedding(x, reverse=True)
    return keras.Model(tokens, logits, name="gpt2_shaped")


def dataset(s: dict, n_batches: int, seed: int = 0):
    """A random bigram language (each token has 4 likely successors): `(inputs, targets)`, int32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    successors = np.random.default_rng(1234).integers(0, s["vocab"], size=(s["vocab"], 4))
    n = n_batches * s["batch"]
    tokens = np.empty((n, s["seq"] + 1), dtype="int32")
    tokens[:, 0] = rng.integers(0, s["vocab"], size=n)
    for t in range(s["seq"]):
        tokens[:, t + 1] = successors[tokens[:, t], rng.integers(0, 4, size=n)]
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(name: str):
    import keras

    import keras_tpu_optim

    if name == SGD:
        return keras.optimizers.SGD(learning_rate=0.01)
    if name == OURS:
        return keras_tpu_optim.Adafactor()
    if name in (OURS_F32_REF, OURS_BF16):
        return keras_tpu_optim.Adafactor(learning_rate=0.01)
    if name == OURS_BF16_SR:
        return keras_tpu_optim.Adafactor(learning_rate=0.01, stochastic_rounding=True)
    if name == KERAS:
        return keras.optimizers.Adafactor()
    if name == ADAM:
        return keras.optimizers.Adam(1e-4)
    raise ValueError(name)


def _jax_step_temp_mb(model, x, y):
    """The temporaries XLA's buffer assignment gives the compiled train step (what it needs besides its
    inputs and outputs), MB: the step's memory on a device, without the host's compiler heap."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def worker(
    name: str, quick: bool, steps: int, warmup: int, release_compile_heap: bool = False
) -> dict:
    import keras
    import numpy as np

    if release_compile_heap and keras.backend.backend() == "jax":
        import cpu_tuning

        cpu_tuning.release_compile_heap()  # in every optimizer's process alike, SGD's included

    if name in (OURS_BF16, OURS_BF16_SR):
        keras.config.set_dtype_policy("bfloat16")
    s = shape_of(quick)
    b = s["batch"]
    x, y = dataset(s, warmup + steps)
    x_eval, y_eval = dataset(s, 4, seed=1)
    model = build_model(s)
    n_params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    param_bytes = int(
        sum(
            np.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in model.trainable_variables
        )
    )
    optimizer = make_optimizer(name)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )

    losses, seconds = [], []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))  # waits for the step
            seconds.append(time.perf_counter() - self._t0)

    gc.collect()
    # The whole fit's peak, from the built model: what the warm-up steps keep (compiled code,
    # lazily created state, allocator pools) and what the steps allocate.
    warm = bc.PeakRSS()
    warm.baseline()
    warm.start()
    model.fit(x[: warmup * b], y[: warmup * b], batch_size=b, epochs=1, shuffle=False, verbose=0)
    warm_peak = warm.stop()
    gc.collect()
    # The steps' peak, from the RSS after the warm-up: what a step allocates and frees.
    mem = bc.PeakRSS()
    mem.baseline()
    warmup_mb = (mem._base - warm._base) / 2**20
    mem.start()
    model.fit(
        x[warmup * b :],
        y[warmup * b :],
        batch_size=b,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Timer()],
    )
    peak = mem.stop()
    fit_peak_mb = max(warm_peak["peak_rss_mb"], peak["peak_rss_mb"]) - warm_peak["rss_before_mb"]
    eval_loss = float(model.evaluate(x_eval, y_eval, batch_size=b, verbose=0))
    xla_temp_mb = (
        _jax_step_temp_mb(model, x[:b], y[:b]) if keras.backend.backend() == "jax" else None
    )
    state_bytes = int(
        sum(
            np.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in optimizer.variables
        )
    )
    # The first measured step may pay for a new iterator: the median is over the others.
    steady = seconds[1:] or seconds
    return {
        "name": name,
        "backend": keras.backend.backend(),
        "n_params": n_params,
        "param_bytes": param_bytes,
        "dtype": keras.backend.standardize_dtype(model.trainable_variables[0].dtype),
        "state_bytes": state_bytes,
        "median_ms": statistics.median(steady) * 1e3,
        "steps_ms": [round(t * 1e3, 1) for t in seconds],
        "losses": losses,
        "eval_loss": eval_loss,
        "peak_delta_mb": peak["peak_delta_mb"],
        "rss_before_mb": peak["rss_before_mb"],
        "peak_method": peak["method"],
        "warmup_rss_growth_mb": warmup_mb,
        "fit_peak_mb": fit_peak_mb,
        "xla_temp_mb": xla_temp_mb,
    }


# ------------------------------------------------------------------- parent


def run_worker(backend, name, args) -> dict:
    steps = args.bf16_steps if name in ROUNDING_RUNS else args.steps
    if args.in_process:
        return _run_in_process(backend, name, steps, args)
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            name,
            "--steps",
            str(steps),
            "--warmup",
            str(args.warmup),
        ]
        + (["--quick"] if args.quick else [])
        + (["--release-compile-heap"] if args.release_compile_heap else [])
    )
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if proc.returncode != 0 or result is None:
        tail = (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()
        print(f"  {backend} / {name}: FAILED (rc {proc.returncode})\n{tail}", flush=True)
        return {"name": name, "backend": backend, "error": f"rc {proc.returncode}: {tail[-300:]}"}
    print(
        f"  {backend} / {name}: {result['median_ms']:.0f} ms/step, step peak +{result['peak_delta_mb']:.0f} MB, "
        f"fit peak +{result['fit_peak_mb']:.0f} MB, "
        f"warm-up +{result['warmup_rss_growth_mb']:.0f} MB, eval loss {result['eval_loss']:.4f} "
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    return result


def _run_in_process(backend, name, steps, args) -> dict:
    """The worker in this process (`--in-process`: a smoke test of the code paths, not a measurement)."""
    import keras

    if backend != keras.backend.backend():
        raise SystemExit(
            f"--in-process runs on this process's backend ({keras.backend.backend()}), not {backend}"
        )
    policy = keras.config.dtype_policy()
    keras.backend.clear_session()
    try:
        result = worker(name, args.quick, steps, args.warmup)
    finally:
        keras.config.set_dtype_policy(policy)
        keras.backend.clear_session()
    print(f"  {backend} / {name}: {result['median_ms']:.0f} ms/step (in process)", flush=True)
    return result


def _median_of(records, key):
    values = [r[key] for r in records if "error" not in r and r.get(key) is not None]
    return statistics.median(values) if values else None


def report(backend, runs: dict) -> dict:
    """Tables and the target for one backend; `runs[name]` lists that optimizer's records (one per round)."""
    med = {
        name: {
            k: _median_of(rs, k)
            for k in (
                "median_ms",
                "peak_delta_mb",
                "fit_peak_mb",
                "warmup_rss_growth_mb",
                "eval_loss",
                "xla_temp_mb",
            )
        }
        for name, rs in runs.items()
    }
    ok = next(
        (r for rs in runs.values() for r in rs if "error" not in r and r["dtype"] == "float32"),
        None,
    )
    param_mb = ok["param_bytes"] / 2**20 if ok else None
    n_params = ok["n_params"] if ok else None

    def above_sgd(name, key):
        """(name's figure - SGD's) / param bytes."""
        mine, sgd = med.get(name, {}).get(key), med.get(SGD, {}).get(key)
        return None if mine is None or sgd is None or not param_mb else (mine - sgd) / param_mb

    rows = []
    for name in MEMORY_RUNS:
        m = med.get(name)
        if not m or m["median_ms"] is None:
            rows.append([name] + ["error"] * 8)
            continue
        rows.append(
            [
                name,
                bc.fmt(m["median_ms"], ".0f"),
                bc.fmt(m["peak_delta_mb"], ".0f"),
                bc.fmt(above_sgd(name, "peak_delta_mb"), "+.2f"),
                bc.fmt(m["fit_peak_mb"], ".0f"),
                bc.fmt(above_sgd(name, "fit_peak_mb"), "+.2f"),
                bc.fmt(m["warmup_rss_growth_mb"], ".0f"),
                bc.fmt(m["eval_loss"], ".4f"),
                bc.fmt(m["xla_temp_mb"], ".1f"),
            ]
        )
    rounds = max(len(rs) for rs in runs.values())
    bc.print_table(
        f"fit on {backend}: GPT-2-shaped LM, {bc.fmt(n_params and n_params / 1e6, '.1f')}M params "
        f"({bc.fmt(param_mb, '.0f')} MB float32), median over {rounds} round(s)",
        [
            "optimizer",
            "step ms",
            "step peak MB",
            "- SGD's, x params",
            "fit peak MB",
            "- SGD's, x params",
            "warm-up MB",
            "eval loss",
            "XLA temp MB",
        ],
        rows,
    )
    print(
        "step peak: RSS over the measured steps above the RSS after the warm-up (what a step allocates and "
        "frees); fit peak: over warm-up and steps above the RSS of the built model (adds what the first steps "
        "keep: compiled code, optimizer state, allocator pools); x params: over the float32 parameter bytes; XLA "
        "temp MB (JAX): the compiled train step's temporaries from XLA's buffer assignment.\n",
        flush=True,
    )

    def ratio(a, b, key):
        x, y = med.get(a, {}).get(key), med.get(b, {}).get(key)
        return None if x is None or y is None or y == 0 else x / y

    ratios = [
        {
            "peer": p,
            "time_ratio": ratio(OURS, p, "median_ms"),
            "peak_ratio": ratio(OURS, p, "peak_delta_mb"),
            "fit_peak_ratio": ratio(OURS, p, "fit_peak_mb"),
        }
        for p in (SGD, KERAS, ADAM)
    ]
    bc.print_table(
        "Ratios, ours / peer (lower is better)",
        ["peer", "step time", "step peak", "fit peak"],
        [
            [
                x["peer"],
                bc.fmt(x["time_ratio"]),
                bc.fmt(x["peak_ratio"]),
                bc.fmt(x["fit_peak_ratio"]),
            ]
            for x in ratios
        ],
    )

    targets = [
        bc.target(
            "ours peak <= SGD + 0.25x params",
            above_sgd(OURS, "peak_delta_mb"),
            TARGET_FRACTION,
            "(ours' step peak - SGD's) / param bytes",
        ),
        bc.target(
            "ours fit peak <= SGD + 0.25x params",
            above_sgd(OURS, "fit_peak_mb"),
            TARGET_FRACTION,
            "the same from the built model: compilation and kept buffers included",
        ),
    ]
    bc.print_targets(targets)

    bf16 = [
        [
            name,
            bc.fmt(med[name]["median_ms"], ".0f"),
            bc.fmt(med[name]["eval_loss"], ".4f"),
            bc.fmt(med[name]["peak_delta_mb"], ".0f"),
        ]
        for name in ROUNDING_RUNS
        if name in med
    ]
    if bf16:
        bc.print_table(
            f"bfloat16 weights on {backend}: ours, round to nearest vs stochastic rounding "
            f"(eval loss after the same steps on the same data)",
            ["optimizer", "step ms", "eval loss", "step peak MB"],
            bf16,
        )
    return {
        "medians": med,
        "ratios": ratios,
        "targets": targets,
        "param_mb": param_mb,
        "n_params": n_params,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps", type=int, default=None, help="measured steps per run (default 6; 3 with --quick)"
    )
    ap.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="measured steps of the bfloat16 runs (default 24; 3 with --quick): enough for rounding to show",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="fit steps before the measurement (compilation, lazy state)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every optimizer this many times, alternating; medians",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny model, for smoke tests")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 runs")
    ap.add_argument(
        "--backends", default=None, help="comma-separated (default: KERAS_BACKEND, else all three)"
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated optimizer names to run (default: all)"
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run every optimizer in this process (smoke tests: one process's memory is shared, "
        "so its figures are no measurement)",
    )
    ap.add_argument(
        "--release-compile-heap",
        action="store_true",
        help="JAX: call cpu_tuning.release_compile_heap() in every worker (each optimizer's "
        "process alike)",
    )
    ap.add_argument("--json", default=None, help="write the results as JSON to this path")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 6)
    args.bf16_steps = (
        args.bf16_steps if args.bf16_steps is not None else (args.steps if args.quick else 24)
    )

    if args.worker:
        print(
            "RESULT "
            + json.dumps(
                worker(args.worker, args.quick, args.steps, args.warmup, args.release_compile_heap),
                default=float,
            ),
            flush=True,
        )
        return 0

    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        backends = (
            [os.environ["KERAS_BACKEND"]] if os.environ.get("KERAS_BACKEND") else list(BACKENDS)
        )
    names = list(MEMORY_RUNS) + ([] if args.no_bf16 else list(ROUNDING_RUNS))
    if args.only:
        names = [n for n in names if n in args.only.split(",")] or names
        for required in (SGD, OURS):
            if required not in names:
                names.insert(0, required)
    machine = bc.machine_info()
    s = shape_of(args.quick)
    print(
        f"fit benchmark — backends {', '.join(backends)}; model {s}; {args.warmup} warm-up + {args.steps} "
        f"measured steps ({args.bf16_steps} for bf16); {args.rounds} round(s)"
    )
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB; load {machine['loadavg']}\n",
        flush=True,
    )
    payload = {
        "bench": "fit",
        "quick": args.quick,
        "machine": machine,
        "model": s,
        "steps": args.steps,
        "bf16_steps": args.bf16_steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "backends": {},
    }
    for backend in backends:
        runs = {n: [] for n in names}
        for k in range(args.rounds):
            order = (
                names if k % 2 == 0 else names[::-1]
            )  # alternate, so drifting load hits all alike
            for name in order:
                runs[name].append(run_worker(backend, name, args))
        print()
        summary = report(backend, runs)
        payload["backends"][backend] = dict(summary, runs=runs)
    # run_benchmarks.py-style fields for a single backend.
    if len(backends) == 1:
        payload["backend"] = backends[0]
        payload["targets"] = payload["backends"][backends[0]]["targets"]
    bc.write_json(args.json, payload)
    failed = [
        r
        for b in payload["backends"].values()
        for rs in b["runs"].values()
        for r in rs
        if "error" in r
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
