"""The optimizer's options object for a numpy reference's settings: shared by the kernel tests."""

from __future__ import annotations

from keras_tpu_optim._math.adafactor import AdafactorOptions
from reference.numpy_adafactor import NumpyAdafactor


def make_options(reference: NumpyAdafactor, **extra) -> AdafactorOptions:
    """`AdafactorOptions` with the reference's settings (`extra`: options the reference lacks)."""
    settings = dict(
        beta_2_decay=reference.beta_2_decay,
        epsilon_1=reference.epsilon_1,
        epsilon_2=reference.epsilon_2,
        clip_threshold=reference.clip_threshold,
        relative_step=reference.relative_step,
        multiply_by_parameter_scale=reference.multiply_by_parameter_scale,
        beta_1=reference.beta_1,
        decay_offset=reference.decay_offset,
        beta_2_cap=reference.beta_2_cap,
    )
    return AdafactorOptions(**{**settings, **extra})
