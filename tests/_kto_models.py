"""Tiny models, synthetic data and hand-written training steps shared by the
Keras-integration tests and their subprocess worker (`_resume_worker.py`).

Everything here is plain Keras: nothing imports the code under test except to
construct optimizers from a description, so it can serve as the reference.
"""

from __future__ import annotations

import numpy as np

import keras
from keras import layers

import keras_tpu_optim as kto

SEQ_LEN, VOCAB, CLASSES = 6, 20, 4
USERS, ITEMS, DIM = 2_000, 300, 8


# ------------------------------------------------------------------- models


def transformer_model(dtype=None):
    """One pre-norm-free transformer block over token embeddings, pooled to a class."""
    tokens = keras.Input((SEQ_LEN,), dtype="int32")
    x = layers.Embedding(VOCAB, 8, dtype=dtype)(tokens)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=4, dtype=dtype)(x, x)
    x = layers.LayerNormalization(dtype=dtype)(layers.Add(dtype=dtype)([x, attention]))
    hidden = layers.Dense(16, activation="relu", dtype=dtype)(x)
    x = layers.LayerNormalization(dtype=dtype)(
        layers.Add(dtype=dtype)([x, layers.Dense(8, dtype=dtype)(hidden)])
    )
    x = layers.GlobalAveragePooling1D(dtype=dtype)(x)
    logits = layers.Dense(CLASSES, dtype=dtype)(x)
    logits = layers.Activation("linear", dtype="float32")(logits)
    return keras.Model(tokens, logits)


def transformer_data(n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    # Class c draws most of its tokens from its own band of the vocabulary.
    band = VOCAB // CLASSES
    own = y[:, None] * band + rng.integers(0, band, size=(n, SEQ_LEN))
    noise = rng.integers(0, VOCAB, size=(n, SEQ_LEN))
    x = np.where(rng.random((n, SEQ_LEN)) < 0.7, own, noise).astype("int32")
    return x, y


def recommender_model(dtype=None):
    """A user table of USERS rows (the large, sparsely touched one) and an item table."""
    ids = keras.Input((2,), dtype="int32")
    users = layers.Embedding(USERS, DIM, dtype=dtype, name="users")(ids[:, 0])
    items = layers.Embedding(ITEMS, DIM, dtype=dtype, name="items")(ids[:, 1])
    score = layers.Dot(axes=1, dtype=dtype)([users, items])
    score = layers.Activation("linear", dtype="float32")(score)
    return keras.Model(ids, score)


def recommender_data(n, seed=0, active_users=200):
    rng = np.random.default_rng(seed)
    true_users = rng.normal(size=(active_users, DIM)).astype("float32")
    true_items = rng.normal(size=(ITEMS, DIM)).astype("float32")
    user_rows = rng.choice(USERS, size=active_users, replace=False)
    picked = rng.integers(0, active_users, size=n)
    items = rng.integers(0, ITEMS, size=n)
    x = np.stack([user_rows[picked], items], axis=1).astype("int32")
    y = np.sum(true_users[picked] * true_items[items], axis=1, keepdims=True).astype(
        "float32"
    ) / np.sqrt(DIM)
    return x, y


def mlp_model(dtype=None):
    """The smallest model with a factored (rank-2) and an unfactored (rank-1) variable."""
    inputs = keras.Input((4,))
    hidden = layers.Dense(8, activation="tanh", dtype=dtype)(inputs)
    outputs = layers.Dense(1, dtype=dtype)(hidden)
    return keras.Model(inputs, layers.Activation("linear", dtype="float32")(outputs))


def mlp_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]).astype("float32")
    return x, y


MODELS = {
    "mlp": (mlp_model, mlp_data, "mse"),
    "transformer": (
        transformer_model,
        transformer_data,
        "sparse_categorical_crossentropy_from_logits",
    ),
    "recommender": (recommender_model, recommender_data, "mse"),
}


def loss_object(name):
    if name == "mse":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(kind, seed=1, dtype=None):
    """The model of `kind`, with weights drawn from `seed` (identical within a backend)."""
    keras.utils.set_random_seed(seed)
    builder = MODELS[kind][0]
    return builder(dtype=dtype)


def make_data(kind, n, seed=0):
    return MODELS[kind][1](n, seed=seed)


def make_optimizer(spec):
    """An optimizer from a JSON-able spec: {"class": "Adafactor", "kwargs": {...}, "schedule": ...}."""
    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("schedule"):
        kwargs["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(
            initial_learning_rate=spec["schedule"], decay_steps=2, decay_rate=0.5
        )
    return getattr(kto, spec["class"])(**kwargs)


def compile_model(model, kind, optimizer, **kwargs):
    model.compile(optimizer=optimizer, loss=loss_object(MODELS[kind][2]), **kwargs)
    return model


def weights_of(model):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.trainable_variables]


def optimizer_state(optimizer):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in optimizer.variables]


# ------------------------------------------------------- hand-written steps


def gradient_fn(model, loss_fn):
    """`(x, y) -> gradients` of the batch loss w.r.t. model.trainable_variables, per backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_gradients(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        return tf_gradients
    if backend == "torch":

        def torch_gradients(x, y):
            model.zero_grad()
            loss_fn(y, model(x, training=True)).backward()
            return [v.value.grad.detach().clone() for v in model.trainable_variables]

        return torch_gradients
    import jax

    @jax.jit
    def jax_gradients(trainable, non_trainable, x, y):
        def batch_loss(trainable):
            y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return loss_fn(y, y_pred)

        return jax.grad(batch_loss)(trainable)

    return lambda x, y: jax_gradients(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        x,
        y,
    )


def custom_training_loop(model, optimizer, loss_fn, batches):
    """Train the way the Keras "training loop from scratch" guides write it, per backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
                scaled_loss = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled_loss, model.trainable_weights)
            optimizer.apply(grads, model.trainable_weights)
            return loss

        for x, y in batches:
            train_step(tf.constant(x), tf.constant(y))
        return

    if backend == "torch":
        import torch

        for x, y in batches:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            model.zero_grad()
            optimizer.scale_loss(loss).backward()
            grads = [v.value.grad for v in model.trainable_weights]
            with torch.no_grad():
                optimizer.apply(grads, model.trainable_weights)
        return

    import jax

    optimizer.build(model.trainable_variables)

    def compute_loss_and_updates(
        trainable_variables, non_trainable_variables, optimizer_variables, x, y
    ):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        loss = loss_fn(y, y_pred)
        # scale_loss reads the LossScaleOptimizer's dynamic scale: map it to the state.
        with keras.StatelessScope(
            state_mapping=list(zip(optimizer.variables, optimizer_variables))
        ):
            scaled_loss = optimizer.scale_loss(loss)
        return scaled_loss, (loss, non_trainable_variables)

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables = state
        x, y = data
        (_, (loss, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, optimizer_variables, x, y
        )
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    for x, y in batches:
        _, state = train_step(state, (x, y))
    for variable, value in zip(model.trainable_variables, state[0]):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, state[1]):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, state[2]):
        variable.assign(value)


def batches_of(x, y, batch_size):
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def fit_steps(model, x, y, batch_size):
    """One epoch over (x, y) in order: len(x) / batch_size optimizer steps."""
    return model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
