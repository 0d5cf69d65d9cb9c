"""Blocks of a variable's leading axis.

A step that processes a variable a block of its leading axis at a time
never holds an intermediate bigger than a block (eager torch, TF graphs on
CPU): `Blocked` evaluates Adafactor's sums so.
"""

from __future__ import annotations

import contextlib
import math

from keras import ops

from keras_tpu_optim._math import adafactor as adafactor_math

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


def part(x, span, rows: int):
    """Block `span` of `x`'s leading axis, where `x` has that axis (`rows` long); `x` itself where it broadcasts."""
    if x is None or span is None or len(x.shape) == 0 or x.shape[0] != rows or span == (0, rows):
        return x
    start, length = span
    return x[start : start + length]


class Blocked(adafactor_math.Evaluation):
    """Adafactor's sums over blocks of the variable's leading axis: no intermediate bigger than a block.

    Each block's sums are `inner`'s; a sum over the leading axis (or the
    whole variable) adds the blocks' sums, any other concatenates them.
    `after(previous)` is the context each block's sums are built in, given
    the previous block's (a backend's ordering; none by default).
    """

    def __init__(
        self, shape, inner=adafactor_math.NEUTRAL, after=None, chunk_elements: int = CHUNK_ELEMENTS
    ):
        self.rows = shape[0] if shape else 1
        self.spans = spans(shape, chunk_elements)
        self.inner = inner
        self.after = after

    def _blocks(self, sums, axes, *operands):
        results, previous = [], None
        for span in self.spans:
            with contextlib.nullcontext() if self.after is None else self.after(previous):
                block = sums(*(part(x, span, self.rows) for x in operands))
            results.append(block)
            previous = block[0]
        if len(results) == 1:
            return results[0]
        combined = []
        for axis, sums_of_blocks in zip(axes, zip(*results)):
            if axis is None or axis == 0:
                total = sums_of_blocks[0]
                for value in sums_of_blocks[1:]:
                    total = total + value
                combined.append(total)
            else:
                combined.append(ops.concatenate(sums_of_blocks, axis=0))
        return tuple(combined)

    def square_sums(self, x, axes):
        return self._blocks(lambda block: self.inner.square_sums(block, axes), axes, x)

    def weighted_square_sum(self, x, weights, axis):
        (total,) = self._blocks(
            lambda block, w: (self.inner.weighted_square_sum(block, w, axis),), (axis,), x, weights
        )
        return total

    def sum(self, x, axis):
        return self.inner.sum(x, axis)

    def separately(self, x):
        return self.inner.separately(x)
