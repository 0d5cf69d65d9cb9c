"""Huge pages for EmbeddingAdam's tables on JAX's CPU: advised at `build`, contents and numbers unchanged.

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


def test_build_advises_the_table_and_its_row_slots():
    table = keras.Variable(np.ones((ROWS, DIM), "float32"), name="table")
    small = keras.Variable(np.ones((1000, DIM), "float32"), name="small")
    optimizer = kto.EmbeddingAdam()
    optimizer.build([table, small])
    slots = [v for v in optimizer.variables if tuple(v.shape) == (ROWS, DIM)]
    assert len(slots) == 2  # momenta, velocities
    for variable in [table, *slots]:
        assert advised(variable), variable.path
    from keras_tpu_optim._backend.jax import huge_pages

    assert huge_pages.advise_tables([small]) == 0  # below the threshold


def test_not_advised_when_turned_off_or_not_lazy(monkeypatch):
    """No madvise call at all. (A mapping's flags cannot show it: in a long process a new buffer may
    reuse memory an earlier test advised.)"""
    from keras_tpu_optim._backend.jax import huge_pages

    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    monkeypatch.setenv("KERAS_TPU_OPTIM_HUGE_PAGES", "0")
    kto.EmbeddingAdam().build([keras.Variable(np.full((ROWS, DIM), 2.0, "float32"), name="table")])
    assert calls == []
    monkeypatch.delenv("KERAS_TPU_OPTIM_HUGE_PAGES")
    kto.EmbeddingAdam(lazy_adam=False).build([keras.Variable(np.full((ROWS, DIM), 3.0, "float32"), name="dense")])
    assert calls == []
    kto.EmbeddingAdam().build([keras.Variable(np.full((ROWS, DIM), 4.0, "float32"), name="lazy")])
    assert len(calls) == 3 + 1  # the table, its two slots; the table collapsed as well


def test_advised_tables_keep_the_numbers_under_jit_with_donation():
    """BCOO steps with duplicates on advised tables, under `jax.jit` with the state donated: the numpy reference."""
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    rng = np.random.default_rng(7)
    init = rng.normal(size=(ROWS, DIM)).astype("float32")
    table = keras.Variable(init, name="table")
    optimizer = kto.EmbeddingAdam(learning_rate=0.01)
    optimizer.build([table])
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
