"""The route from `update_step`, or from a layer's backward pass, to each variable write: at most five calls
of the package's own functions on the active backend, eager, graph and compiled (`dev/routes.py`, run in
its own process: it wraps the frameworks' write methods to see them)."""

import os
import subprocess
import sys

import keras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_route_to_a_write_is_at_most_five_calls():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "dev", "routes.py"), "--max", "5"],
        env={**os.environ, "KERAS_BACKEND": keras.backend.backend()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"{keras.backend.backend()} layers.Embedding/lazy" in result.stdout, result.stdout
