"""Process-wide CPU memory tunings for JAX that the benchmarks compare against the defaults.

Not part of keras_tpu_optim: the package changes nothing outside its own
variables. These two reach further, which is why only the benchmark scripts
call them, when asked (`bench_fit.py --release-compile-heap`,
`bench_embedding_adam.py --huge-pages`):

- `release_compile_heap()`: after each XLA compilation of at least
  `min_seconds`, glibc's `malloc_trim(0)` from a `jax.monitoring` listener:
  the compiler's freed heap goes back to the OS before the step's buffers are
  allocated on top of it. Follows every compilation in the process.
- `advise_huge_pages(variables)`: `madvise(MADV_HUGEPAGE)` (and
  `MADV_COLLAPSE` with `collapse=True`) on the CPU buffers of the variables,
  so that random row reads miss the TLB less. The advice stays on the address
  ranges, which XLA may reuse for other arrays.

Linux only; elsewhere both do nothing.
"""

from __future__ import annotations

import ctypes
import sys

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20
_registered = False


def release_compile_heap(min_seconds: float = 0.2) -> None:
    """Trim glibc's heap after each JAX compilation of at least `min_seconds` (once per process)."""
    global _registered
    if _registered or not sys.platform.startswith("linux"):
        return
    trim = ctypes.CDLL(None).malloc_trim
    trim.argtypes = (ctypes.c_size_t,)

    def after_compile(event, duration_secs, **kwargs):
        if event == _COMPILE_EVENT and duration_secs >= min_seconds:
            trim(0)

    jax.monitoring.register_event_duration_secs_listener(after_compile)
    _registered = True


def _cpu_buffers(array):
    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        return []
    buffers = []
    for shard in array.addressable_shards:
        if shard.device.platform == "cpu":
            buffers.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return buffers


def advise_huge_pages(variables, *, collapse: bool = False, min_bytes: int = 16 << 20) -> int:
    """Advise huge pages for the CPU buffers of `variables` of at least `min_bytes`; returns the bytes advised."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for variable in variables:
        for address, nbytes in _cpu_buffers(getattr(variable, "value", variable)):
            start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
            end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
            if nbytes < min_bytes or end <= start:
                continue
            if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
                return advised  # no transparent huge pages here
            if collapse:
                madvise(start, end - start, _MADV_COLLAPSE)  # best effort
            advised += end - start
    return advised
