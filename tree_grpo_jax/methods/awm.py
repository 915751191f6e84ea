"""Advantage Weighted Matching (AWM, arXiv 2509.25050): the flow-matching loss of the
pretraining, on the policy's own samples, weighted by their group advantages.

The final samples x0 of a rollout (ODE samples, or a tree's leaves) are noised again at
`train_timesteps` times t drawn per sample, x_t = (1 - t) x0 + t eps, and each gets a
"log-likelihood" from its velocity's matching error, weighted in t:

    logp = w(-mean((v(x_t, t) - (eps - x0))^2), t)
    w: Uniform (as is), t (times t), t**2, huber -(sqrt(-logp + 1e-10) - 1e-5) t,
       ghuber -((-logp + 1e-10)^p - 1e-10^p) t / p
    ratio = exp(logp - logp_old)
    loss = mean over rows of max(-A ratio, -A clip(ratio, 1 - clip, 1 + clip))
           + kl_beta * mean |v - v_ref|^2 + ema_beta * mean |v - v_ema|^2

with A the sample's advantage (per prompt, over the batch's std), clipped to
+-advantage.clip and scaled by advantage_max / advantage.clip. On-policy (the released
default) logp_old is logp itself held constant: the ratio is 1 and the gradient is
A * grad(logp), the advantage-weighted matching gradient; off-policy logp_old is the EMA
copy's and the EMA samples. The EMA copy is the state's old policy (`OldPolicyState`):
after every iteration ema <- d * ema + (1 - d) * new with d = min(rate * iterations done,
max) (the released "linear" kl_ema_decay_type) or d = max ("constant").

Rows (`AWMRows`) are (sample, t, noise) triples, built on the host once per iteration.
Sources: scxue/advantage_weighted_matching advantage_weighted_matching/scripts/
train_sd3_awm.py (compute_log_prob_awm, the time_type samplers, the training loop) and
config/dgx_awm.py (SD3.5-M settings); Flow-Factory src/flow_factory/trainers/awm.py.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax.core.guidance import PyTree
from tree_grpo_jax.core.loss import (
    LossInputs,
    LossSettings,
    check_kl_reference,
    clipped_surrogate,
    masked_mean,
    ratio_metrics,
)
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.transitions import MaskedRows
from tree_grpo_jax.methods import forward
from tree_grpo_jax.methods.objective import RowSource

WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")
HUBER_EPS = 1e-10  # the released floor: the huber forms' 1e-10 under the power


@struct.dataclass
class AWMRows(MaskedRows):
    x0: np.ndarray  # [R, *S] a final sample
    noise: np.ndarray  # [R, *S] the forward process's noise for this row
    time: np.ndarray  # [R] float32 in (0, 1]: the sigma x0 is noised to
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    advantage: np.ndarray  # [R] float32, clipped and scaled
    mask: np.ndarray  # [R] bool, True = a real row


# ---------------------------------------------------------------------------------------------
# Credit.


def scaled_advantages(rewards: np.ndarray, clip: float, advantage_max: float) -> np.ndarray:
    """[P, L] rewards -> each prompt's advantages over the batch's std (the released tracker
    with global_std), clipped to +-clip and scaled to +-advantage_max."""
    a = np.clip(forward.advantages(rewards), -clip, clip)
    return a / clip * advantage_max


def gather_rows(
    leaves: np.ndarray,
    advantages: np.ndarray,
    times: np.ndarray,
    key: jax.Array,
) -> AWMRows:
    """Every leaf [P, L, *S] at its `times` [P * L, T], each with its own noise: P * L * T
    rows, sample-major. `advantages` is [P, L]."""
    leaves = np.asarray(leaves)
    num_prompts, num_leaves = leaves.shape[:2]
    chex.assert_shape(advantages, (num_prompts, num_leaves))
    per_sample = times.shape[1]
    flat = leaves.reshape(num_prompts * num_leaves, *leaves.shape[2:])
    x0 = np.repeat(flat, per_sample, axis=0)
    noise = np.asarray(jax.random.normal(key, x0.shape, jnp.float32)).astype(x0.dtype)
    prompt = np.repeat(np.arange(num_prompts, dtype=np.int32), num_leaves * per_sample)
    adv = np.repeat(np.asarray(advantages, np.float32).reshape(-1), per_sample)
    return AWMRows(
        x0, noise, times.reshape(-1).astype(np.float32), prompt, adv, np.ones(len(x0), bool)
    )


# ---------------------------------------------------------------------------------------------
# The loss.


def weighted_log_prob(error: jax.Array, t: jax.Array, weighting: str, power: float) -> jax.Array:
    """The released weighting of logp = -error (error: the mean squared matching error)."""
    if weighting == "Uniform":
        return -error
    if weighting == "t":
        return -error * t
    if weighting == "t**2":
        return -error * t**2
    if weighting == "huber":
        return -(jnp.sqrt(error + HUBER_EPS) - 1e-5) * t
    if weighting == "ghuber":
        return -((error + HUBER_EPS) ** power - HUBER_EPS**power) * t / power
    raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {WEIGHTINGS}.")


@dataclasses.dataclass(frozen=True)
class AWMSettings(LossSettings):
    """`awm_loss`'s settings: the ratio's clip, the log-likelihood's weighting (and the
    ghuber power), the off-policy ratio and the EMA term's weight."""

    clip_range: float = 1.0
    weighting: str = "ghuber"
    power: float = 0.25
    off_policy: bool = False
    ema_beta: float = 0.0


