"""Opt-in memory tunings for JAX on CPU. Nothing here runs unless you call it.

Building or applying an optimizer of this package changes nothing outside its
own variables and the variables it updates. The two tunings below reach
further (one follows every compilation in the process, the other advises the
kernel about memory XLA owns), so they are yours to turn on, with their costs:

- `release_compile_heap()`: after each XLA compilation of at least
  `min_seconds`, hand the compiler's freed heap back to the OS (glibc's
  `malloc_trim(0)`). Lowers the peak memory of a CPU process that compiles a
  large step and then runs it; costs the trim's time after each such
  compilation, and applies to every compilation in the process, not only ours.
- `advise_huge_pages(optimizer)`: back an `EmbeddingAdam`'s tables and row
  slots with 2 MiB pages (`madvise(MADV_HUGEPAGE)`, and `MADV_COLLAPSE` for
  the tables' existing pages), so that random row reads miss the TLB less.
  Costs a copy of the tables' pages by the kernel, now, in the calling thread;
  the advice stays on those address ranges, which XLA may later reuse for
  other arrays. Values never change.

Both need the JAX backend and Linux; elsewhere they raise (JAX's GPU and TPU
buffers are not host memory and are left alone).
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable

import keras

__all__ = ["release_compile_heap", "advise_huge_pages"]


def _require_jax_on_linux(name: str):
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(f"keras_tpu_optim.tuning.{name} tunes JAX's CPU memory; this Keras backend is {backend!r}")
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"keras_tpu_optim.tuning.{name} needs Linux; this platform is {sys.platform!r}")


def release_compile_heap(min_seconds: float = 0.2) -> Callable[[], None]:
    """Return XLA's freed compile heap to the OS after each compilation of at least `min_seconds`.

    Process-wide: it follows every JAX compilation from now on, the user's own
    included. Calling it again changes `min_seconds`. Returns a function that
    turns it off.

    Raises:
        ValueError: `min_seconds` is negative.
        RuntimeError: not the JAX backend, not Linux, or no glibc `malloc_trim`.
    """
    _require_jax_on_linux("release_compile_heap")
    if not min_seconds >= 0:
        raise ValueError(f"min_seconds must be >= 0, got {min_seconds!r}")
    from keras_tpu_optim._backend.jax import compile_heap

    if not compile_heap.start(float(min_seconds)):
        raise RuntimeError("keras_tpu_optim.tuning.release_compile_heap needs glibc's malloc_trim, which this C "
                           "library does not have")
    return compile_heap.stop


def advise_huge_pages(target, *, min_bytes: int = 16 << 20) -> int:
    """Advise transparent huge pages for embedding tables' CPU buffers; returns the bytes advised.

    Args:
        target: a built `EmbeddingAdam` (its lazily updated tables, whose
            existing pages are also collapsed, and their row slots), or an
            iterable of variables (advised, not collapsed).
        min_bytes: buffers smaller than this are left alone (they fit in the
            TLB's reach with 4 KiB pages).

    A table assigned anew afterwards (loaded weights) is not advised: call it
    again. Where the kernel refuses (`transparent_hugepage=never`), it
    returns 0 and changes nothing.

    Raises:
        ValueError: an `EmbeddingAdam` that is not built yet, or a negative `min_bytes`.
        RuntimeError: not the JAX backend, or not Linux.
    """
    _require_jax_on_linux("advise_huge_pages")
    if not min_bytes >= 0:
        raise ValueError(f"min_bytes must be >= 0, got {min_bytes!r}")
    from keras_tpu_optim._backend.jax import huge_pages
    from keras_tpu_optim.embedding_adam import EmbeddingAdam

    if isinstance(target, EmbeddingAdam):
        if not target.built:
            raise ValueError("advise_huge_pages(optimizer): build the optimizer first (optimizer.build(variables) "
                             "or one training step)")
        tables, slots = target._row_tables()
        return (huge_pages.advise_tables(tables, collapse=True, min_bytes=min_bytes)
                + huge_pages.advise_tables(slots, min_bytes=min_bytes))
    if not isinstance(target, Iterable):
        raise TypeError(f"advise_huge_pages takes a built EmbeddingAdam or an iterable of variables, got "
                        f"{type(target).__name__}")
    return huge_pages.advise_tables(list(target), min_bytes=min_bytes)
