"""The demo behind `python -m keras_tpu_optim`: what the package buys, in a couple of minutes.

Part 1 trains a small transformer language model with keras_tpu_optim.Adafactor,
keras.optimizers.Adafactor and keras.optimizers.Adam for the same steps, and
compares loss, optimizer-state bytes and time per step. Part 2 trains a
recommender with a 1M-row embedding table: its tables as
`keras_tpu_optim.layers.Embedding`, trained in the lookup by EmbeddingAdam
(TPU-style global bias correction, and `bias_correction="per_row"`); beside it,
Keras's tables trained by EmbeddingAdam as the model's optimizer (the dense
gradient of JAX's and torch's `fit`) and by keras.optimizers.Adam. It compares
time per step, the loss against steps and against wall-clock time, the final
metric and how many rows each step touched. Everything runs on synthetic data
generated in-process; the summary goes to the terminal and a PNG figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m keras_tpu_optim",
        description="Train a small LM and a recommender with keras_tpu_optim and Keras's optimizers, side by side.",
    )
    parser.add_argument(
        "--backend",
        choices=["tensorflow", "jax", "torch"],
        default=None,
        help="Keras backend (default: KERAS_BACKEND, else Keras's default)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per optimizer (default 60; 3 with --quick)",
    )
    parser.add_argument(
        "--out", default="keras_tpu_optim_demo.png", help="where to write the PNG figure"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny models and a few steps (what the tests run)"
    )
    return parser.parse_args(argv)


class _StepTimer:
    """Per-batch loss and wall time, as a Keras callback (built lazily: keras is imported late)."""

    @staticmethod
    def make():
        import keras

        class StepTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.losses, self.seconds, self.elapsed = [], [], []

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)
                # Wall-clock training time after the first step (which compiles).
                self.elapsed.append(sum(self.seconds[1:]))
                self.losses.append(float(logs["loss"]))

        return StepTimer()


def _state_bytes(optimizer):
    import keras
    import numpy as np

    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in optimizer.variables
    )


def _median_step_ms(seconds):
    import numpy as np

    # The first step compiles; report the steady state.
    steady = seconds[1:] or seconds
    return float(np.median(steady)) * 1000


def _language_model(quick, steps):
    import keras
    import numpy as np

    import keras_tpu_optim as kto

    vocab, seq, width, heads, blocks, batch = (
        (96, 16, 32, 2, 1, 8) if quick else (2000, 64, 128, 4, 2, 32)
    )
    rng = np.random.default_rng(0)
    # A random bigram language: each token has 4 likely successors, so there is something to learn.
    successors = rng.integers(0, vocab, size=(vocab, 4))
    tokens = np.empty((steps * batch, seq + 1), dtype="int32")
    tokens[:, 0] = rng.integers(0, vocab, size=len(tokens))
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t], rng.integers(0, 4, size=len(tokens))]
    inputs_np, targets_np = tokens[:, :-1], tokens[:, 1:]

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((seq,), dtype="int32")
        x = keras.layers.Embedding(vocab, width)(inputs)
        for _ in range(blocks):
            attended = keras.layers.MultiHeadAttention(heads, width // heads)(
                x, x, use_causal_mask=True
            )
            x = keras.layers.LayerNormalization()(x + attended)
            hidden = keras.layers.Dense(4 * width, activation="gelu")(x)
            x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
        return keras.Model(inputs, keras.layers.Dense(vocab)(x), name="tiny_lm")

    results = []
    for label, make in [
        ("keras_tpu_optim.Adafactor", lambda: kto.Adafactor(learning_rate=0.01)),
        ("keras.optimizers.Adafactor", lambda: keras.optimizers.Adafactor(learning_rate=0.01)),
        ("keras.optimizers.Adam", lambda: keras.optimizers.Adam(1e-3)),
    ]:
        print(f"\n[LM] {label}")
        model, optimizer, timer = build(), make(), _StepTimer.make()
        model.compile(
            optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        model.fit(
            inputs_np,
            targets_np,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            callbacks=[timer],
            verbose=1,
        )
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        results.append(
            dict(
                label=label,
                losses=timer.losses,
                elapsed=timer.elapsed,
                final_loss=timer.losses[-1],
                state_bytes=_state_bytes(optimizer),
                param_bytes=4 * params,
                step_ms=_median_step_ms(timer.seconds),
            )
        )
    return results


def _recommender(quick, steps):
    import keras
    import numpy as np

    import keras_tpu_optim as kto

    users, items, dim, batch = (20_000, 500, 8, 256) if quick else (1_000_000, 5_000, 32, 1024)
    rng = np.random.default_rng(1)
    # Clicks from hidden user/item factors plus an item popularity; users drawn
    # from a skewed (Zipf-like) distribution, so some recur and most are rare.
    user_factors = rng.normal(size=(users, 4)).astype("float32")
    item_factors = rng.normal(size=(items, 4)).astype("float32")
    item_bias = 2.0 * rng.normal(size=items).astype("float32")
    n = steps * batch
    user_ids = np.minimum(rng.zipf(1.3, size=n) - 1, users - 1).astype("int32")
    item_ids = rng.integers(0, items, size=n).astype("int32")
    affinity = (user_factors[user_ids] * item_factors[item_ids]).sum(-1) + item_bias[item_ids]
    clicks = (affinity > 0).astype("float32")

    def build(table_optimizer):
        """The model; its tables trained in the lookup by `table_optimizer()` (None: Keras's tables)."""
        keras.utils.set_random_seed(0)
        user = keras.Input((), dtype="int32", name="user")
        item = keras.Input((), dtype="int32", name="item")
        if table_optimizer is None:
            u = keras.layers.Embedding(users, dim, name="user_table")(user)
            v = keras.layers.Embedding(items, dim, name="item_table")(item)
        else:
            u = kto.layers.Embedding(users, dim, optimizer=table_optimizer(), name="user_table")(
                user
            )
            v = kto.layers.Embedding(items, dim, optimizer=table_optimizer(), name="item_table")(
                item
            )
        logit = keras.layers.Dense(1)(keras.layers.Concatenate()([u, v, u * v]))
        return keras.Model({"user": user, "item": item}, logit, name="recommender")

    touched = [len(np.unique(user_ids[i * batch : (i + 1) * batch])) for i in range(steps)]
    results = []
    for label, table_optimizer, make in [
        (LAYER, lambda: kto.EmbeddingAdam(0.01), lambda: keras.optimizers.Adam(0.01)),
        (
            PER_ROW,
            lambda: kto.EmbeddingAdam(0.01, bias_correction="per_row"),
            lambda: keras.optimizers.Adam(0.01),
        ),
        ("keras_tpu_optim.EmbeddingAdam", None, lambda: kto.EmbeddingAdam(0.01)),
        ("keras.optimizers.Adam", None, lambda: keras.optimizers.Adam(0.01)),
    ]:
        print(f"\n[Recommender, {users:,}-row table] {label}")
        model, optimizer, timer = build(table_optimizer), make(), _StepTimer.make()
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)],
        )
        history = model.fit(
            {"user": user_ids, "item": item_ids},
            clicks,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            callbacks=[timer],
            verbose=1,
        )
        results.append(
            dict(
                label=label,
                losses=timer.losses,
                elapsed=timer.elapsed,
                final_loss=timer.losses[-1],
                accuracy=float(history.history["binary_accuracy"][-1]),
                step_ms=_median_step_ms(timer.seconds),
                rows_updated=float(np.mean(touched))
                if "keras_tpu_optim" in label
                else float(users),
            )
        )
    return results, users, touched


