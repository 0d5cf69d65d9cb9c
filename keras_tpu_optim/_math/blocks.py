"""Blocks of a variable's leading axis: a step processed a block at a time never holds an intermediate
bigger than a block (eager torch, TF graphs on CPU)."""

from __future__ import annotations

import contextlib
import math

from keras import ops

from keras_tpu_optim._math import adafactor as adafactor_math

# Elements of a block (16 MiB of float32): few enough ops on CPU (each parallel op waits for every
# core), small enough temporaries (CHANGELOG has the measurements).
CHUNK_ELEMENTS = 1 << 22


def spans(shape, chunk_elements: int = CHUNK_ELEMENTS):
    """`(start, length)` blocks of the leading axis, of about `chunk_elements` elements but at least a row;
    `[None]` for a scalar."""
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
    """Adafactor's sums, `inner`'s on each block of the leading axis, added where they reduce that axis;
    `after(previous)`: the context a block's sums are built in, after `previous` (a list: the last block's
    first sum, none for the first block), a backend's ordering."""

    def __init__(
        self, shape, inner=adafactor_math.NEUTRAL, after=None, chunk_elements: int = CHUNK_ELEMENTS
    ):
        self.rows = shape[0] if shape else 1
        self.spans = spans(shape, chunk_elements)
        self.inner = inner
        self.after = after

    def _blocks(self, sums, axes, *operands):
        results, previous = [], []
        for span in self.spans:
            with contextlib.nullcontext() if self.after is None else self.after(previous):
                block = sums(*(part(x, span, self.rows) for x in operands))
            results.append(block)
            previous = [block[0]]
        if len(results) == 1:
            return results[0]
        return tuple(
            sum(each[1:], each[0]) if axis in (None, 0) else ops.concatenate(each, axis=0)
            for axis, each in zip(axes, zip(*results))
        )

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