def awm_loss(
    params: PyTree,
    batch: AWMRows,
    settings: AWMSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AWM's loss over the batch's real rows (module docstring); the gradient flows through
    `params` alone. One forward per row, one more for the KL reference and one for the EMA
    copy (its KL, or the off-policy ratio's denominator). `uncond` is not read: the
    conditional velocity is sampled and trained (the config refuses guidance)."""
    chex.assert_rank(inputs.cond, 3)
    chex.assert_equal_shape([batch.x0, batch.noise])
    check_kl_reference(settings.kl_beta, inputs.ref_params)
    weighting, power = settings.weighting, settings.power
    mask = batch.mask.astype(bool)
    x0 = batch.x0.astype(jnp.float32)
    noise = batch.noise.astype(jnp.float32)
    t = batch.time.astype(jnp.float32)
    t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
    xt = (1.0 - t_b) * x0 + t_b * noise
    target = noise - x0
    row_cond = inputs.cond[batch.prompt]
    timestep_scale = inputs.schedule.timestep_scale

    def velocity(p):
        return settings.denoise_fn(p, xt, t * timestep_scale, row_cond).astype(jnp.float32)

    v = velocity(params)
    log_prob = weighted_log_prob(forward.row_mean((v - target) ** 2), t, weighting, power)
    use_ema = settings.off_policy or settings.ema_beta != 0
    v_ema = jax.lax.stop_gradient(velocity(inputs.old_params)) if use_ema else None
    if settings.off_policy:
        old = weighted_log_prob(forward.row_mean((v_ema - target) ** 2), t, weighting, power)
    else:
        old = jax.lax.stop_gradient(log_prob)
    log_ratio = jnp.where(mask, log_prob - old, 0.0)
    ratio = jnp.exp(log_ratio)
    a = batch.advantage.astype(jnp.float32)
    per_row = clipped_surrogate(a, ratio, settings.clip_range)
    policy_loss = masked_mean(per_row, mask)
    zero = jnp.zeros((), jnp.float32)
    kl = zero
    if inputs.ref_params is not None:
        v_ref = jax.lax.stop_gradient(velocity(inputs.ref_params))
        kl = masked_mean(forward.row_mean((v - v_ref) ** 2), mask)
    ema_kl = zero if v_ema is None else masked_mean(forward.row_mean((v - v_ema) ** 2), mask)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "ema_kl": ema_kl,
        "matching_error": masked_mean(forward.row_mean((v - target) ** 2), mask),
        **ratio_metrics(ratio, mask, settings.clip_range),
        "trained_edges": jnp.sum(mask),
        "rows": jnp.sum(mask),
    }
    return policy_loss + settings.kl_beta * kl + settings.ema_beta * ema_kl, metrics


# ---------------------------------------------------------------------------------------------
# The objective as the method table holds it.


def ema_decay(iterations_done: int, kind: str, rate: float, ceiling: float) -> float:
    """d after `iterations_done` iterations: min(rate * iterations, max) ("linear", the
    released default, one optimizer step per iteration) or max ("constant")."""
    if kind == "constant":
        return float(ceiling)
    return forward.old_policy_decay(iterations_done, 0, rate, ceiling)


class AWMObjective(forward.ForwardObjective):
    name = "awm"  # its old policy is the EMA copy
    section = "awm"
    rows_type = AWMRows
    decay_metric = "ema_decay"
    reported_metrics = ("matching_error", "ema_kl")

    # AWM's settings (tree.method "awm" / "awm_tree"). Defaults: the released SD3.5-M
    # GenEval/OCR configs (scxue/advantage_weighted_matching config/dgx_awm.py:
    # train_timesteps 6, time_type discrete_wo_init, timestep_fraction 0.9, time_shift 3,
    # weighting ghuber with power 0.25, advantage_max 1 over adv_clip_max 5
    # (advantage.clip), clip_range 1 (train.clip_range), ema_beta 1, kl_ema_decay 0.3
    # "linear", off_policy False); train.kl_beta is their beta (0.003; 1e-4 PickScore).
    settings = {
        "train_timesteps": Setting(6, "times each sample is trained at", low=1),
        "time_sampling": Setting(
            "discrete_wo_init", "their time_type", choices=forward.TIME_SAMPLINGS
        ),
        "timestep_fraction": Setting(
            0.9,
            '"discrete*": strata over int(num_steps * fraction)',
            low=0,
            high=1,
            open_low=True,
        ),
        "time_shift": Setting(
            3.0, '"uniform" / "logit_normal": t -> s t / (1 + (s - 1) t)', low=0, open_low=True
        ),
        "weighting": Setting("ghuber", "the loss's weighting over time", choices=WEIGHTINGS),
        "ghuber_power": Setting(0.25, "ghuber's power", low=0, open_low=True),
        "advantage_max": Setting(
            1.0, "advantages clipped to +-advantage.clip, scaled to +-this", low=0, open_low=True
        ),
        "ema_beta": Setting(1.0, "weight of |v - v_ema|^2 (their ema_beta)", low=0),
        "ema_decay_type": Setting(
            "linear",
            '"linear": min(rate * iterations, max); "constant": max',
            choices=("linear", "constant"),
        ),
        "ema_decay_rate": Setting(0.001, "the EMA decay's rise per iteration", low=0),
        "ema_decay_max": Setting(0.3, "their kl_ema_decay", low=0, high=1, open_high=True),
        "off_policy": Setting(False, "sample with the EMA copy and take its logp as the old one"),
    }

    def check_run(self, config, spec):
        a = config.awm
        if config.sampling.guidance_scale != 1.0:
            return (
                f"{config.tree.method} samples and trains the conditional velocity without "
                "guidance (the released SD3.5-M setting); set sampling.guidance_scale=1, not "
                f"{config.sampling.guidance_scale}."
            )
        if a.time_sampling.startswith("discrete"):
            top = int(config.sampling.num_steps * a.timestep_fraction)
            first = 0 if a.time_sampling == "discrete" else 1
            strata = a.train_timesteps - (a.time_sampling == "discrete_with_init")
            if strata > 0 and top - first < strata:
                return (
                    f"awm.time_sampling={a.time_sampling} draws {strata} steps from "
                    f"[{first}, {top}) (int(sampling.num_steps * awm.timestep_fraction)): "
                    "lower awm.train_timesteps or raise the fraction."
                )
        return None

    def samples_with_old_policy(self, config, iteration):
        return bool(config.awm.off_policy)

    def rows(self, method, config, source: RowSource, key=None) -> AWMRows:
        """Every leaf at `train_timesteps` times, each with its advantage (normalised over
        the global batch, as on every process)."""
        c, a = config, config.awm
        (leaf_advantages,) = method.clipped_advantages(
            c, source.spec, source.tree, jnp.asarray(source.rewards)
        )
        adv = np.asarray(leaf_advantages, np.float64)[source.rows]
        adv = adv / c.advantage.clip * a.advantage_max
        rng, noise_key = forward.time_and_noise_draws(key)
        sigmas = np.asarray(source.schedule.sigmas)  # the sampler's own
        times = forward.sample_times(
            a.time_sampling,
            rng,
            adv.size,
            a.train_timesteps,
            sigmas,
            a.timestep_fraction,
            a.time_shift,
        )
        rows = gather_rows(source.tree.leaves, adv, times, noise_key)
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        a = config.awm
        return awm_loss, AWMSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(config.train.kl_beta),
            clip_range=float(config.train.clip_range),
            weighting=str(a.weighting),
            power=float(a.ghuber_power),
            off_policy=bool(a.off_policy),
            ema_beta=float(a.ema_beta),
        )

    def decay(self, config, iterations_done):
        """ema <- d * ema + (1 - d) * new, d after `iterations_done` iterations."""
        a = config.awm
        return ema_decay(iterations_done, a.ema_decay_type, a.ema_decay_rate, a.ema_decay_max)

    def row_samples(self, config, spec):
        """Each leaf and its noise, again, per time it is trained at."""
        return 2 * config.awm.train_timesteps * spec.leaves

    def training_counts(self, config, spec, prunes):
        """Every leaf at its train_timesteps times, one row each; a row runs the trained
        policy, the EMA copy (its KL or the off-policy ratio) and the KL reference."""
        a = config.awm
        forwards = 1 + (config.train.kl_beta > 0) + (a.ema_beta > 0 or bool(a.off_policy))
        return forward.leaf_row_counts(spec, spec.leaves * a.train_timesteps, forwards)


AWM = AWMObjective()
