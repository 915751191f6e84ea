"""Direct Group Preference Optimization (DGPO, ICLR 2026): a group-level preference loss on
deterministic (ODE) rollouts, trained with the flow's denoising (DSM) loss.

A row is one prompt's group of G samples x0 at one sampler step: the samples are noised to
that step's sigma, x_t = (1 - sigma) x0 + sigma eps (eps shared by the group with
`shared_noise`), and

    dsm_i = mean((eps_i - x0_i) - v(x_t,i))^2      under the trained weights
    ref_i = the same under the reference (the initial model, or the EMA copy)
    S = sum_i A_i * beta_dpo * (dsm_i - ref_i) / G    (dsm held constant)
    loss = mean over samples of sigmoid(S) * A_i * dsm_i  (sigmoid(S) held constant)
           + kl_beta * mean |v - v_initial|^2

with A_i the sample's advantage (its prompt's rewards less their mean, over the prompt's
or the batch's std), clipped to +-advantage.clip. With `clip_dsm` a PPO-style clip against
the EMA copy holds dsm_i constant where its ratio exp(dsm_old_i - dsm_i) has left
[1 - clip, 1 + clip] in the advantage's direction. The EMA copy is the state's old policy:
after every iteration ema <- d * ema + (1 - d) * new, d = min(0.001 * (iterations done - 1),
0.3) (the released per-step update, one optimizer step per iteration), and it samples once
more than `switch_ema_ref` iterations are done.

Sources: Luo-Yihong/DGPO scripts/train_sd3_dgpo.py (compute_group_dgpo_loss_allreduce, the
training loop) and config/dgpo.py, config/base.py (SD3.5-M settings); Flow-Factory
src/flow_factory/trainers/dgpo.py.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax.core.guidance import PyTree
from tree_grpo_jax.core.loss import LossInputs, LossSettings, masked_mean
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.transitions import MaskedRows
from tree_grpo_jax.methods import forward
from tree_grpo_jax.methods.objective import RowSource

REFERENCES = ("initial", "ema")


@struct.dataclass
class DGPORows(MaskedRows):
    x0: np.ndarray  # [R, G, *S] a prompt's group of final samples
    noise: np.ndarray  # [R, G, *S] their forward noise (one per group with shared noise)
    step: np.ndarray  # [R] int32: the sampler step whose sigma noises the group
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    advantage: np.ndarray  # [R, G] float32, clipped
    mask: np.ndarray  # [R, G] bool, True = a real sample


def advantages(rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """[P, G] rewards -> each prompt's rewards less their mean, over the batch's std
    (`global_std`) or the prompt's own (the released per-prompt tracker)."""
    if global_std:
        return forward.advantages(rewards)
    rewards = np.asarray(rewards, np.float64)
    std = rewards.std(axis=1, keepdims=True)
    return forward.centred_per_prompt(rewards) / (std + forward.STD_EPS)


def gather_rows(
    leaves: np.ndarray,
    advantages: np.ndarray,
    key: jax.Array,
    steps: int,
    per_group: int,
    shared_noise: bool,
) -> DGPORows:
    """Every prompt's group [P, G, *S] at `per_group` distinct steps of the first `steps`
    (the released `range(trunc_steps + 1)`), each with its own noise (one per group with
    `shared_noise`): P * per_group rows, prompt-major."""
    leaves = np.asarray(leaves)
    num_prompts, group = leaves.shape[:2]
    chex.assert_shape(advantages, (num_prompts, group))
    if not 1 <= per_group <= steps:
        raise ValueError(f"per_group must be in 1..{steps}, got {per_group}.")
    step_key, noise_key = jax.random.split(key)
    order = jax.vmap(lambda k: jax.random.permutation(k, steps))(
        jax.random.split(step_key, num_prompts)
    )
    step = np.asarray(order[:, :per_group], np.int32).reshape(-1)
    x0 = np.repeat(leaves, per_group, axis=0)  # [P * per_group, G, *S]
    shape = (x0.shape[0], 1 if shared_noise else group, *leaves.shape[2:])
    noise = np.asarray(jax.random.normal(noise_key, shape, jnp.float32))
    noise = np.broadcast_to(noise, x0.shape).astype(x0.dtype)
    prompt = np.repeat(np.arange(num_prompts, dtype=np.int32), per_group)
    adv = np.repeat(np.asarray(advantages, np.float32), per_group, axis=0)
    return DGPORows(x0, noise, step, prompt, adv, np.ones(adv.shape, bool))


def _sample_mean(values: jax.Array) -> jax.Array:
    """[R, G, *S] -> [R, G]."""
    return jnp.mean(values, axis=tuple(range(2, values.ndim)))


