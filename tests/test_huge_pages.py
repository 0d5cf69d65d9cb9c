"""Huge pages for EmbeddingAdam's tables on JAX's CPU, when asked for: contents and numbers unchanged.

Checked through the kernel's own record (`/proc/self/smaps`: `hg` in a
mapping's VmFlags is `MADV_HUGEPAGE`), not through the code under test.
"""

import os
import sys

import keras
import numpy as np
import pytest

import keras_tpu_optim as kto
from tests.reference.numpy_embedding_adam import NumpyEmbeddingAdam

BACKEND = keras.backend.backend()
THP = "/sys/kernel/mm/transparent_hugepage/enabled"

pytestmark = [
    pytest.mark.skipif(BACKEND != "jax", reason="huge pages are advised for JAX's CPU buffers only: TF and torch "
                                                "tables live in their own allocators, where nothing was measured"),
    pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists(THP)
                       or "[never]" in open(THP).read(), reason="this kernel has no transparent huge pages"),
]

# 70000 x 64 float32: 17.9 MB, above the 16 MiB threshold.
ROWS, DIM = 70000, 64


def vm_flags(address):
    """The VmFlags of the mapping holding `address`, from the kernel."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(variable):
    """Whether every CPU buffer of `variable` lies in a mapping advised for huge pages (checked mid-buffer)."""
    from keras_tpu_optim._backend.jax import huge_pages

    buffers = huge_pages.cpu_buffers(variable.value)
    assert buffers
    return all("hg" in vm_flags(address + nbytes // 2) for address, nbytes in buffers)


def test_huge_page_range_keeps_whole_pages_inside_the_buffer():
    from keras_tpu_optim._backend.jax.huge_pages import huge_page_range

    mib = 1 << 20
    assert huge_page_range(2 * mib, 4 * mib) == (2 * mib, 4 * mib)
    assert huge_page_range(2 * mib + 64, 6 * mib) == (4 * mib, 4 * mib)  # ends at 8 MiB + 64: 4..8
    assert huge_page_range(mib, 2 * mib) is None  # 1..3 MiB holds no whole 2 MiB page
    assert huge_page_range(0, 2 * mib - 1) is None


def test_asked_for_it_advises_the_table_and_its_row_slots():
    table = keras.Variable(np.ones((ROWS, DIM), "float32"), name="table")
    small = keras.Variable(np.ones((1000, DIM), "float32"), name="small")
    optimizer = kto.EmbeddingAdam()
    optimizer.build([table, small])
    slots = [v for v in optimizer.variables if tuple(v.shape) == (ROWS, DIM)]
    assert len(slots) == 2  # momenta, velocities
    assert kto.tuning.advise_huge_pages(optimizer) >= 3 * (ROWS * DIM * 4 - (4 << 20))  # whole 2 MiB pages
    for variable in [table, *slots]:
        assert advised(variable), variable.path
    assert kto.tuning.advise_huge_pages([small]) == 0  # below the threshold
    assert kto.tuning.advise_huge_pages([small], min_bytes=0) > 0 or small.value.nbytes < (4 << 20)


def test_what_is_advised_and_collapsed(monkeypatch):
    """Tables are collapsed as well as advised, their (fresh) slots only advised; nothing when not lazy or too
    small. (A mapping's flags cannot show this: in a long process a new buffer may reuse memory an earlier test
    advised.)"""
    from keras_tpu_optim._backend.jax import huge_pages

    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args[2]) or 0)
    dense = kto.EmbeddingAdam(lazy_adam=False)
    dense.build([keras.Variable(np.full((ROWS, DIM), 3.0, "float32"), name="dense")])
    assert kto.tuning.advise_huge_pages(dense) == 0 and calls == []
    lazy = kto.EmbeddingAdam()
    lazy.build([keras.Variable(np.full((ROWS, DIM), 4.0, "float32"), name="lazy")])
    assert calls == []  # build alone advises nothing
    kto.tuning.advise_huge_pages(lazy)
    assert sorted(calls) == sorted([huge_pages._MADV_HUGEPAGE] * 3 + [huge_pages._MADV_COLLAPSE])
    with pytest.raises(ValueError, match="build the optimizer first"):
        kto.tuning.advise_huge_pages(kto.EmbeddingAdam())
    with pytest.raises(ValueError, match="min_bytes"):
        kto.tuning.advise_huge_pages(lazy, min_bytes=-1)


def test_advised_tables_keep_the_numbers_under_jit_with_donation():
    """BCOO steps with duplicates on advised tables, under `jax.jit` with the state donated: the numpy reference."""
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    rng = np.random.default_rng(7)
    init = rng.normal(size=(ROWS, DIM)).astype("float32")
    table = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.01)
    optimizer.build([table])
    kto.tuning.advise_huge_pages(optimizer)
    assert advised(table)
    reference = NumpyEmbeddingAdam(init, learning_rate=0.01)

    from bench_common import jit_stateless_apply  # as Keras's trainer: state donated, returned in input order

    apply = jit_stateless_apply(optimizer)
    optimizer_values, trainable_values = [v.value for v in optimizer.variables], [table.value]
    for step in range(3):
        ids = np.concatenate([rng.integers(0, ROWS, 500), [5, 5, ROWS - 1]])
        values = rng.normal(size=(ids.size, DIM)).astype("float32")
        gradient = jax_sparse.BCOO((jnp.asarray(values), jnp.asarray(ids, jnp.int32)[:, None]), shape=(ROWS, DIM))
        optimizer_values, trainable_values = apply(optimizer_values, [gradient], trainable_values)
        reference.apply_sparse(ids, values)
    np.testing.assert_allclose(np.asarray(trainable_values[0]), reference.weights, rtol=1e-5, atol=1e-6)
