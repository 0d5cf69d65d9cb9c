"""torch: the rows of sparse COO gradients accumulated in place (`keras_tpu_optim._accumulation`).

`index_add_`, `index_copy_` and `index_select` of the rows named: a
micro-step costs O(entries x dim).
"""

from __future__ import annotations

import torch

from keras_tpu_optim import _private


def sparse_entries(gradient):
    """`(ids, values)` of a sparse COO gradient (duplicates kept); None for a dense one."""
    if not gradient.is_sparse:
        return None
    return _private.torch_sparse_entries(gradient)


@torch.no_grad()
def add_to_window(accumulator, window, ids, values, number):
    """Add the rows `values` into `accumulator` at `ids` (duplicates add up) and mark them `number` in `window`."""
    accumulator.value.index_add_(0, ids, values.to(accumulator.value.dtype))
    window.value.index_fill_(0, ids, number)


def window_sizes(like, window, steps):
    """Eager: the list of a window's rows has its own length."""
    return (None,)


def window_count(window, number):
    return torch.sum(window.value == number)


@torch.no_grad()
def window_gradient(accumulator, window, number, steps, like, size=None):
    """The rows of the window (`window == number`) of `accumulator / steps`, a coalesced sparse COO; those rows zeroed.

    One scan of `window` lists the rows (increasing, unique).
    """
    ids = torch.nonzero(window.value == number).squeeze(1)
    summed = accumulator.value.index_select(0, ids)
    accumulator.value.index_fill_(0, ids, 0)
    mean = (summed / steps).to(like.dtype)
    return torch.sparse_coo_tensor(
        ids[None], mean, size=like.shape, is_coalesced=True, check_invariants=False
    )
