"""Blocks of a variable's leading axis, and buckets of a sparse gradient's length. Pure Python.

A kernel that processes a variable a block of its leading axis at a time
never holds an intermediate bigger than a block (eager torch, TF graphs on
CPU). An eager sparse step compiled for static shapes (TF's XLA row update,
JAX) pads its entries to a bucket, so that one compilation serves every
length in it.
"""

from __future__ import annotations

import math

# Elements of a block (16 MiB of float32): on CPU, large enough that the number of ops stays small
# (each parallel op waits for every core), small enough to bound the step's temporaries
# (CHANGELOG has the measurements).
CHUNK_ELEMENTS = 1 << 22


def spans(shape, chunk_elements: int = CHUNK_ELEMENTS):
    """`(start, length)` blocks of the leading axis of about `chunk_elements` elements each; `[None]` for a scalar.

    A block is at least one row of the leading axis, however big the row.
    """
    if len(shape) == 0:
        return [None]
    rows = shape[0]
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, chunk_elements // per_row)
    return [(start, min(step, rows - start)) for start in range(0, rows, step)]


# The smallest padded length of an eager sparse step: small steps share one compilation.
MIN_BUCKET = 64


def bucket(count: int) -> int:
    """`count` rounded up to a power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, count - 1).bit_length())
