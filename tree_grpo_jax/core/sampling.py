"""Sampling maths: noise schedules and one denoising step as a Gaussian transition.

Every stochastic step, DDIM with eta or the flow-matching SDE, is a diagonal Gaussian
`x_next ~ N(mean, std^2)` whose mean depends on the denoiser's prediction. A schedule turns
`(step index, x, prediction)` into that `(mean, std)`; sampling, scoring a stored action and
the KL to a reference model are then the same few lines for every model family.

All arithmetic runs in float32, whatever the dtype of the inputs (bf16 rollouts included).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
REDUCTIONS = ("mean", "sum")
PREDICTION_TYPES = ("epsilon", "v_prediction")


class Transition(NamedTuple):
    """The Gaussian `N(mean, std^2)` of one step; `std` broadcasts against `mean`."""

    mean: jax.Array
    std: jax.Array


class StepOutput(NamedTuple):
    sample: jax.Array
    mean: jax.Array
    std: jax.Array
    log_prob: jax.Array


# ---------------------------------------------------------------------------------------------
# Densities.


def reduce_event(values: jax.Array, event_ndim: int, reduce: str = "mean") -> jax.Array:
    """Reduces the trailing `event_ndim` axes (the image) with `mean` or `sum`."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}.")
    axes = tuple(range(values.ndim - event_ndim, values.ndim))
    return jnp.mean(values, axis=axes) if reduce == "mean" else jnp.sum(values, axis=axes)


def gaussian_log_prob(
    sample: jax.Array, mean: jax.Array, std: jax.Array, event_ndim: int, reduce: str = "mean"
) -> jax.Array:
    """Diagonal Gaussian log-density, reduced over the event axes.

    The sample is an action that was taken: no gradient flows into it.
    """
    sample = jax.lax.stop_gradient(sample.astype(jnp.float32))
    mean = mean.astype(jnp.float32)
    std = jnp.broadcast_to(jnp.asarray(std, jnp.float32), mean.shape)
    per_dim = -((sample - mean) ** 2) / (2.0 * std**2) - jnp.log(std) - LOG_SQRT_2PI
    return reduce_event(per_dim, event_ndim, reduce)


def gaussian_kl(
    mean: jax.Array, ref_mean: jax.Array, std: jax.Array, event_ndim: int, reduce: str = "mean"
) -> jax.Array:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) per dimension, reduced over the event axes."""
    std = jnp.broadcast_to(jnp.asarray(std, jnp.float32), mean.shape)
    diff = mean.astype(jnp.float32) - ref_mean.astype(jnp.float32)
    return reduce_event(diff**2 / (2.0 * std**2), event_ndim, reduce)


# ---------------------------------------------------------------------------------------------
# Schedules. Both are pytrees: the arrays are traced, the string fields are static.


def scaled_linear_alphas_cumprod(
    num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012
) -> np.ndarray:
    """Stable Diffusion's `scaled_linear` betas (linear in sqrt(beta)), as alpha-bar."""
    betas = np.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=np.float64) ** 2
    return np.cumprod(1.0 - betas)


# Per-step coefficients are tabulated on the host in float64. The rollout reads them with a
# scalar step index and the loss with one index per row; with tables both paths do the same
# float32 multiplies and adds, so the log-prob of an action is reproduced bit for bit and
# the importance ratio before an update is exactly 1.