@dataclasses.dataclass(frozen=True)
class DGPOSettings(LossSettings):
    """`dgpo_loss`'s settings: the preference's scale and group size, its reference
    ("initial" or "ema") and the clip of the DSM loss against the EMA copy."""

    beta_dpo: float = 100.0
    group_size: int = 16
    reference: str = "initial"
    clip_dsm: bool = True
    clip_range: float = 1e-2


def dgpo_loss(
    params: PyTree,
    batch: DGPORows,
    settings: DGPOSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DGPO's loss over the batch's real samples (module docstring); the gradient flows
    through `params` alone. `reference`: "initial" (`ref_params`) or "ema" (`old_params`).
    `uncond` is not read: the conditional velocity is trained, as the release does."""
    chex.assert_rank(inputs.cond, 3)
    chex.assert_equal_shape([batch.x0, batch.noise])
    chex.assert_equal_shape([batch.advantage, batch.mask])
    reference, clip_range = settings.reference, settings.clip_range
    ref_params = inputs.ref_params  # the initial model
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}.")
    if ref_params is None and (reference == "initial" or settings.kl_beta != 0):
        raise ValueError("DGPO's initial-model reference or KL term needs ref_params.")
    mask = batch.mask.astype(bool)
    rows, group = batch.x0.shape[:2]
    sample_shape = batch.x0.shape[2:]
    x0 = batch.x0.astype(jnp.float32).reshape(rows * group, *sample_shape)
    noise = batch.noise.astype(jnp.float32).reshape(rows * group, *sample_shape)
    sigma = jnp.repeat(inputs.schedule.sigmas[batch.step], group)
    s = sigma.reshape(-1, *([1] * len(sample_shape)))
    xt = (1.0 - s) * x0 + s * noise
    target = noise - x0
    t = sigma * inputs.schedule.timestep_scale
    row_cond = jnp.repeat(inputs.cond[batch.prompt], group, axis=0)

    def velocity(p):
        v = settings.denoise_fn(p, xt, t, row_cond).astype(jnp.float32)
        return v.reshape(rows, group, *sample_shape)

    def dsm_of(v):
        return _sample_mean((target.reshape(v.shape) - v) ** 2)

    v = velocity(params)
    dsm = dsm_of(v)
    v_init = None if ref_params is None else jax.lax.stop_gradient(velocity(ref_params))
    v_ema = None
    if settings.clip_dsm or reference == "ema":
        v_ema = jax.lax.stop_gradient(velocity(inputs.old_params))
    ref_dsm = dsm_of(v_ema if reference == "ema" else v_init)
    a = batch.advantage.astype(jnp.float32)
    clipped = jnp.zeros(dsm.shape, bool)
    if settings.clip_dsm:
        ratio = jnp.exp(dsm_of(v_ema) - jax.lax.stop_gradient(dsm))
        clipped = jnp.where(a > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range) & mask
        dsm = jnp.where(clipped, jax.lax.stop_gradient(dsm), dsm)
    per_sample = (
        a * settings.beta_dpo * (jax.lax.stop_gradient(dsm) - ref_dsm) / settings.group_size
    )
    group_sum = jnp.sum(jnp.where(mask, per_sample, 0.0), axis=1, keepdims=True)
    weight = jax.lax.stop_gradient(jax.nn.sigmoid(group_sum))
    policy_loss = masked_mean(weight * a * dsm, mask)
    if v_init is not None:
        kl = masked_mean(_sample_mean((v - v_init) ** 2), mask)
    else:
        kl = jnp.zeros((), jnp.float32)
    live_rows = mask.any(axis=1)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "dsm": masked_mean(dsm, mask),
        "dsm_gap": masked_mean(dsm - ref_dsm, mask),
        "group_weight": masked_mean(jnp.broadcast_to(weight, mask.shape), mask),
        "clip_fraction": masked_mean(clipped.astype(jnp.float32), mask),
        "trained_edges": jnp.sum(mask),
        "rows": jnp.sum(live_rows),
    }
    return policy_loss + settings.kl_beta * kl, metrics


def ema_decay(iterations_done: int, rate: float, ceiling: float) -> float:
    """d after `iterations_done` iterations: the released min(rate * global_step, max),
    global_step counting the optimizer steps before this one (0 at the first)."""
    return forward.old_policy_decay(iterations_done, 1, rate, ceiling)


class DGPOObjective(forward.ForwardObjective):
    name = "dgpo"  # its old policy is the EMA reference ("ema_ref")
    section = "dgpo"
    rows_type = DGPORows
    grouped_fields = ("x0", "noise", "advantage", "mask")
    decay_metric = "ema_decay"
    reported_metrics = ("dsm", "dsm_gap", "group_weight")

    # DGPO's settings (tree.method "dgpo"). Defaults: the released SD3.5-M GenEval config
    # (Luo-Yihong/DGPO config/dgpo.py geneval_sd3_4gpu over config/base.py): beta_dpo 100, 4
    # training steps of the first trunc_steps + 1 = 5, shared noise, clip_dsm with clip range
    # 1e-2, the EMA reference's decay min(0.001 * step, 0.3), sampling with it after 500
    # iterations, the per-prompt std (global_std False); train.kl_beta is their train.beta
    # (0.02).
    settings = {
        "beta_dpo": Setting(100.0, "the preference's temperature", low=0, open_low=True),
        "train_timesteps": Setting(
            4, "steps each group is trained at (their num_train_timesteps)", low=1
        ),
        "trunc_steps": Setting(4, "drawn from the first trunc_steps + 1 sampler steps", low=0),
        "shared_noise": Setting(True, "one forward noise per group (their use_shared_noise)"),
        "clip_dsm": Setting(True, "PPO-style clip of the DSM loss against the EMA copy"),
        "clip_range": Setting(1e-2, "clip_dsm's range", low=0, open_low=True),
        "reference": Setting(
            "initial",
            'the preference\'s reference: "initial" or "ema" (use_ema_ref)',
            choices=REFERENCES,
        ),
        "ema_decay_rate": Setting(0.001, "the EMA decay's rise per iteration", low=0),
        "ema_decay_max": Setting(0.3, "the EMA decay's cap", low=0, high=1, open_high=True),
        "switch_ema_ref": Setting(
            500, "sample with the EMA copy after this many iterations", low=0
        ),
        "global_std": Setting(False, "advantages over the batch's std (True) or each prompt's"),
    }

    def check_section(self, config):
        d = config.dgpo
        if d.train_timesteps > d.trunc_steps + 1:
            return (
                f"dgpo.train_timesteps={d.train_timesteps} distinct steps cannot be drawn from "
                f"the first dgpo.trunc_steps + 1 = {d.trunc_steps + 1}."
            )
        return None

    def check_run(self, config, spec):
        d = config.dgpo
        if d.trunc_steps >= config.sampling.num_steps:
            return (
                f"dgpo.trunc_steps={d.trunc_steps} must be below sampling.num_steps="
                f"{config.sampling.num_steps}."
            )
        return None

    def needs_initial_model(self, config):
        return config.dgpo.reference == "initial"  # with or without a KL term, as the release

    def samples_with_old_policy(self, config, iteration):
        # the release samples with its EMA reference once global_step > switch_ema_ref
        return iteration > config.dgpo.switch_ema_ref

    def rows(self, method, config, source: RowSource, key=None) -> DGPORows:
        """Every prompt's group at train_timesteps of its first trunc_steps + 1 steps."""
        c, d = config, config.dgpo
        adv = advantages(source.rewards, d.global_std)[source.rows]
        adv = np.clip(adv, -c.advantage.clip, c.advantage.clip)
        key = jax.random.fold_in(key, jax.process_index())  # each process its own draws
        rows = gather_rows(
            source.tree.leaves, adv, key, d.trunc_steps + 1, d.train_timesteps, d.shared_noise
        )
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        c, d = config, config.dgpo
        return dgpo_loss, DGPOSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(c.train.kl_beta),
            beta_dpo=float(d.beta_dpo),
            group_size=int(c.tree.group_size),
            reference=str(d.reference),
            clip_dsm=bool(d.clip_dsm),
            clip_range=float(d.clip_range),
        )

    def decay(self, config, iterations_done):
        d = config.dgpo
        return ema_decay(iterations_done, d.ema_decay_rate, d.ema_decay_max)

    def row_samples(self, config, spec):
        """Each sample and its noise, again, per step it is trained at."""
        return 2 * config.dgpo.train_timesteps * spec.leaves

    def training_counts(self, config, spec, prunes):
        """A row is a group at one step: G denoiser rows for the trained weights, G more
        for each of the initial model (reference or KL) and the EMA copy (clip or
        reference) that the settings use."""
        c, d = config, config.dgpo
        samples = spec.leaves * d.train_timesteps
        initial = d.reference == "initial" or c.train.kl_beta > 0
        ema = d.clip_dsm or d.reference == "ema"
        return forward.row_counts(
            spec,
            c.sampling.guidance_scale != 1.0,
            edges=samples,
            rows=d.train_timesteps,
            forwards=samples * (1 + initial + ema),
            grads=samples,  # the trained weights' only
        )


DGPO = DGPOObjective()
