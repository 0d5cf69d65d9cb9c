"""Give XLA's freed compile-time heap back to the OS after each large compilation (CPU, Linux with glibc).

Opt-in only, through `keras_tpu_optim.tuning.release_compile_heap`: the
listener is process-wide (it follows every compilation, the user's own code
included), so nothing here runs unless the user asks for it.

Compiling a training step allocates a compiler heap,
whatever the model's size, and frees it before the step runs; glibc keeps
the freed memory in its arenas, so on CPU the step's own buffers come on top
of it and the process's peak memory is compiler heap + step.
`malloc_trim(0)` right after the compilation returns that memory first. It
changes no value and no buffer, only what the process holds; it costs the
time of the trim after each compilation of at least `min_seconds`.
"""

from __future__ import annotations

import ctypes
import sys
import threading

import jax

# The event JAX records when XLA has compiled a computation, before it runs.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
# The one listener of this process, the trim it calls, and the minimum compile time it trims after (None: off).
_listener = None
_trim = None
_min_seconds = None


def malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    return trim


def start(min_seconds: float) -> bool:
    """Trim after each compilation of at least `min_seconds`; returns False where there is no `malloc_trim`."""
    global _listener, _trim, _min_seconds
    with _lock:
        trim = malloc_trim()
        if trim is None:
            return False
        if _listener is None:

            def after_compile(event, duration_secs, **kwargs):
                threshold, trim_now = _min_seconds, _trim
                if threshold is not None and event == COMPILE_EVENT and duration_secs >= threshold:
                    trim_now(0)

            # JAX has no public way to remove a listener: it stays registered, and does nothing once stopped.
            jax.monitoring.register_event_duration_secs_listener(after_compile)
            _listener = after_compile
        _trim, _min_seconds = trim, min_seconds
        return True


def stop():
    """Trim no more (the listener stays registered, inert)."""
    global _min_seconds
    with _lock:
        _min_seconds = None


def active() -> bool:
    return _min_seconds is not None
