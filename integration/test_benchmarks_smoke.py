"""Smoke test of the benchmark scripts: they run and print their tables.

Each script's `main` runs with `--quick` (tiny sizes) in this test process,
on its backend (`bench_fit.py` with `--in-process`: its optimizers one after
another here, not each in a process of its own). Nothing here is timed or
compared: benchmark figures are for the report
(`integration/run_benchmarks.py`), never for assertions.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import keras
import pytest

pytestmark = pytest.mark.processes  # the benchmark scripts (one starts a torch process)

BACKEND = keras.backend.backend()


def _run(script, tmp_path, capsys, *extra):
    out = tmp_path / f"{script}.json"
    module = importlib.import_module(script.removesuffix(".py"))
    argv = ["--quick", "--json", str(out), *extra]
    code = module.main(argv)
    stdout = capsys.readouterr().out
    sys.stdout.write(stdout[-2000:])  # shown if the test fails
    assert not code, f"{script} {' '.join(argv)} exited {code}:\n{stdout[-3000:]}"
    with open(out) as f:
        return stdout, json.load(f)


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_adafactor_quick(tmp_path, capsys):
    stdout, data = _run("bench_adafactor.py", tmp_path, capsys, "--steps", "2", "--warmup", "1")
    assert f"Adafactor on {BACKEND}" in stdout
    assert "Ratios, ours / peer" in stdout
    assert "Targets" in stdout
    assert data["backend"] == BACKEND
    assert "keras_tpu_optim.Adafactor" in data["results"]
    assert "keras.optimizers.Adafactor" in data["results"]
    assert {t["target"] for t in data["targets"]} >= {
        "state/params",
        "step / keras.optimizers.Adafactor",
    }
    assert all(
        "peak_delta_mb" in v and "warmup_rss_growth_mb" in v for v in data["results"].values()
    )


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_embedding_adam_quick(tmp_path, capsys):
    # One table size: the script's sizes run one code path (the growth figures are the JAX test's below).
    stdout, data = _run(
        "bench_embedding_adam.py",
        tmp_path,
        capsys,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--sizes",
        "10k",
    )
    assert f"EmbeddingAdam on {BACKEND}" in stdout
    assert "Peak memory of the step" in stdout
    assert "Ratios, ours / peer" in stdout
    assert "Targets" in stdout
    assert data["backend"] == BACKEND
    names = {r["name"] for r in data["records"] if "error" not in r}
    assert any(n.startswith("keras_tpu_optim.EmbeddingAdam") for n in names), data["records"]
    if (
        BACKEND == "jax"
    ):  # this version accepts BCOO gradients: the BCOO configuration runs, with its targets
        assert "keras_tpu_optim.EmbeddingAdam [BCOO]" in names, data["records"]
        assert any("[BCOO]" in t["target"] for t in data["targets"])
    # The report writer accepts what the scripts wrote.
    (tmp_path / "report").mkdir()
    for bench, d in (("embedding_adam", data),):
        with open(tmp_path / "report" / f"{bench}_{BACKEND}.json", "w") as f:
            json.dump(d, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert (tmp_path / "report" / "benchmarks.md").read_text().count("EmbeddingAdam") >= 1
    assert (tmp_path / "report" / "benchmarks.png").stat().st_size > 0


@pytest.mark.skipif(BACKEND != "jax", reason="the BCOO configuration is JAX's")
def test_bench_embedding_adam_interleaved_sizes_quick(tmp_path, capsys):
    stdout, data = _run(
        "bench_embedding_adam.py",
        tmp_path,
        capsys,
        "--steps",
        "3",
        "--warmup",
        "1",
        "--only",
        "[BCOO]",
        "--interleave",
    )
    assert "interleaved: 10k, 100k" in stdout
    records = [r for r in data["records"] if "error" not in r]
    assert sorted(r["rows"] for r in records) == [10_000, 100_000]
    assert all(r["interleaved"] and len(r["steps_ms"]) == 3 for r in records)
    assert "Growth with the table" in stdout


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_embedding_options_quick(tmp_path, capsys):
    stdout, data = _run(
        "bench_embedding_options.py", tmp_path, capsys, "--steps", "8", "--big", "40k"
    )
    assert f"EmbeddingAdam options on {BACKEND}" in stdout
    assert "Targets" in stdout
    measured = {
        (r["who"], r["options"]) for r in data["records"] if "error" not in r and r["steps_ms"]
    }
    assert {
        ("ours", "plain"),
        ("ours", "use_ema"),
        ("ours", "rowwise"),
        ("ours", "per_row"),
    } <= measured, data["records"]
    assert ("keras", "use_ema") in measured
    assert any(
        t["target"] == "rowwise state / full state" and t["value"] is not None
        for t in data["targets"]
    )


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_fit_quick(tmp_path, capsys):
    # The bfloat16 runs (three more fits, the same code on every backend) in the torch pass only,
    # where a fit compiles nothing: a third of this test's time in the TF and JAX passes.
    bf16 = BACKEND == "torch"
    if not bf16:
        print("bench_fit.py's bfloat16 runs are smoke-tested in the torch pass only")
    stdout, data = _run(
        "bench_fit.py",
        tmp_path,
        capsys,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--in-process",
        *([] if bf16 else ["--no-bf16"]),
    )
    assert f"fit on {BACKEND}" in stdout
    assert "Ratios, ours / peer" in stdout
    assert "Targets" in stdout
    assert ("bfloat16 weights" in stdout) == bf16
    assert data["backend"] == BACKEND
    runs = data["backends"][BACKEND]["runs"]
    names = (
        "keras.optimizers.SGD",
        "keras_tpu_optim.Adafactor",
        "keras.optimizers.Adafactor",
        "keras.optimizers.Adam",
    )
    rounding = (
        "ours(lr=0.01), float32 weights",
        "ours(lr=0.01), bf16 weights",
        "ours(lr=0.01, stochastic_rounding=True), bf16 weights",
    )
    for name in names + (rounding if bf16 else ()):
        (record,) = runs[name]
        assert "error" not in record, record
        assert (
            record["peak_delta_mb"] >= 0 and record["fit_peak_mb"] >= 0 and record["median_ms"] > 0
        )
    if bf16:
        assert [runs[name][0]["dtype"] for name in rounding] == ["float32", "bfloat16", "bfloat16"]
    else:
        assert not set(rounding) & set(runs), runs.keys()
    # The compiled step's temporaries, from XLA's buffer assignment: JAX only.
    assert all((runs[name][0]["xla_temp_mb"] is not None) == (BACKEND == "jax") for name in names)
    assert {t["target"] for t in data["targets"]} >= {"ours peak <= SGD + 0.25x params"}
    # The report writer accepts what the script wrote.
    (tmp_path / "report").mkdir()
    with open(tmp_path / "report" / f"fit_{BACKEND}.json", "w") as f:
        json.dump(data, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert "Peak memory of a `fit` step" in (tmp_path / "report" / "benchmarks.md").read_text()


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_recommender_quick(tmp_path, capsys):
    stdout, data = _run("bench_recommender.py", tmp_path, capsys, "--steps", "2", "--in-process")
    assert f"Recommender fit steps ({BACKEND})" in stdout
    assert "Targets" in stdout
    measured = {(r["config"], r["rows"]) for r in data["records"]}
    assert measured == {
        ("layer", 1000),
        ("layer", 10_000),
        ("layer_not_lazy", 1000),
        ("layer_not_lazy", 10_000),
        ("layer_half", 1000),
        ("layer_half", 10_000),
        ("keras_adam", 1000),
        ("dense_path", 1000),
    }
    # The table layers in rounds (two with --quick), the others once.
    assert {(r["config"], len(r["rounds_ms"])) for r in data["records"]} == {
        ("layer", 2),
        ("layer_not_lazy", 2),
        ("layer_half", 2),
        ("keras_adam", 1),
        ("dense_path", 1),
    }
    assert all(t["value"] is not None for t in data["targets"]), data["targets"]
    (tmp_path / "report").mkdir()
    with open(tmp_path / "report" / f"recommender_{BACKEND}.json", "w") as f:
        json.dump(data, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert "Tables trained in the lookup" in (tmp_path / "report" / "benchmarks.md").read_text()


def test_bench_half_width_quick(tmp_path, capsys):
    stdout, data = _run("bench_half_width.py", tmp_path, capsys)
    assert "bf16_half_state" in stdout and "Targets" in stdout
    assert {(r["config"], r["bytes_per_row"]) for r in data["records"]} == {
        ("float32", 48),
        ("bf16_nearest", 40),
        ("bf16_half_state", 20),
    }
    (tmp_path / "report").mkdir()
    with open(tmp_path / "report" / f"half_width_{BACKEND}.json", "w") as f:
        json.dump(data, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert "Half-width tables" in (tmp_path / "report" / "benchmarks.md").read_text()


@pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax", "torch"), reason="benchmarks cover TF, JAX and torch"
)
def test_bench_criteo_quick(tmp_path, capsys):
    """One configuration in-process (the others build the same way, with peers' layers; the full run
    compares them): its step, losses and op or kernel count, and the report's section."""
    stdout, data = _run(
        "bench_criteo.py",
        tmp_path,
        capsys,
        "--steps",
        "2",
        "--in-process",
        "--configs",
        "distributed",
    )
    assert f"Criteo-shaped fit steps ({BACKEND})" in stdout
    (record,) = data["records"]
    assert record["config"] == "distributed" and record["median_ms"] > 0
    count = {"torch": "torch_ops", "jax": "jax_kernels"}.get(BACKEND)
    if count:
        assert record[count] > 0
    (tmp_path / "report").mkdir()
    with open(tmp_path / "report" / f"criteo_{BACKEND}.json", "w") as f:
        json.dump(data, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert "Many tables in one layer" in (tmp_path / "report" / "benchmarks.md").read_text()


@pytest.mark.skipif(BACKEND != "torch", reason="bench_torch_launches.py measures torch alone")
def test_bench_torch_launches_quick(tmp_path, capsys):
    stdout, data = _run("bench_torch_launches.py", tmp_path, capsys, "--steps", "1")
    assert "Targets" in stdout
    ops = {
        (r["config"].split(" (")[0], r["optimizer"])
        for r in data["records"]
        if r["section"] == "ops"
    }
    assert ("40 variables, 2 shapes", "keras_tpu_optim.Adafactor [GPU path]") in ops
    assert ("4 table(s) 2000x64, sparse gradient", "torch.optim.SparseAdam") in ops
    modes = {(r["optimizer"], r["mode"]) for r in data["records"] if r["section"] == "times"}
    assert {
        ("keras_tpu_optim.Adafactor", "compiled"),
        ("keras_tpu_optim.EmbeddingAdam", "compiled"),
    } <= modes
    assert all(t["value"] is not None for t in data["targets"]), data["targets"]
    (tmp_path / "report").mkdir()
    with open(tmp_path / "report" / "torch_launches_torch.json", "w") as f:
        json.dump(data, f)
    import run_benchmarks

    run_benchmarks.write_report(str(tmp_path / "report"), quick=True)
    assert (
        "ops a step (kernel launches on a GPU)"
        in (tmp_path / "report" / "benchmarks.md").read_text()
    )


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="device_check.py starts its own JAX and torch processes: run once, in the torch pass",
)
def test_device_check_dry_run(tmp_path):
    import subprocess

    out = tmp_path / "rows.json"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_check.py")
    done = subprocess.run(
        # A budget that a slow or busy machine does not exhaust (rows past it are skipped, and checked below);
        # a dry run on an idle machine takes a fraction of it.
        [sys.executable, script, "--dry-run", "--budget-s", "140", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    measured = {(r["config"].split(" [")[-1], r["optimizer"]) for r in rows if r["ms"] is not None}
    for part, name in [
        ("JAX, jit, donated]", "optax.adafactor"),
        ("JAX, jit, donated]", "keras_tpu_optim.EmbeddingAdam [BCOO]"),
        ("torch]", "keras_tpu_optim.Adafactor [torch.compile]"),
        ("torch]", "keras_tpu_optim.Adafactor [grouped off]"),
        ("torch]", "keras_tpu_optim.EmbeddingAdam [dense, CPU forms]"),
        ("torch]", "torch.optim.SparseAdam [sparse]"),
        ("torch, fit]", "26 keras.layers.Embedding + keras.optimizers.Adam"),
        ("torch, fit]", "kto.layers.DistributedEmbedding"),
    ]:
        assert (part, name) in measured, (part, name, rows)
    assert "| Adafactor |" in done.stdout and "| EmbeddingAdam |" in done.stdout
