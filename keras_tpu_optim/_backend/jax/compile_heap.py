"""Give XLA's freed compile-time heap back to the OS after each large compilation (CPU, Linux with glibc).

Compiling a training step allocates a compiler heap of ~100 MB or more,
whatever the model's size, and frees it before the step runs; glibc keeps
the freed memory in its arenas, so on CPU the step's own buffers come on top
of it and the process's peak memory is compiler heap + step.
`malloc_trim(0)` right after the compilation returns that memory first. It
changes no value and no buffer, only what the process holds.

Registered once per process, when an optimizer is built for CPU variables;
compilations shorter than `MIN_COMPILE_SECONDS` (eager ops, small functions)
leave little heap and are skipped. `KERAS_TPU_OPTIM_TRIM_AFTER_COMPILE=0` in
the environment turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import jax

# The event JAX records when XLA has compiled a computation, before it runs.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MIN_COMPILE_SECONDS = 0.2

_lock = threading.Lock()
_registered = False


def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def enabled() -> bool:
    return os.environ.get("KERAS_TPU_OPTIM_TRIM_AFTER_COMPILE", "1") != "0"


def release_after_compilations() -> bool:
    """Register the release (once per process); returns whether it is registered."""
    global _registered
    with _lock:
        if _registered:
            return True
        trim = _malloc_trim() if enabled() else None
        if trim is None:
            return False
        trim.argtypes = (ctypes.c_size_t,)

        def after_compile(event, duration_secs, **kwargs):
            if event == COMPILE_EVENT and duration_secs >= MIN_COMPILE_SECONDS and enabled():
                trim(0)

        jax.monitoring.register_event_duration_secs_listener(after_compile)
        _registered = True
        return True


def registered() -> bool:
    return _registered
