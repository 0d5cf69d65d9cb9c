"""Start a group of cooperating processes for an integration test, and never leave one behind.

`free_ports(n)` picks loopback ports at run time; `ProcessGroup` starts each child
with its output in its own log file, waits for all of them with one deadline, and on
any failure (a non-zero exit, the deadline, an exception in the test) ends every child
still running and raises an AssertionError that shows each process's log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
LOG_TAIL = 6000


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (held together so they differ)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def child_env(**overrides) -> dict[str, str]:
    """The test's environment with the repository on PYTHONPATH and `overrides` applied
    (a value of None removes the variable)."""
    root = str(Path(__file__).resolve().parent.parent)
    here = str(Path(__file__).resolve().parent)
    tests = os.path.join(root, "tests")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, here, tests, env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class ProcessGroup:
    """Children started together and waited for together; use as a context manager."""

    def __init__(self, log_dir, name: str):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.children: list[tuple[str, subprocess.Popen, Path]] = []
        self._files = []

    def start(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.log_dir / f"{self.name}_{label}.log"
        handle = open(log, "w")
        self._files.append(handle)
        process = subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # so that ending it ends its own children too
        )
        self.children.append((label, process, log))

    def logs(self) -> str:
        parts = []
        for label, process, log in self.children:
            text = log.read_text(errors="replace") if log.exists() else ""
            if len(text) > LOG_TAIL:
                text = "...\n" + text[-LOG_TAIL:]
            parts.append(
                f"----- {self.name}/{label} (exit {process.returncode}) log {log} -----\n{text}"
            )
        return "\n".join(parts)

    def end_all(self) -> None:
        for _, process, _ in self.children:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for _, process, _ in self.children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=10)

    def wait(self, timeout: float) -> str:
        """Wait for every child; all must exit 0 within `timeout` seconds. Returns the logs."""
        deadline = time.monotonic() + timeout
        failed = None
        while failed is None:
            codes = [process.poll() for _, process, _ in self.children]
            if any(code not in (None, 0) for code in codes):
                failed = "a process failed"
            elif all(code == 0 for code in codes):
                break
            elif time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
            else:
                time.sleep(0.2)
        if failed:
            self.end_all()
            raise AssertionError(f"{self.name}: {failed}; every process was ended.\n{self.logs()}")
        return self.logs()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.end_all()
        for handle in self._files:
            handle.close()
        if exc_type is not None and not isinstance(exc, AssertionError) and self.children:
            # Show what the children said next to the test's own error.
            print(self.logs(), file=sys.stderr)
        return False


def run_arrays(out, name):
    """`(weights, optimizer state)` a worker saved as `out/name.npz` (`w0, w1, ...`, `o0, o1, ...`)."""
    import numpy as np

    data = np.load(Path(out) / f"{name}.npz")
    weights = [data[f"w{i}"] for i in range(sum(k.startswith("w") for k in data.files))]
    state = [data[f"o{i}"] for i in range(sum(k.startswith("o") for k in data.files))]
    return weights, state
