"""A/B of EmbeddingAdam's step time under `gradient_accumulation_steps`: a quick script, not a suite benchmark.

A 1M x 64 float32 table, 4096 random ids a micro-step as a sparse gradient
(tf.IndexedSlices, torch sparse COO): no accumulation, N=4 with the rows
accumulated in place, and N=4 with Keras's own dense accumulator (fed dense
gradients on torch, which it cannot add sparsely). Prints the median time a
micro-step over windows of N.

    KERAS_BACKEND=tensorflow python integration/bench_accumulation.py function|xla|eager
    KERAS_BACKEND=torch python integration/bench_accumulation.py eager

(Run from the repository root with PYTHONPATH=. to time this checkout.)
"""

import os, sys, time
import numpy as np
import keras
import keras_tpu_optim as kto

BACKEND = keras.backend.backend()
ROWS, DIM, IDS, N = 1_000_000, 64, 4096, 4
MODE = sys.argv[1] if len(sys.argv) > 1 else "function"
REPS = int(os.environ.get("REPS", 40))


class KerasDense(kto.EmbeddingAdam):
    @property
    def _accumulates_rows(self):
        return False


rng = np.random.default_rng(0)
batches = [
    (rng.integers(0, ROWS, IDS).astype(np.int32), rng.normal(size=(IDS, DIM)).astype(np.float32))
    for _ in range(8)
]


def timed(optimizer):
    table = keras.Variable(np.zeros((ROWS, DIM), np.float32), name="table")
    optimizer.build([table])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        grads = [
            tf.IndexedSlices(tf.constant(v), tf.constant(i), dense_shape=tf.constant([ROWS, DIM]))
            for i, v in batches
        ]
        step = (
            optimizer.apply
            if MODE == "eager"
            else tf.function(lambda g: optimizer.apply([g], [table]), jit_compile=MODE == "xla")
        )
        run = (lambda g: optimizer.apply([g], [table])) if MODE == "eager" else step
        sync = lambda: table.value[0, 0].numpy()
    else:
        import torch

        grads = [
            torch.sparse_coo_tensor(
                torch.tensor(i, dtype=torch.int64)[None], torch.tensor(v), size=(ROWS, DIM)
            )
            for i, v in batches
        ]
        if isinstance(
            optimizer, KerasDense
        ):  # Keras's dense accumulator cannot take a sparse gradient
            grads = [g.to_dense() for g in grads[:4]]
        run = lambda g: optimizer.apply([g], [table])
        sync = lambda: None
    for k in range(2 * N):  # warm-up, compile
        run(grads[k % len(grads)])
    sync()
    times = []
    for k in range(REPS):
        start = time.perf_counter()
        for j in range(N):  # one window: N micro-steps
            run(grads[(k * N + j) % len(grads)])
        sync()
        times.append((time.perf_counter() - start) / N)
    return np.median(times) * 1e3


for name, make in [
    ("plain", lambda: kto.EmbeddingAdam(0.01)),
    ("N=4 rows (new)", lambda: kto.EmbeddingAdam(0.01, gradient_accumulation_steps=N)),
    ("N=4 Keras dense (old)", lambda: KerasDense(0.01, gradient_accumulation_steps=N)),
]:
    print(
        f"{BACKEND} {MODE} {name}: {timed(make()):.2f} ms/step (median over {REPS} windows of {N})",
        flush=True,
    )
