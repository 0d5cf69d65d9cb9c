"""Helpers shared by the benchmark scripts (not a test module, not a library API).

Timing, memory-bandwidth measurement, peak-RSS tracking, machine description and
table printing. Imports nothing backend-specific: the scripts that use it pick the
backend from KERAS_BACKEND and must never import TensorFlow and torch together.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import threading
import time

import numpy as np


def machine_info() -> dict:
    """CPU model, core count, memory, OS, date: the context every figure needs."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": model,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": load,
    }


def jit_stateless_apply(optimizer):
    """`optimizer.stateless_apply` under `jax.jit` with the state donated, as Keras's JAX trainer runs it.

    The jitted function takes and returns `(optimizer_values, grads, trainable_values)` ->
    `(optimizer_values, trainable_values)`: the state comes back in the order it came in.
    JAX pairs donated inputs with outputs of the same shape in order, so
    stateless_apply's own (trainable, optimizer) order would alias the wrong
    buffers and force table-sized copies.
    """
    import jax

    def apply_in_input_order(opt_vals, grads, train_vals):
        new_train, new_opt = optimizer.stateless_apply(opt_vals, grads, train_vals)
        return new_opt, new_train

    return jax.jit(apply_in_input_order, donate_argnums=(0, 2))


def memcpy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> dict:
    """Measured copy bandwidth of this machine with numpy, in bytes moved per second.

    A copy of N bytes reads N and writes N, so it moves 2N bytes; the figure is
    2N / time; `gbps` uses the fastest of the repeats (the floor is what the
    machine can do, not what a loaded machine did). The destination is touched first so page faults are not
    timed.
    """
    n = nbytes // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    dst.fill(0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    best = min(times)
    return {
        "array_bytes": n * 4,
        "bytes_moved_per_s": 2 * n * 4 / med,
        "bytes_moved_per_s_best": 2 * n * 4 / best,
        "gbps_median": 2 * n * 4 / med / 1e9,
        "gbps": 2
        * n
        * 4
        / best
        / 1e9,  # the best copy: the floor should be what the machine can do
    }


def time_steps(step, steps: int, warmup: int, sync=None, on_warm=None) -> dict:
    """Run `step()` warmup + steps times; wall time of each timed step (ms).

    `sync()` (if given) is called after each step inside the timed region, to
    wait for asynchronous dispatch (JAX `block_until_ready`). `on_warm()` is
    called once between warm-up and the timed steps (used to reset the peak-RSS
    counter so compilation is not counted).
    """
    for _ in range(warmup):
        step()
        if sync is not None:
            sync()
    if on_warm is not None:
        on_warm()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "steps_ms": [round(t, 3) for t in times],
    }


# --------------------------------------------------------------------- memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory over a region, as bytes above a baseline.

    Uses the kernel's high-water mark (reset through /proc/self/clear_refs) and
    also samples RSS from a thread every ~2 ms, so it works where the reset is
    not allowed. `baseline()` records the RSS before the steps; `start()` resets
    the peak (call it after warm-up so compilation is not counted); `stop()`
    returns the peak.
    """

    def __init__(self):
        self._base = None
        self._peak = 0
        self._stop = threading.Event()
        self._thread = None
        self._hwm_ok = False

    def baseline(self):
        self._base = rss_bytes()

    def start(self):
        if self._base is None:
            self.baseline()
        self._hwm_ok = _reset_hwm()
        self._peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_bytes())
            time.sleep(0.002)

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        peak = self._peak
        if self._hwm_ok:
            hwm = _hwm_bytes()
            if hwm is not None:
                peak = max(peak, hwm)
        return {
            "rss_before_mb": self._base / 2**20,
            "peak_rss_mb": peak / 2**20,
            "peak_delta_mb": max(0, peak - self._base) / 2**20,
            "method": "VmHWM+sampling" if self._hwm_ok else "sampling",
        }


# ----------------------------------------------------------------- printing


def fmt(x, spec=".3f"):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    """Print a plain-text table (and return it)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "-" * len(title)]
    for k, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    print(flush=True)
    return text


def target(name: str, value, threshold: float, note: str = "") -> dict:
    """One target: value <= threshold is a PASS; a value that could not be measured is n/a."""
    ok = None if value is None else bool(value <= threshold)
    return {"target": name, "value": value, "threshold": threshold, "pass": ok, "note": note}


def print_targets(targets: list[dict]) -> str:
    rows = [
        [
            t["target"],
            fmt(t["value"], ".4g"),
            f"<= {t['threshold']:g}",
            {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]],
        ]
        + ([t["note"]] if any(x["note"] for x in targets) else [])
        for t in targets
    ]
    header = ["target", "measured", "goal", "result"] + (
        ["note"] if any(x["note"] for x in targets) else []
    )
    return print_table("Targets", header, rows)


def write_json(path: str | None, payload: dict):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
    print(f"wrote {path}", flush=True)


def json_of_worker(command: list, what: str, timeout: int) -> dict | None:
    """Run a benchmark's worker process; its last stdout line as JSON, or None (its stderr printed) if it failed."""
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        print(f"{what} failed:\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- rounds of worker processes


def alternated(items: list, rounds: int) -> list:
    """`items` `rounds` times over, every other round reversed: processes of one configuration vary by up to
    30% on a small machine, and alternating spreads a drift in the machine's state over all of them."""
    return [x for r in range(rounds) for x in (items if r % 2 == 0 else items[::-1])]


def median_round(records: list) -> dict:
    """The record of median time among one configuration's rounds (the upper one of an even count), with
    every round's median in `rounds_ms`."""
    ordered = sorted(records, key=lambda r: r["median_ms"])
    record = dict(ordered[len(ordered) // 2])
    record["rounds_ms"] = [r["median_ms"] for r in records]
    return record
