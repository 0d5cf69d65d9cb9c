"""What both TPU exports share (in `keras.ops` only): the options no engine can honour, and
the learning rate."""

from __future__ import annotations

import warnings

from keras_tpu_optim import _private

# Why an engine cannot honour an option; `{engine}` names it.
_WHY = {
    "clipnorm": "the {engine} clips gradients per element only (`clipvalue`), never by norm.",
    "global_clipnorm": "the {engine} cannot see the gradients of the other variables to compute "
    "their norm.",
    "use_ema": "the {engine} keeps no moving average of the table.",
    "loss_scale_factor": "the {engine} receives the gradients of the scaled loss and does not "
    "unscale them (Adam is not scale-invariant through epsilon, clipping and decay).",
    "gradient_accumulation_steps": "the {engine} applies every step's gradients at once. (Not to be "
    "confused with `use_gradient_accumulation`, the summing of duplicate ids.)",
    "second_moment": "the {engine} keeps Adam's velocities at the table's shape, one per element, "
    "not one per row.",
    "bias_correction": "the {engine} applies one learning rate to every row of a step and keeps no "
    "per-row step count, so only the global bias correction (folded into that rate) is expressible.",
    "lazy_adam": "the {engine} updates only the rows looked up in the step; ordinary (non-lazy) "
    "Adam would also decay the slots of every other row.",
    "use_gradient_accumulation": "the {engine} always sums the gradients of duplicate ids, so it "
    "cannot reproduce the last-occurrence-wins update of `use_gradient_accumulation=False`.",
    "slot_variable_creation_fn": "the {engine} creates the slots itself from initializers (zeros).",
    "low_dimensional_packing_status": "it is a setting of TensorFlow's TPUEmbedding; the {engine} "
    "has no such setting.",
}


def _refuse(optimizer, engine: str, *refusals) -> None:
    """Raise for the first `(option, refused)` refused."""
    for option, refused in refusals:
        if refused:
            raise ValueError(
                f"`to_tpu_embedding` cannot export option `{option}={getattr(optimizer, option)!r}`: "
                f"{_WHY[option].format(engine=engine)} Unset `{option}` on the EmbeddingAdam that is "
                "exported."
            )


def check_options(optimizer, engine: str, *engine_refusals) -> None:
    """Refuse the first option the engine cannot honour (then the first of `engine_refusals`): it sees
    one table's gradient at a time, keeps only the table and slots of its shape, and applies one
    learning rate to every row of a step."""
    o = optimizer
    _refuse(
        o,
        engine,
        ("clipnorm", o.clipnorm is not None),
        ("global_clipnorm", o.global_clipnorm is not None),
        ("use_ema", o.use_ema),
        ("loss_scale_factor", o.loss_scale_factor is not None),
        ("gradient_accumulation_steps", o.gradient_accumulation_steps is not None),
    )
    if o.weight_decay is not None and _private.has_weight_decay_exclusions(o):
        raise ValueError(
            "`to_tpu_embedding` cannot export `weight_decay` together with "
            "`exclude_from_weight_decay(...)`: the export is one table's optimizer and cannot "
            "tell which variables are excluded. Export an optimizer without exclusions for the "
            "tables to decay, and one without `weight_decay` for the others."
        )
    defaults = dict(momentum_dtype="float32", velocity_dtype="float32", stochastic_rounding=False)
    half = [
        f"{name}={getattr(o, name)!r}"
        for name, default in defaults.items()
        if getattr(o, name) != default
    ]
    if half:
        warnings.warn(
            f"`to_tpu_embedding`: the {engine} keeps its tables and slots in float32 and rounds to "
            f"nearest, so {', '.join(half)} is not carried over: state moved there is cast to float32.",
            stacklevel=3,
        )
    _refuse(
        o,
        engine,
        ("second_moment", o.second_moment != "full"),
        ("bias_correction", o.bias_correction != "global"),
        *engine_refusals,
    )