@struct.dataclass
class DDIMSchedule:
    """DDIM over N inference steps (diffusers' `leading` spacing with `steps_offset`).

    Step i goes from model timestep `timesteps[i]` (alpha-bar `alpha_bar[i]`) to
    `timesteps[i] - num_train_timesteps // N` (alpha-bar `alpha_bar_prev[i]`, the final
    alpha-bar when that is negative).
    """

    timesteps: jax.Array  # [N] int32, what the denoiser receives
    alpha_bar: jax.Array  # [N]
    alpha_bar_prev: jax.Array  # [N]
    sqrt_alpha_bar: jax.Array  # [N]
    sqrt_one_minus_alpha_bar: jax.Array  # [N]
    sqrt_alpha_bar_prev: jax.Array  # [N]
    one_minus_alpha_bar_prev: jax.Array  # [N]
    unit_std: jax.Array  # [N] the step's std at eta = 1
    x0_scale_prev: jax.Array  # [N] sqrt(a_prev) / sqrt(a)
    x0_eps_scale_prev: jax.Array  # [N] sqrt(a_prev) * sqrt(1 - a) / sqrt(a)
    eta: jax.Array  # scalar, the stochasticity of SDE and branch steps
    prediction_type: str = struct.field(pytree_node=False, default="epsilon")

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    def predict_eps_x0(self, i, x, prediction):
        sqrt_a, sqrt_1ma = self.sqrt_alpha_bar[i], self.sqrt_one_minus_alpha_bar[i]
        if self.prediction_type == "epsilon":
            return prediction, (x - sqrt_1ma * prediction) / sqrt_a
        # v-prediction: v = sqrt(a) eps - sqrt(1 - a) x0.
        return sqrt_a * prediction + sqrt_1ma * x, sqrt_a * x - sqrt_1ma * prediction

    def predict_x0(self, i, x, prediction):
        """Tweedie's estimate of the clean sample at step i: (x - sqrt(1-a) eps) / sqrt(a)
        for an epsilon model, sqrt(a) x - sqrt(1-a) v for a v-prediction one."""
        x, prediction = x.astype(jnp.float32), prediction.astype(jnp.float32)
        return self.predict_eps_x0(i, x, prediction)[1]

    def transition(self, i, x, prediction, stochastic: bool = True) -> Transition:
        """The Gaussian of step i; `stochastic=False` is the deterministic (eta 0) step.

        The mean is linear in x and the prediction: mean = c_x * x + c_pred * prediction,
        with coefficients from the tables (no division of arrays).
        """
        x = x.astype(jnp.float32)
        prediction = prediction.astype(jnp.float32)
        std = self.eta * self.unit_std[i] if stochastic else jnp.zeros_like(self.unit_std[i])
        direction = jnp.sqrt(jnp.maximum(self.one_minus_alpha_bar_prev[i] - std**2, 0.0))
        sqrt_a, sqrt_1ma = self.sqrt_alpha_bar[i], self.sqrt_one_minus_alpha_bar[i]
        sqrt_a_prev = self.sqrt_alpha_bar_prev[i]
        if self.prediction_type == "epsilon":
            # x0 = (x - sqrt(1 - a) eps) / sqrt(a)
            c_x = self.x0_scale_prev[i]
            c_pred = direction - self.x0_eps_scale_prev[i]
        else:
            # v-prediction: x0 = sqrt(a) x - sqrt(1 - a) v, eps = sqrt(a) v + sqrt(1 - a) x.
            c_x = sqrt_a_prev * sqrt_a + direction * sqrt_1ma
            c_pred = direction * sqrt_a - sqrt_a_prev * sqrt_1ma
        return Transition(c_x * x + c_pred * prediction, std)

    def deterministic_step(self, i, x, prediction):
        return self.transition(i, x, prediction, stochastic=False).mean


def _f32(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, np.float64), jnp.float32)


def largest_ddim_step_count(num_train_timesteps: int, steps_offset: int) -> int:
    """The most DDIM steps whose first timestep, `(n - 1) * (T // n) + steps_offset`, is still
    one of the T training timesteps: with SD1.5's offset of 1 that is 999, not 1000."""
    for n in range(num_train_timesteps, 0, -1):
        if (n - 1) * (num_train_timesteps // n) + steps_offset < num_train_timesteps:
            return n
    return 0


def make_ddim_schedule(
    num_steps: int,
    *,
    eta: float = 1.0,
    num_train_timesteps: int = 1000,
    beta_start: float = 0.00085,
    beta_end: float = 0.012,
    steps_offset: int = 1,
    set_alpha_to_one: bool = False,
    prediction_type: str = "epsilon",
) -> DDIMSchedule:
    most = largest_ddim_step_count(num_train_timesteps, steps_offset)
    if num_steps < 1 or num_steps > most:
        raise ValueError(f"num_steps must be in [1, {most}], got {num_steps}.")
    if not 0.0 <= float(eta) <= 1.0:
        # Above 1 the step's variance exceeds 1 - alpha_bar_prev and the direction term's
        # square root would have to be clamped: the step is no longer DDIM's.
        raise ValueError(f"DDIM eta must be in [0, 1], got {float(eta)}.")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}."
        )
    alphas_cumprod = scaled_linear_alphas_cumprod(num_train_timesteps, beta_start, beta_end)
    final = 1.0 if set_alpha_to_one else alphas_cumprod[0]
    ratio = num_train_timesteps // num_steps
    timesteps = (np.arange(num_steps) * ratio).round()[::-1].astype(np.int64) + steps_offset
    prev = timesteps - ratio
    a = alphas_cumprod[timesteps]
    a_prev = np.where(prev >= 0, alphas_cumprod[np.clip(prev, 0, None)], final)
    return DDIMSchedule(
        timesteps=jnp.asarray(timesteps, jnp.int32),
        alpha_bar=_f32(a),
        alpha_bar_prev=_f32(a_prev),
        sqrt_alpha_bar=_f32(np.sqrt(a)),
        sqrt_one_minus_alpha_bar=_f32(np.sqrt(1.0 - a)),
        sqrt_alpha_bar_prev=_f32(np.sqrt(a_prev)),
        one_minus_alpha_bar_prev=_f32(1.0 - a_prev),
        unit_std=_f32(np.sqrt((1.0 - a_prev) / (1.0 - a) * (1.0 - a / a_prev))),
        x0_scale_prev=_f32(np.sqrt(a_prev / a)),
        x0_eps_scale_prev=_f32(np.sqrt(a_prev * (1.0 - a) / a)),
        eta=jnp.asarray(eta, jnp.float32),
        prediction_type=prediction_type,
    )


