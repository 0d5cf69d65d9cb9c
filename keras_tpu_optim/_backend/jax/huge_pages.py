"""Transparent huge pages for EmbeddingAdam's tables on CPU (Linux).

A sparse step reads and writes a few thousand random rows of a table and of
each of its slots; with 4 KiB pages nearly every one of those row accesses
misses the TLB and walks the page tables. `madvise(MADV_HUGEPAGE)` lets the
kernel back the tables with 2 MiB pages from then on, and `MADV_COLLAPSE`
(Linux 6.1+) converts the pages already there (the table's: its slots are
fresh zeros, whose pages come as they are first written). Both are hints
about memory layout: the contents never change, and a kernel or a setting
that refuses them (`transparent_hugepage=never`, another OS, an older
kernel) leaves everything as it was. Only CPU buffers are advised: on GPU
and TPU a buffer pointer is not host memory.

The advice follows the memory, not the array: under `jax.jit` with the state
donated (Keras's trainer) each step's new table reuses the advised buffer. A
table assigned anew after `build` (loading weights) is not advised: its steps
stay correct, at 4 KiB-page speed.

Opt-in only, through `keras_tpu_optim.tuning.advise_huge_pages`: the advice
stays on the address range, which XLA may later reuse for other arrays.
"""

from __future__ import annotations

import ctypes
import sys

import jax

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20
# Smaller tables fit in the TLB's reach with 4 KiB pages.
MIN_BYTES = 16 << 20


def supported() -> bool:
    return sys.platform.startswith("linux")


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_range(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside `[address, address + nbytes)`, as `(start, length)`, or None."""
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return (start, end - start) if end > start else None


def cpu_buffers(array):
    """`(address, nbytes)` of each CPU buffer of a concrete `jax.Array`; nothing for tracers or other devices."""
    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        return []
    buffers = []
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        data = shard.data
        try:
            buffers.append((data.unsafe_buffer_pointer(), data.nbytes))
        except (RuntimeError, ValueError, AttributeError):
            continue  # Deleted or donated: nothing to advise.
    return buffers


def advise_tables(variables, collapse: bool = False, min_bytes: int = MIN_BYTES) -> int:
    """Advise huge pages for the CPU buffers of `variables` of at least `min_bytes`; returns the bytes advised.

    `collapse`: also convert the pages already there (for written buffers,
    such as an initialized table), now: the kernel copies them, in this
    thread (in a background thread, the kernel's memory-map lock would stall
    the process's allocations instead).
    A freshly zeroed slot has no pages yet, and gets huge ones as it is first
    written.
    """
    if not supported():
        return 0
    madvise = None
    advised = 0
    for variable in variables:
        for address, nbytes in cpu_buffers(getattr(variable, "value", variable)):
            span = huge_page_range(address, nbytes) if nbytes >= min_bytes else None
            if span is None:
                continue
            madvise = madvise or _madvise()
            if madvise(span[0], span[1], _MADV_HUGEPAGE) != 0:
                return advised  # Not supported here (no THP, another kernel): stop asking.
            if collapse:
                madvise(span[0], span[1], _MADV_COLLAPSE)  # Best effort: may be refused in part.
            advised += span[1]
    return advised
