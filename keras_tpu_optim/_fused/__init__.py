"""Fused dense updates for backends where `keras.ops` leaves speed on the table.

XLA (JAX, TF with jit_compile) fuses the pure `keras.ops` functions in
`_math` by itself; eager torch does not, so torch gets in-place kernels here.
Each fast path computes the same formulas as its `_math` twin and is tested
against the same independent references.
"""