# The flow SDEs a FlowSchedule can take (`sde`).
FLOW_SDES = ("flow_grpo", "dancegrpo")
# BranchGRPO's `flux_step_with_split` clamps its std below at this value.
DANCEGRPO_MIN_STD = 1e-8


@struct.dataclass
class FlowSchedule:
    """Rectified-flow sampling from sigma 1 (noise) to 0 (data); the model predicts velocity.

    The ODE step is Euler, `x + v * dt` with `dt = sigma_{i+1} - sigma_i < 0`. The SDE step
    is a Gaussian whose form `sde` names:

    - "flow_grpo" (Flow-GRPO): `sig_t = a * sqrt(sigma / (1 - sigma))` (sigma_1 in the
      denominator at sigma = 1), with `a = noise_level`;
      mean = x * (1 + sig_t^2 dt / (2 sigma)) + v * (1 + sig_t^2 (1 - sigma) / (2 sigma)) dt,
      std = sig_t * sqrt(-dt).
    - "dancegrpo" (the SDE of DanceGRPO's `flux_step` and BranchGRPO's
      `flux_step_with_split`, their FLUX trainers), with `eta = noise_level`:
      std = max(eta * sqrt(sigma_i - sigma_{i+1}), 1e-8);
      mean = x + v dt, plus, with `score_correction` (their `sde_solver=True`, what both
      releases run), `-(eta^2 / 2) * score * dt` with the score the velocity implies for
      x = (1 - sigma) x0 + sigma eps: x0_hat = x - sigma v,
      score = -(x - (1 - sigma) x0_hat) / sigma^2 = -(x + (1 - sigma) v) / sigma. Written
      out, mean = x * (1 + eta^2 dt / (2 sigma)) + v * (1 + eta^2 (1 - sigma) / (2 sigma)) dt:
      Flow-GRPO's mean with a constant sig_t = eta, i.e. the reverse SDE
      dx = (v - eta^2 / 2 * score) dt + eta dW, which keeps the flow's marginals to first
      order in dt. Without the correction the step is Euler plus noise, which adds
      eta^2 |dt| to their variance per step. Its log-prob is the whole Gaussian density, as
      BranchGRPO's is (DanceGRPO's `flux_step` drops the `-log std - log sqrt(2 pi)` terms,
      constants that cancel in its ratios).

    `sde` and `score_correction` are static: each compiles its own programs.
    """

    sigmas: jax.Array  # [N + 1], from 1 down to 0
    dt: jax.Array  # [N] sigma_{i+1} - sigma_i < 0
    sqrt_neg_dt: jax.Array  # [N]
    unit_sig: jax.Array  # [N] sqrt(sigma / (1 - sigma)), sigma_1 in the denominator at 1
    noise_level: jax.Array  # scalar: Flow-GRPO's a, or DanceGRPO's eta
    timestep_scale: float = struct.field(pytree_node=False, default=1000.0)
    sde: str = struct.field(pytree_node=False, default="flow_grpo")
    score_correction: bool = struct.field(pytree_node=False, default=True)  # dancegrpo only

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1

    @property
    def timesteps(self) -> jax.Array:
        return self.sigmas[:-1] * self.timestep_scale

    def transition(self, i, x, prediction, stochastic: bool = True) -> Transition:
        x = x.astype(jnp.float32)
        v = prediction.astype(jnp.float32)
        sigma, dt = self.sigmas[i], self.dt[i]
        if not stochastic:
            return Transition(x + v * dt, jnp.zeros_like(dt))
        if self.sde == "flow_grpo":
            sig = self.noise_level * self.unit_sig[i]
            std = sig * self.sqrt_neg_dt[i]
        else:  # dancegrpo: a constant diffusion coefficient eta
            sig = self.noise_level
            std = jnp.maximum(sig * self.sqrt_neg_dt[i], DANCEGRPO_MIN_STD)
            if not self.score_correction:
                return Transition(x + v * dt, std)
        x_coef = 1.0 + sig**2 * dt / (2.0 * sigma)
        v_coef = (1.0 + sig**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
        return Transition(x * x_coef + v * v_coef, std)

    def deterministic_step(self, i, x, prediction):
        return self.transition(i, x, prediction, stochastic=False).mean

    def predict_x0(self, i, x, prediction):
        """Tweedie's estimate of the clean sample at step i: x0_hat = x - sigma_i v (for
        x = (1 - sigma) x0 + sigma eps and v = eps - x0)."""
        return x.astype(jnp.float32) - self.sigmas[i] * prediction.astype(jnp.float32)


def make_flow_schedule(
    num_steps: int,
    *,
    shift: float = 1.0,
    noise_level: float = 0.7,
    timestep_scale: float = 1000.0,
    sde: str = "flow_grpo",
    score_correction: bool = True,
) -> FlowSchedule:
    if num_steps < 2:
        raise ValueError(f"a flow schedule needs at least 2 steps, got {num_steps}.")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}.")
    sigmas = np.linspace(1.0, 0.0, num_steps + 1)
    sigmas = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    return flow_schedule_from_sigmas(
        sigmas, noise_level, timestep_scale, sde=sde, score_correction=score_correction
    )


