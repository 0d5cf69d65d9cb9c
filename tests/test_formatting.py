"""The package, its tests and its benchmarks are formatted as pyproject.toml configures (`ruff format`)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.backend_neutral
def test_code_is_formatted():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail(
            "ruff is not installed: it is in requirements.txt (pip install -r requirements.txt)"
        )
    result = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, (
        "run `ruff format .`:\n" + result.stdout[-3000:] + result.stderr[-2000:]
    )
