"""Stochastic rounding of float32 values to bfloat16/float16, the same bits on every backend
(docs/algorithms.md#stochastic-rounding): int32 arithmetic only, as torch lacks uint32's. The hash's
`^`, `&`, `*` and `+` are the tensors' own operators (each backend's int32 kernels, wrapping on overflow,
as `keras.ops` would call them); TensorFlow's tensors have no `>>`, so shifts are `keras.ops`'."""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

# murmur3's 32-bit finaliser constants and the golden-ratio increment, as signed int32.
_M1 = 0x85EBCA6B - (1 << 32)
_M2 = 0xC2B2AE35 - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)
_STEP_SALT = 0x68E31DA4
_VARIABLE_SALT = 0x1B56C4E9
_ELEMENT_SALT = 0x5BD1E995
_SIGN = -(1 << 31)  # float32's sign bit, as a signed int32

SEED_LIMIT = 1 << 31  # seeds are ints in [0, 2^31)


def _int32(x):
    """`x` as an int32 tensor. Constants go to the tensors' operators as Python ints, which keep int32 (a
    `keras.ops` call on JAX under a half `floatx` would compute an int32 tensor and a Python int in `floatx`)."""
    if isinstance(x, (int, np.integer, np.ndarray)):
        return ops.convert_to_tensor(x, "int32")
    return ops.cast(x, "int32")


def _shift_right_logical(x, bits: int):
    """`x >>> bits` on int32 (an arithmetic shift with the sign bits masked off)."""
    shifted = ops.right_shift(x, bits)
    shifted &= (1 << (32 - bits)) - 1
    return shifted


def _mix(h):
    """murmur3's fmix32: a bijection of 32-bit words that avalanches every input bit."""
    h = (h ^ _shift_right_logical(h, 16)) * _M1
    h = (h ^ _shift_right_logical(h, 13)) * _M2
    return h ^ _shift_right_logical(h, 16)


def _mix_on_host(h: int) -> int:
    """`_mix` of a Python int, as an int32 value (for keys known when the step is traced)."""
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * (_M1 & 0xFFFFFFFF)) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * (_M2 & 0xFFFFFFFF)) & 0xFFFFFFFF
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


def random_bits(shape, seed, step, variable_index, first_row=0, rows=None):
    """32 random bits per element (int32 of `shape`) from `(seed, step, variable_index)`, the element's row (its
    index along axis 0: from `first_row` on, or `rows`) and its position in the row; `variable_index` may
    broadcast (bits for each). A row's key is fully hashed, then each element by half a round of it (whose
    low 24 bits, the ones rounding reads, are as good as the full round's)."""
    shape = tuple(shape)
    if not shape:  # a scalar: row 0 of a rank-1 variable (after `variable_index`'s axes)
        index = ops.expand_dims(_int32(variable_index), -1)
        return ops.squeeze(random_bits((1,), seed, step, index, first_row, rows), -1)
    key = _int32(_mix_on_host(seed)) if isinstance(seed, int) else _mix(_int32(seed))
    key = _mix(key ^ (_int32(step) + _STEP_SALT))
    key = _mix(key ^ (_int32(variable_index) + _VARIABLE_SALT))
    if rows is None:
        rows = ops.arange(int(first_row), int(first_row) + int(shape[0]), dtype="int32")
    rows = ops.reshape(ops.cast(rows, "int32"), (-1,) + (1,) * (len(shape) - 1))
    row_keys = _mix(rows * _GOLDEN + key)
    # Each position's salt, `position * _ELEMENT_SALT` modulo 2^32, made on the device (a row's shape is
    # static; the number of rows need not be).
    row_shape = tuple(int(d) for d in shape[1:])
    positions = ops.arange(math.prod(row_shape), dtype="int32")
    h = row_keys + ops.reshape(positions * _ELEMENT_SALT, row_shape)
    # `h` is this function's own: updated in place where tensors are mutable (torch), which spares a
    # row-sized allocation an operation.
    h ^= _shift_right_logical(h, 16)
    h *= _M1
    h ^= _shift_right_logical(h, 16)
    return h


def _round_low_bits(x, bits, dropped: int):
    """`x` rounded stochastically to the float32s whose low `dropped` mantissa bits are 0: noise
    below 2^dropped carries into the kept bits with probability `low bits / 2^dropped`. `bits` (of `x`'s
    shape) is spent: updated in place where tensors are mutable."""
    if not x.shape or x.shape[-1] is None:
        # A last axis of static size: Keras's TF `view` reads it (a traced `(rows,)` has none).
        return ops.squeeze(_round_low_bits(x[..., None], bits[..., None], dropped), -1)
    pattern = ops.view(x, "int32")
    # The magnitude's bits, a NaN's payload replaced by the quiet NaN's: the noise then carries into the
    # exponent of a finite value only (Infinity's mantissa is 0), and the sign is kept as it was.
    rounded = ops.minimum(pattern & 0x7FFFFFFF, _int32(0x7FC00000))
    # `rounded` is this function's own (`pattern` is `x`'s): updated in place where tensors are mutable.
    bits &= (1 << dropped) - 1
    rounded += bits
    rounded &= -(1 << dropped)
    rounded |= pattern & _SIGN
    return ops.view(rounded, "float32")


def stochastic_round(x, dtype, *, seed, step, variable_index, shape=None, first_row=0, rows=None):
    """float32 `x` rounded stochastically and without bias to `dtype` (`bfloat16`, `float16`; others cast);
    `shape`, `first_row`, `rows`: as `random_bits`' (`shape` one value's where `x` stacks several)."""
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype not in ("bfloat16", "float16"):
        return ops.cast(x, dtype)
    x = ops.cast(x, "float32")
    bits = random_bits(
        x.shape if shape is None else shape, seed, step, variable_index, first_row, rows
    )
    if dtype == "bfloat16":
        rounded = _round_low_bits(x, bits, 16)
    else:
        # The low 24 random bits as a uniform draw from [0, 1) in steps of 2^-24 (before `bits` is spent).
        uniform = ops.cast(bits & ((1 << 24) - 1), "float32") * 2.0**-24
        normal = _round_low_bits(x, bits, 13)
        scaled = ops.abs(x) * 2.0**24
        whole = ops.floor(scaled)
        magnitude = (whole + ops.cast(uniform < scaled - whole, "float32")) * 2.0**-24
        subnormal = ops.where(x < 0, -magnitude, magnitude)
        subnormal = ops.where(x == 0, x, subnormal)  # -0 stays -0
        rounded = ops.where(ops.abs(x) < 2.0**-14, subnormal, normal)
    return ops.cast(rounded, dtype)
