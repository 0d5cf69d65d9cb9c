"""Blocks of a variable's leading axis: how the eager kernels bound their intermediates.

A kernel that processes a variable a block of its leading axis at a time
never holds an intermediate bigger than a block. Pure Python, shared by the
kernels that work this way (eager torch, TF graphs on CPU).
"""

from __future__ import annotations

import math

# Elements of a block (16 MiB of float32). Measured on CPU, the embedding and MLP kernels of a
# GPT-2-sized model, eager torch: on one thread 4 and 16 MiB blocks were faster than one
# variable-sized buffer (~60 vs ~80 ms: cache-resident blocks); on two threads of a loaded
# machine, where every parallel op waits for a busy core, smaller blocks (more ops) were much
# slower: 4 MiB 9x, 16 MiB 2.3x the variable-sized buffer's time.
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
