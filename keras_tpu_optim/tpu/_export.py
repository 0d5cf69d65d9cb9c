"""What both TPU exports share (in `keras.ops` only): the options no engine can honour, and
the learning rate."""

from __future__ import annotations

from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._math import embedding_adam as adam_math


def unsupported_option(option: str, value, why: str) -> ValueError:
    """The ValueError for an option the engine cannot honour, naming it."""
    return ValueError(
        f"`to_tpu_embedding` cannot export option `{option}={value!r}`: {why} "
        f"Unset `{option}` on the EmbeddingAdam that is exported."
    )


def check_keras_options(optimizer, engine: str) -> None:
    """Refuse the first Keras base option the engine cannot honour: it sees one table's
    gradient at a time and keeps only the table and its slots."""
    if optimizer.clipnorm is not None:
        raise unsupported_option(
            "clipnorm",
            optimizer.clipnorm,
            f"the {engine} clips gradients per element only (`clipvalue`), never by norm.",
        )
    if optimizer.global_clipnorm is not None:
        raise unsupported_option(
            "global_clipnorm",
            optimizer.global_clipnorm,
            f"the {engine} cannot see the gradients of the other variables to compute their norm.",
        )
    if optimizer.use_ema:
        raise unsupported_option(
            "use_ema", optimizer.use_ema, f"the {engine} keeps no moving average of the table."
        )
    if optimizer.loss_scale_factor is not None:
        raise unsupported_option(
            "loss_scale_factor",
            optimizer.loss_scale_factor,
            f"the {engine} receives the gradients of the scaled loss and does not unscale them "
            "(Adam is not scale-invariant through epsilon, clipping and decay).",
        )
    if optimizer.gradient_accumulation_steps is not None:
        raise unsupported_option(
            "gradient_accumulation_steps",
            optimizer.gradient_accumulation_steps,
            f"the {engine} applies every step's gradients at once. (Not to be confused with "
            "`use_gradient_accumulation`, the summing of duplicate ids.)",
        )
    if optimizer.weight_decay is not None and _private.has_weight_decay_exclusions(optimizer):
        raise ValueError(
            "`to_tpu_embedding` cannot export `weight_decay` together with "
            "`exclude_from_weight_decay(...)`: the export is one table's optimizer and cannot "
            "tell which variables are excluded. Export an optimizer without exclusions for the "
            "tables to decay, and one without `weight_decay` for the others."
        )


def check_row_options(optimizer, engine: str) -> None:
    """Refuse the first row option neither engine can express: both keep slots of the table's
    shape and apply one learning rate to every row of a step."""
    if optimizer.second_moment != "full":
        raise unsupported_option(
            "second_moment",
            optimizer.second_moment,
            f"the {engine} keeps Adam's velocities at the table's shape, one per element, not one per row.",
        )
    if optimizer.bias_correction != "global":
        raise unsupported_option(
            "bias_correction",
            optimizer.bias_correction,
            f"the {engine} applies one learning rate to every row of a step and keeps no per-row "
            "step count, so only the global bias correction (folded into that rate) is expressible.",
        )


def bias_corrected_learning_rate_at(optimizer, step):
    """`lr_t` of the update that follows `step` applied updates (t = step + 1), float32."""
    return adam_math.bias_corrected_learning_rate(
        ops.cast(_private.learning_rate_at(optimizer, step), "float32"),
        ops.cast(step, "float32") + 1.0,
        optimizer.beta_1,
        optimizer.beta_2,
    )
