"""Keras 3 optimizers for TPU-scale training, on TensorFlow, JAX and PyTorch.

- `Adafactor`: `keras.optimizers.Adafactor`'s API and numbers, in sublinear memory.
- `EmbeddingAdam`: lazy Adam for embedding tables with the semantics of
  `tf.tpu.experimental.embedding.Adam`, fast on sparse gradients.
- `keras_tpu_optim.tpu.to_tpu_embedding`: export an `EmbeddingAdam` to the
  TPU embedding engines.
- `keras_tpu_optim.layers.Embedding`: `keras.layers.Embedding` trained by its own
  `EmbeddingAdam` in the backward pass of its lookup, at the cost of the rows looked up.
- `load_checkpoint`: resume from a `keras.callbacks.OrbaxCheckpoint` with the saved
  state checked against the model and optimizer first.
"""

__version__ = "0.1.0"

from keras_tpu_optim.adafactor import Adafactor
from keras_tpu_optim.embedding_adam import EmbeddingAdam
from keras_tpu_optim import layers, tpu
from keras_tpu_optim._orbax import load_checkpoint

__all__ = ["Adafactor", "EmbeddingAdam", "layers", "load_checkpoint", "tpu", "__version__"]
