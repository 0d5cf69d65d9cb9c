"""The sparse row helpers every backend uses (`_math/sparse_rows.py`), against numpy written from their rules."""

import numpy as np
import pytest
from keras import ops

from keras_tpu_optim._math import sparse_rows

IDS = [4, 1, 4, 9, 1, 4, 0]


def reference_groups(ids, values, accumulate_duplicates):
    """{id: row}: the sum of an id's rows (float32), or its last occurrence's."""
    groups = {}
    for i, row in zip(ids, values):
        if accumulate_duplicates:
            groups[i] = groups.get(i, 0) + row.astype(np.float32)
        else:
            groups[i] = row
    return groups


@pytest.mark.parametrize("numbering", ["sort", "first occurrence"])
@pytest.mark.parametrize("accumulate_duplicates", [True, False])
@pytest.mark.parametrize("ids", [IDS, [3, 3, 3], [5], []])
def test_grouped_rows_lists_each_id_once_then_repeats_the_last(
    ids, accumulate_duplicates, numbering
):
    """By a sort (ids increasing) or by given numbers (tf.unique's: first occurrence first)."""
    values = np.arange(len(ids) * 2, dtype=np.float32).reshape(len(ids), 2) + 1
    group = None
    if numbering == "first occurrence":
        first = list(dict.fromkeys(ids))
        group = ops.convert_to_tensor(np.asarray([first.index(i) for i in ids], np.int32))
    grouped_ids, grouped = sparse_rows.grouped_rows(
        ops.convert_to_tensor(np.asarray(ids, np.int32).reshape(-1)),
        ops.convert_to_tensor(values.reshape(-1, 2)),
        accumulate_duplicates,
        group,
    )
    grouped_ids, grouped = ops.convert_to_numpy(grouped_ids), ops.convert_to_numpy(grouped)
    expected = reference_groups(ids, values, accumulate_duplicates)
    distinct = sorted(expected) if numbering == "sort" else list(expected)
    assert list(grouped_ids) == distinct + distinct[-1:] * (len(ids) - len(distinct))
    for i, row in zip(grouped_ids, grouped):
        np.testing.assert_array_equal(row, expected[i])


def test_bucket_is_one_rule_for_ints_and_tensors():
    counts = [0, 1, 63, 64, 65, 1000, 4096, 4097]
    assert [sparse_rows.bucket(n) for n in counts] == [0, 64, 64, 64, 128, 1024, 4096, 8192]
    tensors = [
        int(ops.convert_to_numpy(sparse_rows.bucket(ops.convert_to_tensor(n)))) for n in counts
    ]
    assert tensors == [sparse_rows.bucket(n) for n in counts]


@pytest.mark.parametrize("accumulate_duplicates", [True, False])
def test_padding_changes_no_group(accumulate_duplicates):
    values = np.arange(len(IDS) * 2, dtype=np.float32).reshape(len(IDS), 2) + 1
    ids, padded = sparse_rows.padded(
        ops.convert_to_tensor(np.asarray(IDS, np.int32)), ops.convert_to_tensor(values)
    )
    ids, padded = ops.convert_to_numpy(ids), ops.convert_to_numpy(padded)
    assert len(ids) == sparse_rows.MIN_BUCKET and set(ids) == set(IDS)
    assert reference_groups(ids, padded, accumulate_duplicates).keys() == set(IDS)
    for i, row in reference_groups(ids, padded, accumulate_duplicates).items():
        np.testing.assert_array_equal(row, reference_groups(IDS, values, accumulate_duplicates)[i])


def test_no_backend_keeps_a_copy_of_the_helpers():
    """grouped_rows, the bucket rule and the padding are written once (here)."""
    import pathlib

    package = pathlib.Path(sparse_rows.__file__).parent.parent
    for path in package.rglob("*.py"):
        if path == pathlib.Path(sparse_rows.__file__):
            continue
        text = path.read_text()
        for name in ("def grouped_rows(", "def bucket(", "def padded(", "segment_max("):
            assert name not in text, f"{name} in {path}"