def flow_schedule_from_sigmas(
    sigmas,
    noise_level: float = 0.7,
    timestep_scale: float = 1000.0,
    *,
    sde: str = "flow_grpo",
    score_correction: bool = True,
) -> FlowSchedule:
    """A flow schedule over any decreasing sigmas from 1 to 0 (N + 1 values), its SDE step
    the one `sde` names (FLOW_SDES; see FlowSchedule)."""
    if sde not in FLOW_SDES:
        raise ValueError(f"the flow SDE must be one of {FLOW_SDES}, got {sde!r}.")
    sigmas = np.asarray(sigmas, np.float64)
    dt = sigmas[1:] - sigmas[:-1]
    current = sigmas[:-1]
    denominator = 1.0 - np.where(current >= 1.0, sigmas[1], current)
    return FlowSchedule(
        sigmas=_f32(sigmas),
        dt=_f32(dt),
        sqrt_neg_dt=_f32(np.sqrt(-dt)),
        unit_sig=_f32(np.sqrt(current / denominator)),
        noise_level=jnp.asarray(noise_level, jnp.float32),
        timestep_scale=timestep_scale,
        sde=sde,
        score_correction=bool(score_correction),
    )


Schedule = DDIMSchedule | FlowSchedule


# ---------------------------------------------------------------------------------------------
# One step.


def sample_step(
    schedule: Schedule,
    i,
    x: jax.Array,
    prediction: jax.Array,
    noise: jax.Array,
    *,
    event_ndim: int,
    noise_scale: float = 1.0,
    score_scale: float | None = None,
    reduce: str = "mean",
) -> StepOutput:
    """Draws `x_next = mean + noise_scale * std * noise` and scores it.

    By default (`score_scale=None`) the log-prob is that of the Gaussian the sample was
    really drawn from, std widened by `noise_scale`. `score_scale` scores it under
    `N(mean, (score_scale * std)^2)` instead: BranchGRPO's released code draws split children
    with `noise_scale` and scores them with the unscaled std (`score_scale=1`).
    """
    mean, std = schedule.transition(i, x, prediction)
    sample = mean + (std * noise_scale) * noise.astype(jnp.float32)
    # Scored exactly as any stored action is scored later (XLA merges the repeated mean).
    return score_step(
        schedule,
        i,
        x,
        prediction,
        sample,
        event_ndim=event_ndim,
        noise_scale=noise_scale if score_scale is None else score_scale,
        reduce=reduce,
    )


def score_step(
    schedule: Schedule,
    i,
    x: jax.Array,
    prediction: jax.Array,
    sample: jax.Array,
    *,
    event_ndim: int,
    noise_scale: float = 1.0,
    reduce: str = "mean",
) -> StepOutput:
    """Log-prob of a given next sample under the transition that `prediction` implies, its
    std multiplied by `noise_scale`."""
    mean, std = schedule.transition(i, x, prediction)
    std = std * noise_scale
    return StepOutput(sample, mean, std, gaussian_log_prob(sample, mean, std, event_ndim, reduce))