# The tables trained in the lookup (`layers.Embedding`) by EmbeddingAdam, and with its per-row bias correction.
LAYER = "keras_tpu_optim.layers.Embedding"
PER_ROW = "keras_tpu_optim.layers.Embedding(per_row)"


# Why Keras's optimizers' numbers on TensorFlow are not those of JAX, torch or the dense gradient.
TF_SPARSE_NOTE = (
    "Note: on TensorFlow, Keras's Adafactor and Adam square an embedding's tf.IndexedSlices gradient before "
    "summing its duplicate ids, so their numbers here differ from Keras's on JAX and torch and from the dense "
    "gradient's; keras_tpu_optim's are the dense gradient's."
)


def _short(label):
    return label.replace("keras.optimizers.", "keras ").replace("keras_tpu_optim.", "ours ")


def _figure(path, lm, rec, backend):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "ours": "C0",
        "keras Adafactor": "C1",
        "keras Adam": "C2",
        _short(PER_ROW): "C3",
        _short(LAYER): "C4",
    }
    color = lambda label: colors.get(label, colors["ours"] if label.startswith("ours") else None)  # noqa: E731
    fig, axes = plt.subplots(2, 4, figsize=(21, 8))
    for r in lm:
        axes[0, 0].plot(r["losses"], label=_short(r["label"]), color=color(_short(r["label"])))
    axes[0, 0].set(title="Language model: training loss", xlabel="step", ylabel="loss")
    axes[0, 0].legend()
    lm_names = [_short(r["label"]) for r in lm]
    lm_colors = [color(n) for n in lm_names]
    axes[0, 1].bar(lm_names, [r["state_bytes"] / r["param_bytes"] for r in lm], color=lm_colors)
    axes[0, 1].set(title="LM: optimizer state / parameter bytes", yscale="log")
    axes[0, 2].bar(lm_names, [r["step_ms"] for r in lm], color=lm_colors)
    axes[0, 2].set(title="LM: median time per step (ms)")
    for r in rec:
        axes[1, 0].plot(r["losses"], label=_short(r["label"]), color=color(_short(r["label"])))
    axes[1, 0].set(title="Recommender: training loss", xlabel="step", ylabel="loss")
    axes[1, 0].legend()
    rec_names = [_short(r["label"]) for r in rec]
    rec_colors = [color(n) for n in rec_names]
    axes[1, 1].bar(rec_names, [r["step_ms"] for r in rec], color=rec_colors)
    axes[1, 1].set(title="Recommender: median time per step (ms)")
    axes[1, 2].bar(rec_names, [r["rows_updated"] for r in rec], color=rec_colors)
    axes[1, 2].set(title="Recommender: user-table rows updated per step", yscale="log")
    for row, results, name in ((0, lm, "Language model"), (1, rec, "Recommender")):
        for r in results:
            axes[row, 3].plot(
                r["elapsed"], r["losses"], label=_short(r["label"]), color=color(_short(r["label"]))
            )
        axes[row, 3].set(
            title=f"{name}: loss against wall-clock time",
            xlabel="seconds after the first (compiling) step",
            ylabel="loss",
        )
        axes[row, 3].legend()
    for axis in (axes[1, 1], axes[1, 2]):
        axis.tick_params(axis="x", labelrotation=10, labelsize=8)
    fig.suptitle(f"keras_tpu_optim demo ({backend} backend)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parse(argv)
    import keras

    if args.backend and args.backend != keras.backend.backend():
        # Keras chose its backend when it was imported (with this package): run the demo in a process of
        # its own on the one asked for, leaving this process's environment as it is.
        import subprocess

        argv = sys.argv[1:] if argv is None else list(argv)
        child = subprocess.run(
            [sys.executable, "-m", "keras_tpu_optim", *argv],
            env=dict(os.environ, KERAS_BACKEND=args.backend),
            check=False,
        )
        return child.returncode

    steps = args.steps or (3 if args.quick else 60)
    if steps < 2:
        print("--steps must be at least 2", file=sys.stderr)
        return 2
    backend = keras.backend.backend()
    print(f"keras_tpu_optim demo on the {backend} backend, {steps} steps per optimizer")

    lm = _language_model(args.quick, steps)
    rec, users, touched = _recommender(args.quick, steps)

    print("\nPart 1 - language model")
    print(
        f"{'optimizer':<30} {'final loss':>10} {'state bytes':>13} {'state/params':>13} {'ms/step':>9}"
    )
    for r in lm:
        print(
            f"{r['label']:<30} {r['final_loss']:>10.4f} {r['state_bytes']:>13,} "
            f"{r['state_bytes'] / r['param_bytes']:>13.4f} {r['step_ms']:>9.1f}"
        )
    print(
        f"\nPart 2 - recommender, {users:,}-row user table; each step looked up "
        f"{min(touched):,}-{max(touched):,} distinct users"
    )
    print(
        f"{'optimizer':<42} {'final loss':>10} {'accuracy':>9} {'rows updated/step':>18} {'ms/step':>9} {'train s':>8}"
    )
    for r in rec:
        print(
            f"{r['label']:<42} {r['final_loss']:>10.4f} {r['accuracy']:>9.3f} "
            f"{r['rows_updated']:>18,.0f} {r['step_ms']:>9.1f} {r['elapsed'][-1]:>8.2f}"
        )
    print("(train s: wall-clock seconds of the steps after the first, which compiles)")
    print(
        "(layers.Embedding: the tables trained by EmbeddingAdam in the lookup, the head by keras.optimizers.Adam;\n"
        " keras_tpu_optim.EmbeddingAdam: Keras's tables trained by it as the model's optimizer)"
    )
    print(
        f"bias_correction='per_row' (each row's Adam bias correction counts that row's own updates): "
        f"final loss {rec[1]['final_loss']:.4f} against {rec[0]['final_loss']:.4f} with the TPU's global "
        f"correction and {rec[3]['final_loss']:.4f} with keras.optimizers.Adam."
    )
    if backend == "tensorflow":
        # Both parts train Keras Embeddings, whose TF gradient is a tf.IndexedSlices with duplicate ids.
        print(TF_SPARSE_NOTE)
    layer, dense_path, keras_adam = rec[0]["step_ms"], rec[2]["step_ms"], rec[3]["step_ms"]
    print(
        f"\nTables trained in the lookup, step time: {layer / keras_adam:.2f}x keras.optimizers.Adam "
        f"({dense_path / keras_adam:.2f}x with EmbeddingAdam as the model's optimizer); "
        f"Adafactor state: {lm[0]['state_bytes'] / lm[1]['state_bytes']:.3f}x keras.optimizers.Adafactor"
    )

    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    _figure(out, lm, rec, backend)
    print(f"Figure written to {out}")
    return 0
