"""Train a small recommender with EmbeddingAdam on the backend KERAS_BACKEND selects.

Run by tests/test_embedding_adam_cross_backend.py once per backend, each in its own
process: `python tests/_cross_backend_recommender.py INPUT.npz OUTPUT_PREFIX CASES_JSON`. INPUT holds
the initial weights (`embedding`, `kernel`, `bias`) and the data (`ids`, `targets`);
CASES_JSON maps a case name to extra EmbeddingAdam keyword arguments; `OUTPUT_PREFIX_<case>.npz`
receives each case's weights after training, under the same names.
"""

import json
import sys

import keras
import numpy as np

import keras_tpu_optim as kto

STEPS_PER_EPOCH_BATCH = 16
EPOCHS = 3


def build_model(vocabulary, dim, ids_per_example):
    return keras.Sequential(
        [
            keras.Input((ids_per_example,), dtype="int32"),
            keras.layers.Embedding(vocabulary, dim, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, name="score"),
        ]
    )


def train(data, options):
    vocabulary, dim = data["embedding"].shape
    keras.backend.clear_session(free_memory=False)
    model = build_model(vocabulary, dim, data["ids"].shape[1])
    model.set_weights([data["embedding"], data["kernel"], data["bias"]])
    optimizer = kto.EmbeddingAdam(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(
            0.02, decay_steps=3, decay_rate=0.7
        ),
        clipvalue=(-0.05, None),
        weight_decay_factor=0.5,
        multiply_weight_decay_factor_by_learning_rate=True,
        clip_weight_max=0.12,
        **options,
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        data["ids"],
        data["targets"],
        batch_size=STEPS_PER_EPOCH_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    embedding, kernel, bias = model.get_weights()
    return dict(
        embedding=embedding,
        kernel=kernel,
        bias=bias,
        iterations=np.asarray(keras.ops.convert_to_numpy(optimizer.iterations)),
    )


def main(input_path, output_prefix, cases):
    data = np.load(input_path)
    for name, options in json.loads(cases).items():
        np.savez(f"{output_prefix}_{name}.npz", **train(data, options))


if __name__ == "__main__":
    main(*sys.argv[1:])
