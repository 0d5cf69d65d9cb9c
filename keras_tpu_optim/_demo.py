"""The demo behind `python -m keras_tpu_optim`: a small LM and a recommender trained with keras_tpu_optim
and Keras's optimizers on synthetic data; a summary on the terminal and a PNG figure."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import keras
import numpy as np

import keras_tpu_optim as kto

# The tables trained in the lookup (`layers.Embedding`) by EmbeddingAdam, and with its per-row bias correction.
LAYER = "keras_tpu_optim.layers.Embedding"
PER_ROW = "keras_tpu_optim.layers.Embedding(per_row)"
EXACT = "keras_tpu_optim.layers.Embedding(lazy_adam=False)"
DENSE = "keras_tpu_optim.EmbeddingAdam(lazy_adam=False)"

# Why Keras's optimizers' numbers on TensorFlow are not those of JAX, torch or the dense gradient.
TF_SPARSE_NOTE = (
    "Note: on TensorFlow, Keras's Adafactor and Adam square an embedding's tf.IndexedSlices gradient before "
    "summing its duplicate ids, so their numbers here differ from Keras's on JAX and torch and from the dense "
    "gradient's; keras_tpu_optim's are the dense gradient's."
)


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m keras_tpu_optim",
        description="Train a small LM and a recommender with keras_tpu_optim and Keras's optimizers, side by side.",
    )
    add = parser.add_argument
    add(
        "--backend",
        choices=["tensorflow", "jax", "torch"],
        help="Keras backend (default: KERAS_BACKEND, else Keras's default)",
    )
    add("--steps", type=int, help="training steps per optimizer (default 60; 3 with --quick)")
    add("--out", default="keras_tpu_optim_demo.png", help="where to write the PNG figure")
    add("--quick", action="store_true", help="tiny models and a few steps (what the tests run)")
    return parser.parse_args(argv)


def _train(label, model, optimizer, x, y, batch, **compile_args):
    """Fit `model` for one epoch, timing each step; the history and what both parts report."""

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            seconds.append(time.perf_counter() - self._start)
            elapsed.append(sum(seconds[1:]))  # wall-clock time after the first (compiling) step
            losses.append(float(logs["loss"]))

    losses, seconds, elapsed = [], [], []
    model.compile(optimizer=optimizer, **compile_args)
    history = model.fit(x, y, batch_size=batch, shuffle=False, callbacks=[StepTimer()], verbose=1)
    step_ms = float(np.median(seconds[1:] or seconds)) * 1000  # the first step compiles
    result = {"label": label, "losses": losses, "elapsed": elapsed, "final_loss": losses[-1]}
    return history, {**result, "step_ms": step_ms}


def _language_model(quick, steps):
    vocab, seq, width = (96, 16, 32) if quick else (2000, 64, 128)
    heads, blocks, batch = (2, 1, 8) if quick else (4, 2, 32)
    rng = np.random.default_rng(0)
    # A random bigram language: each token has 4 likely successors, so there is something to learn.
    successors = rng.integers(0, vocab, size=(vocab, 4))
    tokens = np.empty((steps * batch, seq + 1), dtype="int32")
    tokens[:, 0] = rng.integers(0, vocab, size=len(tokens))
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t], rng.integers(0, 4, size=len(tokens))]

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((seq,), dtype="int32")
        x = keras.layers.Embedding(vocab, width)(inputs)
        for _ in range(blocks):
            attention = keras.layers.MultiHeadAttention(heads, width // heads)
            x = keras.layers.LayerNormalization()(x + attention(x, x, use_causal_mask=True))
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
        model, optimizer = build(), make()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        _, result = _train(label, model, optimizer, tokens[:, :-1], tokens[:, 1:], batch, loss=loss)
        param_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        state_bytes = sum(
            int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in optimizer.variables
        )
        result.update(state_bytes=state_bytes, state_ratio=state_bytes / param_bytes)
        results.append(result)
    return results


def _recommender(quick, steps):
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
        u, v = (
            keras.layers.Embedding(rows, dim, name=name)(ids)
            if table_optimizer is None
            else kto.layers.Embedding(rows, dim, optimizer=table_optimizer(), name=name)(ids)
            for rows, name, ids in ((users, "user_table", user), (items, "item_table", item))
        )
        logit = keras.layers.Dense(1)(keras.layers.Concatenate()([u, v, u * v]))
        return keras.Model({"user": user, "item": item}, logit, name="recommender")

    touched = [len(np.unique(user_ids[i * batch : (i + 1) * batch])) for i in range(steps)]
    results = []
    adam = functools.partial(keras.optimizers.Adam, 0.01)
    for label, table_optimizer, make in [
        (LAYER, lambda: kto.EmbeddingAdam(0.01), adam),
        (PER_ROW, lambda: kto.EmbeddingAdam(0.01, bias_correction="per_row"), adam),
        (EXACT, lambda: kto.EmbeddingAdam(0.01, lazy_adam=False), adam),
        # Ordinary Adam with the layers' numbers, stepping every row: the reference of `EXACT`.
        (DENSE, None, lambda: kto.EmbeddingAdam(0.01, lazy_adam=False)),
        ("keras.optimizers.Adam", None, adam),
    ]:
        print(f"\n[Recommender, {users:,}-row table] {label}")
        model, optimizer = build(table_optimizer), make()
        loss = keras.losses.BinaryCrossentropy(from_logits=True)
        metrics = [keras.metrics.BinaryAccuracy(threshold=0.0)]
        inputs = {"user": user_ids, "item": item_ids}
        history, result = _train(
            label, model, optimizer, inputs, clicks, batch, loss=loss, metrics=metrics
        )
        result["accuracy"] = float(history.history["binary_accuracy"][-1])
        every_row = label in (DENSE, "keras.optimizers.Adam")
        result["rows_updated"] = float(users if every_row else np.mean(touched))
        results.append(result)
    return results, users, touched


def _short(label):
    return label.replace("keras.optimizers.", "keras ").replace("keras_tpu_optim.", "ours ")


def _figure(path, lm, rec, backend):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = [
        "ours",
        "keras Adafactor",
        "keras Adam",
        _short(PER_ROW),
        _short(LAYER),
        _short(EXACT),
    ]
    colors = {label: f"C{i}" for i, label in enumerate(ordered)}
    fig, axes = plt.subplots(2, 4, figsize=(21, 8))
    bars = (
        ("state_ratio", "LM: optimizer state / parameter bytes", "log"),
        ("step_ms", "LM: median time per step (ms)", None),
        ("step_ms", "Recommender: median time per step (ms)", None),
        ("rows_updated", "Recommender: user-table rows updated per step", "log"),
    )
    for row, results, name in ((0, lm, "Language model"), (1, rec, "Recommender")):
        names = [_short(r["label"]) for r in results]
        # Ours that have no color of their own take the one of "ours".
        shades = [colors.get(n, colors["ours"] if n.startswith("ours") else None) for n in names]
        for r, label, shade in zip(results, names, shades):
            axes[row, 0].plot(r["losses"], label=label, color=shade)
            axes[row, 3].plot(r["elapsed"], r["losses"], label=label, color=shade)
        axes[row, 0].set(title=f"{name}: training loss", xlabel="step", ylabel="loss")
        axes[row, 3].set(
            title=f"{name}: loss against wall-clock time",
            xlabel="seconds after the first (compiling) step",
            ylabel="loss",
        )
        for column, (key, title, scale) in enumerate(bars[2 * row : 2 * row + 2], start=1):
            axes[row, column].bar(names, [r[key] for r in results], color=shades)
            axes[row, column].set(title=title, **({"yscale": scale} if scale else {}))
        axes[row, 0].legend()
        axes[row, 3].legend()
    for axis in (axes[1, 1], axes[1, 2]):
        axis.tick_params(axis="x", labelrotation=10, labelsize=8)
    fig.suptitle(f"keras_tpu_optim demo ({backend} backend)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.backend and args.backend != keras.backend.backend():
        # Keras chose its backend when it was imported (with this package): run the demo in a process of
        # its own on the one asked for, leaving this process's environment as it is.
        import subprocess

        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run(
            [sys.executable, "-m", "keras_tpu_optim", *argv],
            env=dict(os.environ, KERAS_BACKEND=args.backend),
            check=False,
        ).returncode

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
            f"{r['state_ratio']:>13.4f} {r['step_ms']:>9.1f}"
        )
    print(
        f"\nPart 2 - recommender, {users:,}-row user table; each step looked up "
        f"{min(touched):,}-{max(touched):,} distinct users"
    )
    width = max(len(r["label"]) for r in rec)
    print(
        f"{'optimizer':<{width}} {'final loss':>10} {'accuracy':>9} {'rows updated/step':>18} {'ms/step':>9} "
        f"{'train s':>8}"
    )
    for r in rec:
        print(
            f"{r['label']:<{width}} {r['final_loss']:>10.4f} {r['accuracy']:>9.3f} "
            f"{r['rows_updated']:>18,.0f} {r['step_ms']:>9.1f} {r['elapsed'][-1]:>8.2f}"
        )
    print("(train s: wall-clock seconds of the steps after the first, which compiles)")
    print(
        "(layers.Embedding: the tables trained by EmbeddingAdam in the lookup, the head by keras.optimizers.Adam;\n"
        f" {DENSE}: Keras's tables trained by it as the model's optimizer)"
    )
    print(
        f"bias_correction='per_row' (each row's Adam bias correction counts that row's own updates): "
        f"final loss {rec[1]['final_loss']:.4f} against {rec[0]['final_loss']:.4f} with the TPU's global "
        f"correction and {rec[4]['final_loss']:.4f} with keras.optimizers.Adam."
    )
    exact, dense = rec[2], rec[3]
    print(
        f"lazy_adam=False in the lookup (ordinary Adam, skipped steps caught up): final loss "
        f"{exact['final_loss']:.4f} against {dense['final_loss']:.4f} for the same ordinary Adam stepping every "
        f"row ({DENSE} as the model's optimizer, a correct dense Adam on every backend) and "
        f"{rec[0]['final_loss']:.4f} lazy, at {exact['step_ms'] / rec[4]['step_ms']:.3f}x "
        "keras.optimizers.Adam's step time."
    )
    if backend == "tensorflow":
        # Both parts train Keras Embeddings, whose TF gradient is a tf.IndexedSlices with duplicate ids.
        print(TF_SPARSE_NOTE)
    layer, dense_path, keras_adam = rec[0]["step_ms"], rec[3]["step_ms"], rec[4]["step_ms"]
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
