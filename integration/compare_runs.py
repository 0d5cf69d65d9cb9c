"""Compare the ours/peer ratios of benchmark runs of two code versions ("old" and "new").

Each run is an `--out-dir` of `run_benchmarks.py` (its JSON files). Absolute
times from different runs on a shared machine are not comparable; the ratios
are, since ours and each peer were measured side by side in one process. Per
ratio the table gives the min-max over the old runs and over the new runs and
flags a ratio whose new runs fall outside the old runs' spread widened by 10%
([old min / 1.1, old max x 1.1]): "worse" above it, "better" below it (ratios
are ours / peer: lower is better). "all" means every new run is outside,
"some" that only some are.

Usage:
    python integration/compare_runs.py --old /tmp/bench_old_1,/tmp/bench_old_2 \
        --new /tmp/bench_new_1,/tmp/bench_new_2 [--out integration/results/restructure_before_after.md]
"""

from __future__ import annotations

import argparse
import json
import os

BACKENDS = ("tensorflow", "jax", "torch")
TOL = 1.10


def _size(n):
    if n >= 10**6 and n % 10**6 == 0:
        return f"{n // 10**6}M"
    if n >= 10**3 and n % 10**3 == 0:
        return f"{n // 10**3}k"
    return str(n)


def load(run_dir):
    out = {}
    for bench in ("adafactor", "embedding_adam"):
        for backend in BACKENDS:
            p = os.path.join(run_dir, f"{bench}_{backend}.json")
            if os.path.exists(p):
                with open(p) as f:
                    out[(bench, backend)] = json.load(f)
    return out


def ratios_of(run):
    """{(bench, backend, ours, peer, rows): ratio} of one run; Adafactor's floor ratio included."""
    out = {}
    for (bench, backend), r in run.items():
        for x in r["ratios"]:
            if x.get("time_ratio") is None:
                continue
            out[(bench, backend, x["ours"], x["peer"], x.get("rows"))] = x["time_ratio"]
        if bench == "adafactor":
            ours = r["results"].get("keras_tpu_optim.Adafactor")
            if ours:
                out[
                    (bench, backend, "keras_tpu_optim.Adafactor", "memory-bandwidth floor", None)
                ] = ours["over_floor"]
    return out


def loads_of(run):
    return {f"{b}/{k}": r["machine"].get("loadavg") for (b, k), r in sorted(run.items())}


def _rng(vals, spec=".3f"):
    if not vals:
        return "—"
    lo, hi = format(min(vals), spec), format(max(vals), spec)
    return lo if lo == hi else f"{lo} to {hi}"


def compare(old_dirs, new_dirs):
    olds = [ratios_of(load(d)) for d in old_dirs]
    news = [ratios_of(load(d)) for d in new_dirs]
    keys = []
    for run in olds + news:
        for k in run:
            if k not in keys:
                keys.append(k)
    order = {b: i for i, b in enumerate(("adafactor", "embedding_adam"))}
    keys.sort(key=lambda k: (order[k[0]], BACKENDS.index(k[1]), k[4] or 0))
    rows, flagged = [], []
    for k in keys:
        ov = [r[k] for r in olds if k in r]
        nv = [r[k] for r in news if k in r]
        flag = ""
        if ov and nv:
            lo, hi = min(ov) / TOL, max(ov) * TOL
            above = [v for v in nv if v > hi]
            below = [v for v in nv if v < lo]
            if above or below:
                which = "worse" if above else "better"
                if above and below:
                    which = "both sides"
                flag = f"**{which}** ({'all' if len(above) + len(below) == len(nv) else 'some'} new runs)"
            ratio = (sum(nv) / len(nv)) / (sum(ov) / len(ov))
            change = f"{ratio:.2f}"
        else:
            change = "—"
            flag = "new only" if nv and not ov else "old only"
        bench, backend, ours, peer, rows_ = k
        row = [
            "Adafactor" if bench == "adafactor" else "EmbeddingAdam",
            backend,
            f"`{ours.replace('keras_tpu_optim.', '')}`",
            f"`{peer}`",
            _size(rows_) if rows_ else "",
            _rng(ov),
            _rng(nv),
            change,
            flag,
        ]
        rows.append(row)
        if flag.startswith("**"):
            flagged.append(row)
    return rows, flagged


