"""Run the benchmarks on TensorFlow, JAX and torch and write the report.

Each (benchmark, backend) pair runs in its own process with KERAS_BACKEND set
(TensorFlow and torch never share a process). The scripts write JSON; this
script collects it into `integration/results/benchmarks.md` (markdown tables of
ratios against the peers, with the date and the machine) and
`integration/results/benchmarks.png` (bar chart of the step-time ratios). With
`--quick` everything is small and goes to `integration/results/quick/` so a smoke
run never overwrites the real report. On JAX the step and `fit` benchmarks run once
more with the process-wide tunings of `cpu_tuning.py` (`TUNED`).

Usage:
    python integration/run_benchmarks.py [--quick] [--backends tensorflow,jax,torch]
        [--steps N] [--sizes 100k,1M,10M] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
import bench_common as bc  # noqa: E402  (the script's folder is on sys.path)

BACKENDS = ("tensorflow", "jax", "torch")
BENCHES = (
    "adafactor",
    "embedding_adam",
    "embedding_options",
    "fit",
    "recommender",
    "half_width",
    "memory_wall",
    "criteo",
    "torch_launches",
)
# Benchmarks of one backend's own concern: run on that backend alone.
ONLY_ON = {"torch_launches": "torch", "memory_wall": "jax"}
PASS = {True: "PASS", False: "**MISS**", None: "n/a"}
# JAX again with the process-wide tunings of `cpu_tuning.py` (the defaults change nothing process-wide):
# (bench, the script's extra arguments, the JSON's name).
TUNED = (
    (
        "embedding_adam",
        ["--only", "[BCOO]", "--sizes", "1M,10M", "--interleave", "--huge-pages"],
        "embedding_adam_jax_tuned",
    ),
    ("fit", ["--release-compile-heap", "--no-bf16"], "fit_jax_tuned"),
)


def run_all(args, out_dir):
    """Run every (bench, backend) in a subprocess; return {(bench, backend): returncode}.

    The scripts' output is printed, not kept: the report is generated from the JSON files alone.
    """
    runs = [
        (bench, backend, [], f"{bench}_{backend}")
        for backend in args.backends
        for bench in BENCHES
        if ONLY_ON.get(bench, backend) == backend
    ]
    if "jax" in args.backends and not args.quick:
        runs += [(bench, "jax", extra, name) for bench, extra, name in TUNED]
    status = {}
    for bench, backend, extra, name in runs:
        json_path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(json_path):
            os.remove(json_path)
        cmd = [sys.executable, os.path.join(HERE, f"bench_{bench}.py"), "--json", json_path, *extra]
        if args.quick:
            cmd.append("--quick")
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.sizes and bench == "embedding_adam" and not extra:
            cmd += ["--sizes", args.sizes]
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        print(f"\n===== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        returncode = subprocess.run(cmd, env=env, check=False).returncode
        status[(bench, backend) if not extra else (name, backend)] = returncode
        print(f"===== {name}: exit {returncode} after {time.time() - t0:.0f} s", flush=True)
    return status


def load_results(out_dir):
    res = {}
    names = [(bench, backend, f"{bench}_{backend}") for bench in BENCHES for backend in BACKENDS]
    names += [(name, "jax", name) for _, _, name in TUNED]
    for key_bench, backend, name in names:
        p = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                res[(key_bench, backend)] = json.load(f)
    return res


def _size(n):
    if n >= 10**6 and n % 10**6 == 0:
        return f"{n // 10**6}M"
    if n >= 10**3 and n % 10**3 == 0:
        return f"{n // 10**3}k"
    return str(n)


def _f(x, spec=".3f"):
    return bc.fmt(x, spec)


def _md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(results, status, path, quick):
    machine = next((r["machine"] for r in results.values()), bc.machine_info())
    keras_version = next((r.get("keras") for r in results.values() if r.get("keras")), "?")
    lines = [
        "# Benchmarks" + (" (quick smoke run: tiny sizes, figures meaningless)" if quick else ""),
        "",
        f"Measured {machine['date'][:10]} ({machine['date']}) on **{machine['cpu']}, {machine['cores']} cores**, "
        f"{machine['mem_gib']} GiB RAM; {machine['platform']}, Python {machine['python']}, keras {keras_version}. "
        "Each benchmark ran on each backend in its own process (`python integration/run_benchmarks.py`). "
        "Step times are medians; ratios are ours / peer, lower is better. A CPU-only machine: the figures "
        "describe the CPU paths.",
        "",
    ]
    loads = sorted(
        {
            tuple(round(x, 1) for x in r["machine"]["loadavg"])
            for r in results.values()
            if r["machine"].get("loadavg")
        }
    )
    if loads:
        lines += [
            f"Load average (1/5/15 min) when each run started: {', '.join(str(l) for l in loads)}.",
            "",
        ]
    failed = [f"{b} on {k}" for (b, k), rc in status.items() if rc != 0]
    if failed:
        lines += [
            f"**Runs that failed:** {', '.join(failed)} (their output went to the terminal of the run).",
            "",
        ]

    # ---------------------------------------------------------------- Adafactor
    af = [(k, results[("adafactor", k)]) for k in BACKENDS if ("adafactor", k) in results]
    if af:
        any_r = af[0][1]
        lines += [
            "## Adafactor",
            "",
            f"BERT-base-like stack (a 32000x768 embedding, then 12 x [768x2304 + 2304, 768x768 + 768, 768x3072 + 3072, 3072x768 + 768, 2 x 768]): {any_r['n_params'] / 1e6:.1f}M float32 parameters, random-normal "
            f"gradients; median of {any_r['steps']} steps after {any_r['warmup']} warm-up, all optimizers of a "
            "backend interleaved step by step. Keras optimizers run as Keras's trainers run them: JAX "
            "`jax.jit(stateless_apply, donate_argnums=(0, 2))`, TF `tf.function(apply, jit_compile=True)` "
            "(Keras with an accelerator) and without XLA (what `fit` runs on a CPU-only machine; ours then compiles each variable's update with XLA), torch eager `apply`. `optax.adafactor(learning_rate=1e-3, "
            "min_dim_size_to_factor=1, decay_rate=0.8, eps=1e-30, clipping_threshold=1.0)` (Keras's defaults); "
            "`torch.optim.Adafactor(lr=1e-3)`. Floor: "
            f"{any_r['bytes_per_param']} B/param over the copy bandwidth measured in the run (numpy). "
            "Step peak MB: after the timing, each optimizer alone runs a few steps; the peak RSS above the RSS "
            "just before them (what a step allocates and frees). Warm-up MB: the RSS each optimizer's warm-up "
            "steps added (what a step keeps: a persistent scratch buffer, state created on the first step, "
            "compiled code); noisy, since allocators keep freed memory.",
            "",
        ]
        rows = []
        for k, r in af:
            for name, v in r["results"].items():
                rows.append(
                    [
                        k,
                        f"`{name}`",
                        _f(v["state_over_params"], ".4f"),
                        _f(v["median_ms"], ".1f"),
                        _f(v["over_floor"], ".2f"),
                        _f(v.get("peak_delta_mb"), ".0f"),
                        _f(v.get("warmup_rss_growth_mb"), ".0f"),
                    ]
                )
            rows.append(
                [
                    k,
                    "memory-bandwidth floor",
                    "—",
                    _f(r["floor_ms"], ".1f") + f" ({r['bandwidth']['gbps']:.0f} GB/s)",
                    "1.00",
                    "",
                    "",
                ]
            )
        lines += [
            "### Step time, state and memory",
            "",
            _md_table(
                [
                    "backend",
                    "optimizer",
                    "state / params",
                    "step ms",
                    "x floor",
                    "step peak MB",
                    "warm-up MB",
                ],
                rows,
            ),
            "",
        ]
        rows = [
            [k, f"`{x['ours']}`", f"`{x['peer']}`", _f(x["time_ratio"]), _f(x["state_ratio"])]
            for k, r in af
            for x in r["ratios"]
        ]
        lines += [
            "### Ratios, ours / peer",
            "",
            _md_table(["backend", "ours", "peer", "step time", "state"], rows),
            "",
        ]
        rows = [
            [
                k,
                t["target"],
                _f(t["value"], ".4g"),
                f"≤ {t['threshold']:g}",
                PASS[t["pass"]],
                t.get("note", ""),
            ]
            for k, r in af
            for t in r["targets"]
        ]
        header = ["backend", "target", "measured", "goal", "result", "note"]
        lines += ["### Targets", "", _md_table(header, rows), ""]

    # ------------------------------------------------------------ EmbeddingAdam
    ea = [(k, results[("embedding_adam", k)]) for k in BACKENDS if ("embedding_adam", k) in results]
    if ea:
        any_r = ea[0][1]
        lines += [
            "## EmbeddingAdam",
            "",
            f"A float32 table of V rows x {any_r['dim']}, {any_r['ids']} ids a step (about a quarter duplicates), "
            "learning rate 1e-3. TF: `tf.IndexedSlices` gradient, both optimizers in `tf.function` with and "
            "without XLA; `torch.optim.SparseAdam` on the same ids in a torch-only subprocess. JAX: dense "
            "gradient, `jax.jit(stateless_apply, donate_argnums=(0, 2))`, and ours also on a "
            "`jax.experimental.sparse.BCOO` gradient of the same ids under the same jit (against Adam on the dense "
            "gradient; only where the measured keras_tpu_optim accepts BCOO gradients). torch: dense gradient (Keras's torch "
            "backend) and a sparse COO gradient. Peak memory: process RSS during the timed steps above the RSS "
            "after the warm-up steps (what a step adds to the state).",
            "",
        ]
        for k, r in ea:
            sizes = r["sizes"]
            names = list(dict.fromkeys(x["name"] for x in r["records"]))

            def cell(name, s, key, spec, r=r):
                for x in r["records"]:
                    if x["name"] == name and x["rows"] == s:
                        return "error" if "error" in x else _f(x[key], spec)
                return "—"

            lines += [f"### {k}", ""]
            rows = [
                [f"`{n}`"]
                + [cell(n, s, "median_ms", ".2f") for s in sizes]
                + [cell(n, s, "peak_delta_mb", ".0f") for s in sizes]
                for n in names
            ]
            lines += [
                _md_table(
                    ["optimizer"]
                    + [f"ms @{_size(s)}" for s in sizes]
                    + [f"peak MB @{_size(s)}" for s in sizes],
                    rows,
                ),
                "",
            ]
            pairs = list(dict.fromkeys((x["ours"], x["peer"]) for x in r["ratios"]))
            rows = [
                [f"`{m}`", f"`{p}`"]
                + [
                    _f(
                        next(
                            (
                                x["time_ratio"]
                                for x in r["ratios"]
                                if x["ours"] == m and x["peer"] == p and x["rows"] == s
                            ),
                            None,
                        )
                    )
                    for s in sizes
                ]
                for m, p in pairs
            ]
            lines += [
                "Ratios, ours / peer step time:",
                "",
                _md_table(["ours", "peer"] + [_size(s) for s in sizes], rows),
                "",
            ]
            if r.get("skipped"):
                lines += ["Skipped: " + "; ".join(s["reason"] for s in r["skipped"]), ""]
            errs = [x for x in r["records"] if "error" in x]
            if errs:
                lines += [
                    "Errors: "
                    + "; ".join(f"`{x['name']}` @{_size(x['rows'])}: {x['error']}" for x in errs),
                    "",
                ]
        rows = [
            [
                k,
                t["target"],
                _f(t["value"], ".4g"),
                f"≤ {t['threshold']:g}",
                PASS[t["pass"]],
                t.get("note", ""),
            ]
            for k, r in ea
            for t in r["targets"]
        ]
        header = ["backend", "target", "measured", "goal", "result", "note"]
        lines += ["### Targets", "", _md_table(header, rows), ""]

    lines += _options_section(results)
    # --------------------------------------------------------------------- fit
    ft = [(k, results[("fit", k)]) for k in BACKENDS if ("fit", k) in results]
    if ft:
        any_r = ft[0][1]
        lines += [
            "## Peak memory of a `fit` step",
            "",
            f"`integration/bench_fit.py`: a GPT-2-shaped LM from Keras layers ({any_r['model']}), tied LM head, "
            f"`model.fit` on a synthetic bigram language; {any_r['warmup']} warm-up + {any_r['steps']} measured "
            "steps, each optimizer in its own process. Step peak: RSS above the RSS after the warm-up; fit peak: "
            "above the RSS of the built model (compilation, optimizer state and allocator pools included). "
            "'x params': (figure - SGD's) / float32 parameter bytes. XLA temp MB (JAX): the temporaries XLA's "
            "buffer assignment gives the compiled train step (the step's memory on a device, without the host's "
            "compiler heap).",
            "",
        ]
        rows = []
        for k, r in ft:
            b = r["backends"][k]
            for name, m in b["medians"].items():
                if m.get("median_ms") is None:
                    continue
                sgd = b["medians"].get("keras.optimizers.SGD", {})
                above = lambda key, m=m, sgd=sgd, b=b: (  # noqa: E731
                    None
                    if sgd.get(key) is None or not b["param_mb"]
                    else (m[key] - sgd[key]) / b["param_mb"]
                )
                rows.append(
                    [
                        k,
                        f"`{name}`",
                        _f(m["median_ms"], ".0f"),
                        _f(m["peak_delta_mb"], ".0f"),
                        _f(above("peak_delta_mb"), "+.2f"),
                        _f(m.get("fit_peak_mb"), ".0f"),
                        _f(above("fit_peak_mb"), "+.2f"),
                        _f(m["eval_loss"], ".4f"),
                        _f(m.get("xla_temp_mb"), ".1f"),
                    ]
                )
        lines += [
            _md_table(
                [
                    "backend",
                    "optimizer",
                    "step ms",
                    "step peak MB",
                    "x params",
                    "fit peak MB",
                    "x params",
                    "eval loss",
                    "XLA temp MB",
                ],
                rows,
            ),
            "",
        ]
        rows = [
            [
                k,
                t["target"],
                _f(t["value"], ".4g"),
                f"≤ {t['threshold']:g}",
                PASS[t["pass"]],
                t.get("note", ""),
            ]
            for k, r in ft
            for t in r["backends"][k]["targets"]
        ]
        lines += [
            "### Targets",
            "",
            _md_table(["backend", "target", "measured", "goal", "result", "note"], rows),
            "",
        ]

    lines += _recommender_section(results)
    lines += _half_width_section(results)
    lines += _memory_wall_section(results)
    lines += _criteo_section(results)
    lines += _torch_launches_section(results)
    lines += _tuned_section(results)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


def _tuned_section(results):
    """JAX with the process-wide tunings of `cpu_tuning.py`, beside the defaults of the sections above."""
    tuned_steps, tuned_fit = (
        results.get(("embedding_adam_jax_tuned", "jax")),
        results.get(("fit_jax_tuned", "jax")),
    )
    if not tuned_steps and not tuned_fit:
        return []
    lines = [
        "## JAX with the opt-in tunings",
        "",
        "The optimizers change nothing process-wide. `cpu_tuning.advise_huge_pages` (the BCOO step: "
        "`bench_embedding_adam.py --only '[BCOO]' --sizes 1M,10M --interleave --huge-pages`, both sizes in memory, "
        "a step each in turn) and `release_compile_heap` (`bench_fit.py --release-compile-heap --no-bf16`, in every "
        "optimizer's process alike), against the same configurations without them in the sections above.",
        "",
    ]
    rows = []
    default_steps = results.get(("embedding_adam", "jax"))
    for record in (tuned_steps or {}).get("records", []):
        if "error" in record:
            continue
        default = next(
            (
                x
                for x in (default_steps or {}).get("records", [])
                if x["name"] == record["name"] and x["rows"] == record["rows"] and "error" not in x
            ),
            None,
        )
        rows.append(
            [
                f"`{record['name']}` step ms @{_size(record['rows'])}",
                _f(default and default["median_ms"], ".2f"),
                _f(record["median_ms"], ".2f"),
                _f(record["median_ms"] / default["median_ms"] if default else None, ".2f"),
            ]
        )
    default_fit = results.get(("fit", "jax"))
    default_above = _fit_peak_above_sgd(default_fit["backends"]["jax"]) if default_fit else {}
    if tuned_fit:
        for name, value in _fit_peak_above_sgd(tuned_fit["backends"]["jax"]).items():
            rows.append(
                [
                    f"`{name}` fit peak over SGD's, x params",
                    _f(default_above.get(name), "+.2f"),
                    _f(value, "+.2f"),
                    "",
                ]
            )
    lines += [_md_table(["figure", "default", "with the tuning", "tuned / default"], rows), ""]
    return lines


def _fit_peak_above_sgd(backend_result):
    """{optimizer: (fit peak - SGD's) / parameter bytes} of one backend's `bench_fit.py` medians."""
    medians, param_mb = backend_result["medians"], backend_result["param_mb"]
    sgd = medians.get("keras.optimizers.SGD", {}).get("fit_peak_mb")
    return {
        name: (m["fit_peak_mb"] - sgd) / param_mb
        for name, m in medians.items()
        if name != "keras.optimizers.SGD"
        and sgd is not None
        and m.get("fit_peak_mb") is not None
        and param_mb
    }


def _rounds(record) -> str:
    """A record's per-round medians (`bench_common.median_round`), as the `rounds ms` column shows them."""
    return " / ".join(f"{ms:.2f}" for ms in record.get("rounds_ms", []))


def _targets_lines(found):
    """A section's "Targets" table: each backend's `targets` of its benchmark JSON."""
    notes = any(t.get("note") for _, r in found for t in r["targets"])
    rows = [
        [k, t["target"], _f(t["value"], ".4g"), f"≤ {t['threshold']:g}", PASS[t["pass"]]]
        + ([t.get("note", "")] if notes else [])
        for k, r in found
        for t in r["targets"]
    ]
    header = ["backend", "target", "measured", "goal", "result"] + (["note"] if notes else [])
    return ["### Targets", "", _md_table(header, rows), ""]


def _criteo_section(results):
    """The Criteo-shaped model (`bench_criteo.py`): many tables in one layer against the peers."""
    found = [(k, results[("criteo", k)]) for k in BACKENDS if ("criteo", k) in results]
    if not found:
        return []
    lines = [
        "## Many tables in one layer: a Criteo-shaped model's `fit` step",
        "",
        "`integration/bench_criteo.py`: 26 one-id features in tables of Criteo's cardinalities capped at 1M rows, "
        "16 wide, 13 dense features, a DLRM-shaped MLP, batch 2,048, Zipf ids; `train_on_batch`, median ms a step; "
        "each configuration in its own process, ours in rounds (their processes alternated, the round of median time "
        "shown, every round's median in `rounds ms`). `distributed`: `kto.layers.DistributedEmbedding`; `frozen`: "
        "the same with its tables not trained (the step's floor: Keras's handling of 27 inputs, the lookups, the "
        "MLP); `layers26`: 26 "
        "`kto.layers.Embedding`; `one_table`: one `kto.layers.Embedding` of all rows; `keras_rs`: keras-rs's layer "
        "off TPU, its tables trained by the model's Adam; `keras`: 26 `keras.layers.Embedding` and Keras's Adam. "
        "torch ops: aten ops one step dispatches; JAX kernels: the compiled step's entry instructions.",
        "",
    ]
    rows = [
        [
            k,
            f"`{x['config']}`",
            _size(x["rows"]),
            _f(x["median_ms"], ".2f"),
            _rounds(x),
            _f(x["first_loss"], ".4f"),
            _f(x["last_loss"], ".4f"),
            x.get("torch_ops", x.get("jax_kernels", "")),
        ]
        for k, r in found
        for x in r["records"]
    ]
    header = [
        "backend",
        "configuration",
        "rows",
        "step ms",
        "rounds ms",
        "loss, first 3",
        "loss, last 3",
    ]
    lines += [_md_table(header + ["torch ops / JAX kernels"], rows), ""]
    return lines + _targets_lines(found)


def _recommender_section(results):
    """`model.fit` of a recommender (`bench_recommender.py`): tables trained in the lookup against the peers."""
    found = [(k, results[("recommender", k)]) for k in BACKENDS if ("recommender", k) in results]
    if not found:
        return []
    lines = [
        "## Tables trained in the lookup: a recommender's `fit` step",
        "",
        "`integration/bench_recommender.py`: ids of shape (1024, 4), a 64-wide table, mean-pooled, a Dense head; the "
        "model compiled with Keras's Adam; `train_on_batch`, median ms a step; each configuration in its own process, "
        "the table layers' in rounds (their processes alternated, the round of median time shown, every round's "
        "median in `rounds ms`). "
        "`layer`: `kto.layers.Embedding(optimizer=kto.EmbeddingAdam(0.01))`; `layer_not_lazy`: the same with "
        "`lazy_adam=False` (ordinary Adam, skipped steps caught up in closed form); `layer_half`: `layer` with a "
        'bfloat16 table, bfloat16 `momenta`, `second_moment="rowwise"` and stochastic rounding; `keras_adam`: '
        "`keras.layers.Embedding` "
        "trained by Keras's Adam; `dense_path`: `keras.layers.Embedding` trained by `kto.EmbeddingAdam` as the model's "
        "optimizer. Steps' peak: the process's peak RSS over all the steps (the first, compiling, included) beyond "
        "what they keep (the model optimizer's variables), in MB and as a multiple of the table's bytes. Creation "
        "peak: over building the model, beyond its weights' bytes (Keras's initializers; the same for "
        "`keras.layers.Embedding`).",
        "",
    ]
    rows = [
        [
            k,
            f"`{x['config']}`",
            _size(x["rows"]),
            _f(x["median_ms"], ".2f"),
            _rounds(x),
            _f(x["peak_beyond_state_mb"], ".0f"),
            _f(x["peak_beyond_state_x_table"], ".3f"),
            _f(x.get("creation_peak_beyond_state_mb"), ".0f"),
        ]
        for k, r in found
        for x in r["records"]
    ]
    lines += [
        _md_table(
            [
                "backend",
                "configuration",
                "rows",
                "step ms",
                "rounds ms",
                "steps' peak MB",
                "x table",
                "creation peak MB",
            ],
            rows,
        ),
        "",
    ]
    return lines + _targets_lines(found)


def _half_width_section(results):
    """Half-width tables that still learn (`bench_half_width.py`): final losses against float32."""
    found = [(k, results[("half_width", k)]) for k in BACKENDS if ("half_width", k) in results]
    if not found:
        return []
    lines = [
        "## Half-width tables: the final loss against float32",
        "",
        "`integration/bench_half_width.py`: 2,000 rows of width 4, a row's prediction the sum of its entries, "
        "its target a fixed normal draw; 1,500 `fit` steps of 256 Zipf ids (exponent 1.1) from a table of normal "
        "draws; the loss over 100,000 held-out Zipf ids. `float32`: our layer in float32; `bf16_nearest`: "
        '`dtype="bfloat16"`, float32 slots, rounded to nearest; `bf16_half_state`: `dtype="bfloat16"`, '
        '`momentum_dtype="bfloat16"`, `second_moment="rowwise"`, `stochastic_rounding=True`.',
        "",
    ]
    rows = [
        [
            k,
            f"{x['learning_rate']:g}",
            f"`{x['config']}`",
            str(x["bytes_per_row"]),
            _f(x["loss"], ".4f"),
            _f(x["loss_x_float32"], ".3f"),
        ]
        for k, r in found
        for x in r["records"]
    ]
    header = ["backend", "lr", "configuration", "bytes a row", "final loss", "/ float32"]
    lines += [_md_table(header, rows), ""]
    return lines + _targets_lines(found)


def _memory_wall_section(results):
    """The largest table a device can train (`bench_memory_wall.py`, JAX)."""
    found = [("jax", results[("memory_wall", "jax")])] if ("memory_wall", "jax") in results else []
    if not found:
        return []
    budgets = (16, 80)
    lines = [
        "## The memory wall: the largest table a device can train",
        "",
        "`integration/bench_memory_wall.py` (JAX): ids of shape (1024, 4), a 64-wide table, mean-pooled, a Dense "
        "head, the model compiled with Keras's Adam. Keras's train step, jitted with the state donated, compiled at "
        "two vocabulary sizes on one device and split by rows over 8 (`ModelParallel`, a `LayoutMap` naming only the "
        "table); per device, the state's bytes plus the compiled step's temporaries (`memory_analysis()`), whose "
        "growth per row gives the bytes a row costs a device and the largest vocabulary that fits a device of 16 and "
        "80 GiB (`state bytes a row`: the variables alone). XLA's CPU backend evaluates a bfloat16 scatter in float32, "
        "so on this machine a bfloat16 table's step also holds float32 copies of it (its temporaries; GPUs and TPUs "
        "scatter bfloat16 natively). `keras_adam`: `keras.layers.Embedding` trained by Keras's Adam; `layer_fp32`: our layer; "
        '`layer_bf16_nearest`: `dtype="bfloat16"`, float32 slots, round to nearest; `layer_half`: `dtype="bfloat16"`, '
        '`momentum_dtype="bfloat16"`, `second_moment="rowwise"`, stochastic rounding. Final loss: 400 steps at 65,536 '
        "rows on Zipf ids, matching a fixed random teacher, on held-out batches.",
        "",
    ]
    header = [
        "configuration",
        "state bytes a row",
        "bytes a row, 1 device",
        "bytes a row a device, 8",
    ]
    header += [
        f"max rows, {d} device{'s' if d > 1 else ''} of {b} GiB" for d in (1, 8) for b in budgets
    ]
    header += ["final loss", "/ layer_fp32"]
    records = found[0][1]["records"]
    base = next(r for r in records if r["config"] == "layer_fp32")
    rows = [
        [
            f"`{r['config']}`",
            _f(r["state_per_row_1"], ".1f"),
            _f(r["bytes_per_row_1"], ".1f"),
            _f(r["bytes_per_row_8"], ".1f"),
            *(f"{r[f'max_rows_{d}_{b}gib'] / 1e6:,.0f}M" for d in (1, 8) for b in budgets),
            _f(r["final_loss"], ".4f"),
            _f(r["final_loss"] / base["final_loss"], ".3f"),
        ]
        for r in records
    ]
    lines += [_md_table(header, rows), ""]
    return lines + _targets_lines(found)


def _torch_launches_section(results):
    """torch's ops a step and eager against `torch.compile` (`bench_torch_launches.py`)."""
    found = results.get(("torch_launches", "torch"))
    if not found:
        return []
    records = found["records"]
    lines = [
        "## torch: ops a step (kernel launches on a GPU) and `torch.compile`",
        "",
        "`integration/bench_torch_launches.py`. Ops: the aten ops one warm `apply` (`torch.optim`: `step`) "
        "dispatches, counted with a `TorchDispatchMode`; each is a kernel launch on a GPU. Ours on the path a CUDA "
        "user runs (`[GPU path]`: the variables' platform set to `\"gpu\"`, the grouped step) and on this CPU's. "
        "EmbeddingAdam: 4096 ids a table, a dense or a sparse COO gradient.",
        "",
    ]
    configs = list(dict.fromkeys(r["config"] for r in records if r["section"] == "ops"))
    names = list(dict.fromkeys(r["optimizer"] for r in records if r["section"] == "ops"))
    ops = {(r["config"], r["optimizer"]): r["ops"] for r in records if r["section"] == "ops"}
    for group, keep in (
        ("Adafactor stacks", lambda c: "table" not in c),
        ("EmbeddingAdam tables", lambda c: "table" in c),
    ):
        chosen = [c for c in configs if keep(c)]
        columns = [n for n in names if any((c, n) in ops for c in chosen)]
        rows = [[f"`{n}`"] + [ops.get((c, n), "") for c in chosen] for n in columns]
        lines += [f"### Ops a step: {group}", "", _md_table(["optimizer"] + chosen, rows), ""]
    graphs = [
        [f"`{r['optimizer']}`", r["graphs"], r["breaks"]]
        for r in records
        if r["section"] == "graphs"
    ]
    lines += [
        "### `torch._dynamo.explain` of one `apply`",
        "",
        "A sparse COO gradient is not traced by `torch.compile` (torch's own limit): its step runs eagerly.",
        "",
        _md_table(["optimizer", "graphs", "breaks"], graphs),
        "",
    ]
    times = [r for r in records if r["section"] == "times"]
    by = {(r["config"], r["optimizer"], r["mode"]): r for r in times}
    rows = []
    for config, name in dict.fromkeys((r["config"], r["optimizer"]) for r in times):
        eager, compiled = by.get((config, name, "eager")), by.get((config, name, "compiled"))
        rows.append(
            [
                config,
                f"`{name}`",
                _f(eager and eager["median_ms"], ".2f"),
                _f(compiled and compiled["median_ms"], ".2f"),
                _f(compiled and compiled["first_call_s"], ".0f"),
                _f(
                    eager["median_ms"] / compiled["median_ms"] if eager and compiled else None,
                    ".2f",
                ),
            ]
        )
    lines += [
        "### Step time on this CPU, eager and `torch.compile`",
        "",
        f"Median of {found['steps']} steps after the first (compiling) call and one more. The timed stack "
        "is the BERT-like stack's embedding and first two layers at full width (compiling all twelve takes "
        "minutes on this CPU).",
        "",
        _md_table(
            [
                "configuration",
                "optimizer",
                "eager ms",
                "compiled ms",
                "compile s",
                "eager / compiled",
            ],
            rows,
        ),
        "",
    ]
    rows = [
        [t["target"], _f(t["value"], ".4g"), f"≤ {t['threshold']:g}", PASS[t["pass"]]]
        for t in found["targets"]
    ]
    lines += ["### Targets", "", _md_table(["target", "measured", "goal", "result"], rows), ""]
    return lines


def _options_section(results):
    """EmbeddingAdam's options (`bench_embedding_options.py`): ours with each option against our plain step."""
    found = [
        (k, results[("embedding_options", k)])
        for k in BACKENDS
        if ("embedding_options", k) in results
    ]
    if not found:
        return []
    lines = [
        "## EmbeddingAdam options (EMA, gradient accumulation, row-wise `v`, per-row bias correction)",
        "",
        "Configurations take turns, a window of 4 steps at a time; means over whole windows (ms).",
        "",
    ]
    for backend, r in found:
        records = [x for x in r["records"] if "error" not in x and x.get("steps_ms")]
        mean = {
            (x["who"], x["options"], x["rows"]): sum(x["steps_ms"]) / len(x["steps_ms"])
            for x in records
        }
        rows = []
        for who, options, size in mean:
            plain = mean.get((who, "plain", size))
            state = next(
                (
                    x.get("state_bytes")
                    for x in records
                    if (x["who"], x["options"], x["rows"]) == (who, options, size)
                ),
                None,
            )
            rows.append(
                [
                    who,
                    options,
                    _size(size),
                    _f(mean[(who, options, size)], ".2f"),
                    _f(mean[(who, options, size)] / plain if plain else None, ".2f"),
                    _f(state / 2**20 if state else None, ".0f"),
                ]
            )
        lines += [
            f"### {backend}",
            "",
            _md_table(["optimizer", "option", "rows", "ms", "/ plain", "state MB"], rows),
            "",
        ]
        errs = [x for x in r["records"] if "error" in x]
        if errs:
            lines += [
                "Errors: " + "; ".join(f"{x['who']} {x['options']}: {x['error']}" for x in errs),
                "",
            ]
    return lines + _targets_lines(found)


def write_chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    # Adafactor: ours / each peer, per backend.
    ax = axes[0]
    labels, values, colors = [], [], []
    palette = {"tensorflow": "tab:orange", "jax": "tab:blue", "torch": "tab:red"}
    for k in BACKENDS:
        r = results.get(("adafactor", k))
        if not r:
            continue
        for x in r["ratios"]:
            if x["time_ratio"] is None:
                continue
            peer = (
                x["peer"].replace("keras.optimizers.", "keras ").replace("torch.optim.", "torch ")
            )
            labels.append(f"{k}\nvs {peer}")
            values.append(x["time_ratio"])
            colors.append(palette[k])
        if k in ("tensorflow", "jax"):  # the floor is a target on these two only
            labels.append(f"{k}\nvs bw floor")
            values.append(r["results"]["keras_tpu_optim.Adafactor"]["over_floor"])
            colors.append(palette[k])
    if values:
        ax.bar(range(len(values)), values, color=colors)
        ax.set_yscale("log")
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        for y, style in ((0.6, ":"), (0.8, "--"), (2.0, "-.")):
            ax.axhline(y, color="gray", lw=0.8, ls=style)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    n_params = next((r["n_params"] for (b, _), r in results.items() if b == "adafactor"), 0)
    ax.set_title(
        f"Adafactor step time, ours / peer ({n_params / 1e6:.1f}M params, log)\n"
        "targets: 0.6 keras, 0.8 optax, 1.0 torch, 2.0 floor"
    )
    ax.set_ylabel("step-time ratio (lower is better)")

    # EmbeddingAdam: ours / each peer at each size, log scale.
    ax = axes[1]
    labels, values, colors = [], [], []
    for k in BACKENDS:
        r = results.get(("embedding_adam", k))
        if not r:
            continue
        ref = 1_000_000 if 1_000_000 in r["sizes"] else max(r["sizes"], default=None)
        for x in r["ratios"]:
            if x["time_ratio"] is None or x["rows"] != ref:
                continue
            m = x["ours"].replace("keras_tpu_optim.EmbeddingAdam", "ours")
            p = (
                x["peer"]
                .replace("keras.optimizers.", "")
                .replace("torch.optim.", "")
                .replace(" (torch subprocess)", "")
                .replace("jit_compile=", "xla=")
            )
            labels.append(f"{k} {_size(x['rows'])}\n{m} vs {p}")
            values.append(x["time_ratio"])
            colors.append(palette[k])
    if values:
        ax.bar(range(len(values)), values, color=colors)
        ax.set_yscale("log")
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        for y in (0.05, 0.1, 0.25):  # noqa: B007
            ax.axhline(y, color="gray", lw=0.8, ls=":")
    ax.set_title(
        "EmbeddingAdam step time, ours / peer, at 1M rows (log)\ntargets: TF 0.05 Adam & 1.0 SparseAdam, "
        "torch 0.1, JAX 0.25, JAX BCOO 0.05 (at 1M)"
    )
    ax.set_ylabel("step-time ratio (lower is better)")
    machine = next((r["machine"] for r in results.values()), bc.machine_info())
    fig.suptitle(
        f"keras_tpu_optim benchmarks — {machine['date'][:10]}, {machine['cpu']}, {machine['cores']} cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def write_report(out_dir, status=None, quick=False):
    results = load_results(out_dir)
    status = status or {k: 0 for k in results}
    write_markdown(results, status, os.path.join(out_dir, "benchmarks.md"), quick)
    write_chart(results, os.path.join(out_dir, "benchmarks.png"))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes (smoke run); writes to results/quick/"
    )
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--steps", type=int, default=None, help="passed to both scripts")
    ap.add_argument(
        "--sizes", default=None, help="table sizes for bench_embedding_adam.py, e.g. 100k,1M"
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="default integration/results (quick: integration/results/quick)",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="only rebuild the report from the JSON files"
    )
    args = ap.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    out_dir = args.out_dir or os.path.join(HERE, "results", "quick" if args.quick else "")
    out_dir = os.path.normpath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    status = None if args.report_only else run_all(args, out_dir)
    write_report(out_dir, status, args.quick)
    if status and any(rc != 0 for rc in status.values()):
        print("FAILED: " + ", ".join(f"{b} on {k}" for (b, k), rc in status.items() if rc != 0))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
