"""Adafactor in plain numpy, written from docs/algorithms.md#adafactor (not from the package's code).

All arithmetic is float64; a variable of a lower-precision dtype (float32,
bfloat16, float16) is read in float64 and its new value rounded once back to
its dtype, which is what the package promises ("computed in float32 and
rounded once"). Second-moment statistics are kept in float64, so they never
underflow.

Step t = iterations + 1:

    rho_t   = min(lr, 1/sqrt(t)) if relative_step else lr
    alpha_t = max(epsilon_2, RMS(var)) * rho_t     (rho_t if not multiply_by_parameter_scale)
    G2      = g^2 + epsilon_1
    beta2_t = min(1 - (t - decay_offset)^beta_2_decay, beta_2_cap)   (t - decay_offset floored at 1)
    factored:   R = beta2_t R + (1-beta2_t) mean(G2, -1)
                C = beta2_t C + (1-beta2_t) mean(G2, -2)
                u = g / sqrt(R / mean(R, -1))[..., :, None] / sqrt(C)[..., None, :]
    unfactored: V = beta2_t V + (1-beta2_t) G2;  u = g / sqrt(V)
    u_hat   = u / max(1, RMS(u) / clip_threshold)
    delta   = alpha_t * u_hat
    beta_1:     m = beta_1 m + (1-beta_1) delta;  var -= m
    otherwise:  var -= delta

Keras's decoupled weight decay, when asked for, runs before the update, as in
`keras.optimizers.Optimizer`: `var -= var * weight_decay * lr` with the
uncapped learning rate, skipped for variables whose name is excluded.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import numpy as np


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


class NumpyAdafactor:
    """A stateful numpy Adafactor: `step(params, grads)` returns the new params."""

    def __init__(
        self,
        learning_rate: Union[float, Callable[[int], float]] = 0.001,
        beta_2_decay: float = -0.8,
        epsilon_1: float = 1e-30,
        epsilon_2: float = 1e-3,
        clip_threshold: float = 1.0,
        relative_step: bool = True,
        beta_1: Optional[float] = None,
        min_dim_size_to_factor: Optional[int] = None,
        multiply_by_parameter_scale: bool = True,
        decay_offset: int = 0,
        beta_2_cap: Optional[float] = None,
        weight_decay: Optional[float] = None,
        exclude_from_weight_decay: Sequence[str] = (),
    ):
        self.learning_rate = learning_rate
        self.beta_2_decay = beta_2_decay
        self.epsilon_1 = epsilon_1
        self.epsilon_2 = epsilon_2
        self.clip_threshold = clip_threshold
        self.relative_step = relative_step
        self.beta_1 = beta_1
        self.min_dim_size_to_factor = min_dim_size_to_factor
        self.multiply_by_parameter_scale = multiply_by_parameter_scale
        self.decay_offset = decay_offset
        self.beta_2_cap = beta_2_cap
        self.weight_decay = weight_decay
        self.exclude_from_weight_decay = tuple(exclude_from_weight_decay)
        self.iterations = 0
        self.state: Optional[list] = None

    def is_factored(self, shape) -> bool:
        if len(shape) < 2:
            return False
        if self.min_dim_size_to_factor is None:
            return True
        return min(shape[-2], shape[-1]) >= self.min_dim_size_to_factor

    def _initial_state(self, shape) -> dict:
        shape = tuple(shape)
        if self.is_factored(shape):
            state = {
                "row": np.zeros(shape[:-1]),
                "column": np.zeros(shape[:-2] + shape[-1:]),
            }
        else:
            state = {"v": np.zeros(shape)}
        if self.beta_1 is not None:
            state["m"] = np.zeros(shape)
        return state

    def current_learning_rate(self) -> float:
        """The (uncapped) learning rate at the current `iterations`, as Keras evaluates it."""
        if callable(self.learning_rate):
            return float(self.learning_rate(self.iterations))
        return float(self.learning_rate)

    def step(self, params, grads, names: Optional[Sequence[str]] = None):
        """One update of every parameter; returns the new values in the params' dtypes."""
        if self.state is None:
            self.state = [self._initial_state(np.shape(p)) for p in params]
        names = names if names is not None else [""] * len(params)
        t = self.iterations + 1
        lr = self.current_learning_rate()
        rho = min(lr, 1.0 / math.sqrt(t)) if self.relative_step else lr
        beta2 = 1.0 - max(t - self.decay_offset, 1) ** self.beta_2_decay
        if self.beta_2_cap is not None:
            beta2 = min(beta2, self.beta_2_cap)
        new_params = []
        for param, grad, name, state in zip(params, grads, names, self.state):
            dtype = np.asarray(param).dtype
            x = np.asarray(param).astype(np.float64)
            g = np.asarray(grad).astype(np.float64)
            if self.weight_decay is not None and not any(
                n in name for n in self.exclude_from_weight_decay
            ):
                x = x - x * self.weight_decay * lr
            alpha = max(self.epsilon_2, rms(x)) * rho if self.multiply_by_parameter_scale else rho
            g2 = np.square(g) + self.epsilon_1
            if "row" in state:
                state["row"] = beta2 * state["row"] + (1 - beta2) * np.mean(g2, axis=-1)
                state["column"] = beta2 * state["column"] + (1 - beta2) * np.mean(g2, axis=-2)
                row_factor = state["row"] / np.mean(state["row"], axis=-1, keepdims=True)
                u = g / np.sqrt(row_factor)[..., :, None] / np.sqrt(state["column"])[..., None, :]
            else:
                state["v"] = beta2 * state["v"] + (1 - beta2) * g2
                u = g / np.sqrt(state["v"])
            u_hat = u / max(1.0, rms(u) / self.clip_threshold)
            delta = alpha * u_hat
            if self.beta_1 is not None:
                state["m"] = self.beta_1 * state["m"] + (1 - self.beta_1) * delta
                delta = state["m"]
            new_params.append((x - delta).astype(dtype))
        self.iterations += 1
        return new_params