def memory_rows(old_dirs, new_dirs):
    """Adafactor step peak / warm-up RSS per optimizer, min-max over old and new runs (where measured)."""

    def collect(dirs):
        out = {}
        for d in dirs:
            for (bench, backend), r in load(d).items():
                if bench != "adafactor":
                    continue
                for name, v in r["results"].items():
                    if "peak_delta_mb" in v:
                        out.setdefault((backend, name), []).append(
                            (v["peak_delta_mb"], v["warmup_rss_growth_mb"])
                        )
        return out

    o, n = collect(old_dirs), collect(new_dirs)
    rows = []
    for key in sorted(set(o) | set(n), key=lambda k: (BACKENDS.index(k[0]), k[1])):
        ov, nv = o.get(key, []), n.get(key, [])
        rows.append(
            [
                key[0],
                f"`{key[1]}`",
                _rng([a for a, _ in ov], ".0f"),
                _rng([a for a, _ in nv], ".0f"),
                _rng([b for _, b in ov], ".0f"),
                _rng([b for _, b in nv], ".0f"),
            ]
        )
    return rows


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="comma-separated run directories of the old code")
    ap.add_argument("--new", required=True, help="comma-separated run directories of the new code")
    ap.add_argument("--out", default=None, help="write the markdown here (else print it)")
    ap.add_argument("--title", default="Before/after: ours / peer step-time ratios")
    ap.add_argument("--preamble", default="", help="text (markdown) put under the title")
    args = ap.parse_args(argv)
    old_dirs = [d for d in args.old.split(",") if d]
    new_dirs = [d for d in args.new.split(",") if d]
    rows, flagged = compare(old_dirs, new_dirs)
    lines = [f"# {args.title}", ""]
    if args.preamble:
        lines += [args.preamble, ""]
    lines += [
        f"Old runs: {', '.join(f'`{d}`' for d in old_dirs)}; new runs: {', '.join(f'`{d}`' for d in new_dirs)}. "
        "Ratios are ours / peer step time (lower is better), each measured with both optimizers in one process; "
        "cells give min to max over the runs. new/old: mean of the new runs over mean of the old runs. Flag: the "
        f"new runs fall outside the old runs' spread widened by {round((TOL - 1) * 100)}% "
        "([old min / 1.1, old max × 1.1]).",
        "",
        md_table(
            [
                "bench",
                "backend",
                "ours",
                "peer",
                "rows",
                "old (min to max)",
                "new (min to max)",
                "new/old",
                "flag",
            ],
            rows,
        ),
        "",
    ]
    if flagged:
        lines += [f"Flagged: {len(flagged)} of {len(rows)} ratios.", ""]
    else:
        lines += ["Flagged: none.", ""]
    mem = memory_rows(old_dirs, new_dirs)
    if mem:
        lines += [
            "## Adafactor memory (MB)",
            "",
            "Step peak: RSS above the RSS just before the steps, each optimizer alone after the timing. Warm-up: "
            "RSS the warm-up steps added (persistent buffers, state created on the first step, compiled code).",
            "",
            md_table(
                [
                    "backend",
                    "optimizer",
                    "step peak old",
                    "step peak new",
                    "warm-up old",
                    "warm-up new",
                ],
                mem,
            ),
            "",
        ]
    lines += ["## Load average (1/5/15 min) when each benchmark process started", ""]
    lrows = []
    for label, dirs in (("old", old_dirs), ("new", new_dirs)):
        for d in dirs:
            for k, v in loads_of(load(d)).items():
                lrows.append([label, f"`{d}`", k, ", ".join(f"{x:.2f}" for x in v) if v else "?"])
    lines += [md_table(["code", "run", "bench/backend", "load"], lrows), ""]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
