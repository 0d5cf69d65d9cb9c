"""Half-width tables that still learn: the final loss of a table stored in bfloat16, against float32.

The task (a Zipf recommender reduced to its table): 2,000 rows of width 4, each row's prediction the
sum of its entries, its target a fixed normal draw; 1,500 `fit` steps of 256 Zipf ids (exponent
1.1), the looked-up rows trained by `kto.layers.Embedding`'s `EmbeddingAdam` at a learning rate of
1e-4 and of 1e-3, from a table of normal draws (a bfloat16 spacing of 2^-8 to 2^-6 there); the
final loss is the mean squared error over 100,000 held-out Zipf ids. Configurations:

- `float32`: a float32 table, float32 `momenta` and `velocities` (12 x dim bytes a row);
- `bf16_nearest`: `dtype="bfloat16"`, float32 slots, round to nearest (Keras's cast; 10 x dim);
- `bf16_half_state`: `dtype="bfloat16"`, bfloat16 `momenta`, `second_moment="rowwise"` and
  `stochastic_rounding=True` (4 x dim + 4 bytes a row).

The step time of a half-width table is measured where a step's time means something, in
`bench_recommender.py` (`layer_half`).

Usage: KERAS_BACKEND=jax python integration/bench_half_width.py [--quick] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

import bench_common as bc

ROWS, DIM, BATCH, ZIPF = 2000, 4, 256, 1.1
RATES = (1e-4, 1e-3)
CONFIGS = {
    "float32": dict(dtype="float32", optimizer={}),
    "bf16_nearest": dict(dtype="bfloat16", optimizer={}),
    "bf16_half_state": dict(
        dtype="bfloat16",
        optimizer=dict(
            momentum_dtype="bfloat16", second_moment="rowwise", stochastic_rounding=True, seed=0
        ),
    ),
}


def bytes_per_row(dtype: str, optimizer: dict) -> int:
    width = {"float32": 4, "bfloat16": 2}
    v = (
        4
        if optimizer.get("second_moment") == "rowwise"
        else width[optimizer.get("velocity_dtype", "float32")] * DIM
    )
    return width[dtype] * DIM + width[optimizer.get("momentum_dtype", "float32")] * DIM + v


def train(config: dict, learning_rate: float, steps: int) -> dict:
    import keras
    import numpy as np

    import keras_tpu_optim as kto

    rng = np.random.default_rng(0)
    targets = rng.normal(size=(ROWS,)).astype("float32")
    initial = rng.normal(size=(ROWS, DIM)).astype("float32")
    ids = ((rng.zipf(ZIPF, steps * BATCH) - 1) % ROWS).astype("int32")
    held_out = ((rng.zipf(ZIPF, 100_000) - 1) % ROWS).astype("int32")
    keras.utils.set_random_seed(0)
    layer = kto.layers.Embedding(
        ROWS,
        DIM,
        dtype=config["dtype"],
        optimizer=kto.EmbeddingAdam(learning_rate, **config["optimizer"]),
        embeddings_initializer=keras.initializers.Constant(initial),
    )
    inputs = keras.Input((), dtype="int32")
    model = keras.Model(inputs, keras.ops.sum(keras.ops.cast(layer(inputs), "float32"), axis=-1))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(ids, targets[ids], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    table = keras.ops.convert_to_numpy(keras.ops.cast(layer.embeddings, "float32"))
    loss = float(np.mean((table.sum(axis=1) - targets)[held_out] ** 2))
    return {"loss": loss}


def main(argv=None):
    import keras

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--quick", action="store_true", help="20 steps (a smoke run)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    results = []
    for rate in RATES:
        for name, config in CONFIGS.items():
            result = train(config, rate, args.steps)
            results.append(
                dict(
                    backend=keras.backend.backend(),
                    learning_rate=rate,
                    config=name,
                    bytes_per_row=bytes_per_row(config["dtype"], config["optimizer"]),
                    **result,
                )
            )
    print("| backend | lr | configuration | bytes a row | final loss | / float32 |")
    print("|---|---|---|---|---|---|")
    for row in results:
        base = next(
            r
            for r in results
            if r["learning_rate"] == row["learning_rate"] and r["config"] == "float32"
        )
        print(
            f"| {row['backend']} | {row['learning_rate']:g} | `{row['config']}` | {row['bytes_per_row']} | "
            f"{row['loss']:.4f} | {row['loss'] / base['loss']:.3f} |"
        )
    for row in results:
        base = next(
            r
            for r in results
            if r["learning_rate"] == row["learning_rate"] and r["config"] == "float32"
        )
        row["loss_x_float32"] = row["loss"] / base["loss"]
    by = {(r["config"], r["learning_rate"]): r["loss_x_float32"] for r in results}
    targets = [
        bc.target(
            f"bf16 half state / float32 final loss, lr {rate:g}",
            by[("bf16_half_state", rate)],
            1.05,
        )
        for rate in RATES
    ]
    bc.print_targets(targets)
    payload = {
        "bench": "half_width",
        "backend": keras.backend.backend(),
        "quick": args.quick,
        "machine": bc.machine_info(),
        "steps": args.steps,
        "records": results,
        "targets": targets,
    }
    bc.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
