"""Reused buffers for eager torch kernels: grown as needed, released with their owner.

An eager step that allocates its intermediates afresh costs, on CPU, the
allocator's page faults whenever it has handed the freed memory back to the
OS in between (a row-sized temporary is a megabyte for 4096 rows of 64
floats); a buffer kept across steps is faulted in once.
"""

from __future__ import annotations

import torch


class Scratch:
    """Buffers of one owner's eager steps (an optimizer, a layer), one per `(slot, dtype)`, grown as needed and reused.

    `like(x, slot, dtype)` gives slot `slot`'s buffer as a `dtype` view of
    `x`'s shape on `x`'s device (float32 by default); its contents are
    undefined. A buffer is only ever as big as the largest view asked of it.
    """

    def __init__(self):
        self._buffers = {}

    def like(
        self, x: torch.Tensor, slot: int = 0, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        return self.empty(tuple(x.shape), slot, dtype, x.device)

    def empty(self, shape, slot: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A `dtype` view of `shape` on `device` (contents undefined)."""
        numel = 1
        for size in shape:
            numel *= size
        key = (slot, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.device != torch.device(device) or buffer.numel() < numel:
            self._buffers[key] = None  # Free the old buffer before allocating its successor.
            buffer = self._buffers[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def release(self) -> None:
        self._buffers = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values() if b is not None)
