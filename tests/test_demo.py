"""The README's first command, `python -m keras_tpu_optim`, in its --quick mode."""

import os
import re
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.processes  # it starts other processes


def test_quick_demo_trains_prints_summary_and_writes_figure(tmp_path):
    figure = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "keras_tpu_optim", "--quick", "--out", str(figure)],
        capture_output=True,
        text=True,
        env=dict(os.environ, KERAS_BACKEND=keras.backend.backend()),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"on the {keras.backend.backend()} backend" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(figure) in out

    # Part 1: Keras's Adafactor keeps a full-size buffer per variable (state/params ~1);
    # ours only row/column statistics, a small fraction even on this tiny LM.
    ratio = dict(
        re.findall(
            r"^(keras_tpu_optim\.Adafactor|keras\.optimizers\.Adafactor)\s+\S+\s+[\d,]+\s+([\d.]+)",
            out,
            re.M,
        )
    )
    assert float(ratio["keras.optimizers.Adafactor"]) >= 1.0
    assert float(ratio["keras_tpu_optim.Adafactor"]) < 0.25

    # Part 2: the tables trained in the lookup touched a few rows per step, ordinary Adam every row.
    rows = dict(
        re.findall(
            r"^(keras_tpu_optim\.layers\.Embedding|keras_tpu_optim\.EmbeddingAdam\(lazy_adam=False\)"
            r"|keras\.optimizers\.Adam)\s+\S+\s+\S+\s+([\d,]+)",
            out,
            re.M,
        )
    )
    assert int(rows["keras.optimizers.Adam"].replace(",", "")) == 20_000
    assert int(rows["keras_tpu_optim.EmbeddingAdam(lazy_adam=False)"].replace(",", "")) == 20_000
    assert 0 < int(rows["keras_tpu_optim.layers.Embedding"].replace(",", "")) < 256
    # lazy_adam=False in the lookup: ordinary Adam's loss, as the dense run of the same optimizer has it.
    exact = re.search(r"caught up\): final loss ([\d.]+) against ([\d.]+) for the same", out)
    assert exact, out[-2000:]
    assert abs(float(exact.group(1)) / float(exact.group(2)) - 1) < 0.005
    # Beside the TPU's global bias correction, the per-row one (its own line and final loss).
    per_row = re.search(
        r"^keras_tpu_optim\.layers\.Embedding\(per_row\)\s+([\d.]+)\s+[\d.]+\s+([\d,]+)", out, re.M
    )
    assert per_row and 0 < int(per_row.group(2).replace(",", "")) < 256, out[-2000:]
    assert f"final loss {per_row.group(1)} against" in out
    # Keras's TF optimizers square an IndexedSlices gradient's values before summing duplicate ids: said on TF only.
    from keras_tpu_optim._demo import TF_SPARSE_NOTE

    assert (TF_SPARSE_NOTE in out) == (keras.backend.backend() == "tensorflow")


def test_backend_option_runs_the_demo_on_that_backend_in_its_own_process(monkeypatch):
    """Keras has chosen its backend by the time the demo parses `--backend`: another one runs in a child
    process with KERAS_BACKEND set there; this process's environment is left as it was."""
    from keras_tpu_optim import _demo

    other = next(b for b in ("tensorflow", "jax", "torch") if b != keras.backend.backend())
    calls = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda cmd, env, check: calls.append((cmd, env)) or subprocess.CompletedProcess(cmd, 7),
    )
    environment = dict(os.environ)
    assert _demo.main(["--backend", other, "--quick"]) == 7
    ((cmd, env),) = calls
    assert (
        cmd[1:] == ["-m", "keras_tpu_optim", "--backend", other, "--quick"]
        and env["KERAS_BACKEND"] == other
    )
    assert dict(os.environ) == environment
