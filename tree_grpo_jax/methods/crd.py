"""Centered Reward Distillation (CRD, arXiv 2603.14128): the policy's implicit reward, read
off its flow-matching error against an old copy's, is regressed onto the external reward, both
centred within each prompt's group so that the intractable normaliser cancels.

A row is one prompt's group of G deterministic (ODE) samples x0 at one sigma, each sample with
its own noise, x_t = (1 - sigma) x0 + sigma eps, u = eps - x0 the data velocity, and

    r_i = -mean((v - u)^2 / w - (v_old - u)^2 / w_old)       (the implicit reward)
          w = max(mean|v - u|, 1e-5) held constant, likewise w_old (`adaptive_logp`;
          without it w = w_old = 1)
    a_i = clip(A_i, -c, c) / (2 c) + 1/2 in [0, 1]           (c = advantage.clip)
    centring weights p over the group: uniform (weight_temp < 0), softmax(a / T) and its
          mirror softmax(-a / T) (T > 0), or the a > 0 / a < 0 members (T = 0)
    Ra_i = a_i - sum_j p_j a_j,  Rr_i = r_i - sum_j p_j r_j (the centre held constant)
    mse: (beta Rr_i - Ra_i)^2;  bce: BCE(logit beta Rr_i, target sigmoid(Ra_i))
    policy = c / beta * mean over samples (both centrings halved and summed when T >= 0)
    loss = policy + kl_beta * mean over samples of k_i |v - v_ref|^2

with A_i the sample's advantage (its prompt's rewards less their mean, over the batch's std),
v_old the state's old copy (`use_old_for_loss`; else the initial model), v_ref the initial
model, guided with scale kl_cfg (the empty prompt's embedding given to the loss whatever the
sampling's guidance), and k_i = m +
a_i (1 - m), m = 1e-4 / kl_beta, with `reward_adaptive_kl` (else 1). The old copy follows
old <- d old + (1 - d) new after every iteration, d = min(d0 + slope * (steps - start),
d_max) once `steps` optimizer steps are done (d0 before `start`).

Source: Flow-Factory src/flow_factory/trainers/crd.py (CRDTrainer: _compute_crd_loss, the
implicit reward, the reward-adaptive KL, the snapshot decays) with hparams/training_args.py
(CRDTrainingArguments) and examples/crd/lora/sd3_5/default.yaml (the paper's Table 3 OCR
setting).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax.core.guidance import PyTree, guided_prediction
from tree_grpo_jax.core.loss import LossInputs, LossSettings, masked_mean
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.transitions import MaskedRows
from tree_grpo_jax.methods import forward
from tree_grpo_jax.methods.objective import RowSource

LOSS_TYPES = ("mse", "bce")
KL_FLOOR = 1e-4  # the released smallest KL weight under reward-adaptive KL


@struct.dataclass
class CRDRows(MaskedRows):
    x0: np.ndarray  # [R, G, *S] a prompt's group of final samples
    noise: np.ndarray  # [R, G, *S] their forward noise, one each
    time: np.ndarray  # [R] float32 in (0, 1]: the sigma the group is noised to
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    optimality: np.ndarray  # [R, G] float32 in [0, 1]: the normalised reward a_i
    mask: np.ndarray  # [R, G] bool, True = a real sample


def gather_rows(
    leaves: np.ndarray, optimality: np.ndarray, times: np.ndarray, key: jax.Array
) -> CRDRows:
    """Every prompt's group [P, G, *S] at its `times` [P, T], each sample with its own
    noise: P * T rows, prompt-major. `optimality` is [P, G]."""
    leaves = np.asarray(leaves)
    num_prompts, group = leaves.shape[:2]
    chex.assert_shape(optimality, (num_prompts, group))
    per_prompt = times.shape[1]
    x0 = np.repeat(leaves, per_prompt, axis=0)
    noise = np.asarray(jax.random.normal(key, x0.shape, jnp.float32)).astype(x0.dtype)
    prompt = np.repeat(np.arange(num_prompts, dtype=np.int32), per_prompt)
    opt = np.repeat(np.asarray(optimality, np.float32), per_prompt, axis=0)
    time = np.asarray(times, np.float32).reshape(-1)
    return CRDRows(x0, noise, time, prompt, opt, np.ones(opt.shape, bool))


def old_decay(steps: int, start: int, initial: float, slope: float, ceiling: float) -> float:
    """d once `steps` optimizer steps are done: `initial` before `start`, then rising by
    `slope` per step up to `ceiling` (the released start_step-start_value-slope-end_value)."""
    if steps < start:
        return float(initial)
    return float(min(initial + (steps - start) * slope, ceiling))


def _masked_softmax(logits: jax.Array, where: jax.Array) -> jax.Array:
    """Softmax over each row's `where` entries (0 elsewhere; all 0 for a row of none)."""
    top = jnp.max(jnp.where(where, logits, -jnp.inf), axis=1, keepdims=True)
    e = jnp.where(where, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    return e / jnp.maximum(e.sum(axis=1, keepdims=True), 1e-30)


def centring_weights(a: jax.Array, mask: jax.Array, temperature: float, sign: float):
    """[R, G] weights over each group's real samples: uniform (temperature < 0), a softmax
    of sign * a / temperature (> 0), or the members with sign * a > 0 weighted by
    softmax(a) (0; uniform where there are none), as the release centres."""
    real = mask.astype(jnp.float32)
    uniform = real / jnp.maximum(real.sum(axis=1, keepdims=True), 1.0)
    if temperature < 0:
        return uniform
    if temperature == 0:
        chosen = mask & (sign * a > 0)
        soft = _masked_softmax(a, chosen)
        return jnp.where(chosen.any(axis=1, keepdims=True), soft, uniform)
    return _masked_softmax(sign * a / temperature, mask)


def _bce_with_logits(logit: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.maximum(logit, 0.0) - logit * target + jnp.log1p(jnp.exp(-jnp.abs(logit)))


@dataclasses.dataclass(frozen=True)
class CRDSettings(LossSettings):
    """`crd_loss`'s settings (module docstring)."""

    beta: float = 1.0
    loss_type: str = "mse"
    use_old_for_loss: bool = True
    adaptive_logp: bool = True
    weight_temp: float = -1.0
    kl_cfg: float = 4.5
    reward_adaptive_kl: bool = True
    advantage_clip: float = 5.0


def crd_loss(
    params: PyTree,
    batch: CRDRows,
    settings: CRDSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CRD's loss over the batch's real samples (module docstring); the gradient flows
    through `params` alone. The trained and old velocities are conditional; `uncond` only
    guides the KL's reference (scale kl_cfg) when given."""
    chex.assert_rank(inputs.cond, 3)
    chex.assert_equal_shape([batch.x0, batch.noise])
    chex.assert_equal_shape([batch.optimality, batch.mask])
    if settings.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {settings.loss_type!r}.")
    if inputs.ref_params is None and (not settings.use_old_for_loss or settings.kl_beta != 0):
        raise ValueError("CRD's initial-model reward reference or KL term needs ref_params.")
    mask = batch.mask.astype(bool)
    rows, group = batch.x0.shape[:2]
    sample_shape = batch.x0.shape[2:]
    x0 = batch.x0.astype(jnp.float32).reshape(rows * group, *sample_shape)
    noise = batch.noise.astype(jnp.float32).reshape(rows * group, *sample_shape)
    sigma = jnp.repeat(batch.time.astype(jnp.float32), group)
    s = sigma.reshape(-1, *([1] * len(sample_shape)))
    xt = (1.0 - s) * x0 + s * noise
    target = (noise - x0).reshape(rows, group, *sample_shape)
    t = sigma * inputs.schedule.timestep_scale
    row_cond = jnp.repeat(inputs.cond[batch.prompt], group, axis=0)
    axes = tuple(range(2, 2 + len(sample_shape)))

    def velocity(p, guide=None):
        if guide is None:
            v = settings.denoise_fn(p, xt, t, row_cond)
        else:
            v = guided_prediction(settings.denoise_fn, p, xt, t, row_cond, *guide)
        return v.astype(jnp.float32).reshape(rows, group, *sample_shape)

    def sample_mean(values):
        return jnp.mean(values, axis=axes)

    v = velocity(params)
    reward_reference = inputs.old_params if settings.use_old_for_loss else inputs.ref_params
    v_old = jax.lax.stop_gradient(velocity(reward_reference))
    err, err_old = (target - v) ** 2, (target - v_old) ** 2
    if settings.adaptive_logp:
        w = jax.lax.stop_gradient(sample_mean(jnp.abs(target - v)))
        w_old = sample_mean(jnp.abs(target - v_old))
        w, w_old = (
            jnp.maximum(x, forward.WEIGHT_FLOOR)[(...,) + (None,) * len(axes)] for x in (w, w_old)
        )
        err, err_old = err / w, err_old / w_old
    r = -sample_mean(err - err_old)  # [R, G]
    a = batch.optimality.astype(jnp.float32)
    directions = (1.0,) if settings.weight_temp < 0 else (1.0, -1.0)
    per_sample = jnp.zeros_like(r)
    for sign in directions:
        p = centring_weights(a, mask, settings.weight_temp, sign)
        centred_a = a - jnp.sum(p * a, axis=1, keepdims=True)
        centred_r = r - jax.lax.stop_gradient(jnp.sum(p * r, axis=1, keepdims=True))
        logit = settings.beta * centred_r
        if settings.loss_type == "mse":
            term = (logit - centred_a) ** 2
        else:
            term = _bce_with_logits(logit, jax.nn.sigmoid(centred_a))
        per_sample = per_sample + term / len(directions)
    unscaled = masked_mean(per_sample, mask)
    policy_loss = unscaled * settings.advantage_clip / max(settings.beta, 1e-8)
    kl = jnp.zeros((), jnp.float32)
    if settings.kl_beta != 0:
        uncond = inputs.uncond
        guide = None if uncond is None or settings.kl_cfg <= 1.0 else (uncond, settings.kl_cfg)
        v_ref = jax.lax.stop_gradient(velocity(inputs.ref_params, guide))
        kl_i = sample_mean((v - v_ref) ** 2)
        weight = 1.0
        if settings.reward_adaptive_kl:
            floor = KL_FLOOR / max(settings.kl_beta, 1e-8)
            weight = floor + a * (1.0 - floor)
        kl = masked_mean(weight * kl_i, mask)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "unscaled_policy_loss": unscaled,
        "implicit_reward": masked_mean(r, mask),
        "trained_edges": jnp.sum(mask),
        "rows": jnp.sum(mask.any(axis=1)),
    }
    return policy_loss + settings.kl_beta * kl, metrics


class CRDObjective(forward.ForwardObjective):
    name = "crd"  # its old policy is the copy the implicit reward is measured against
    section = "crd"
    rows_type = CRDRows
    grouped_fields = ("x0", "noise", "optimality", "mask")
    decay_metric = "old_decay"
    reported_metrics = ("implicit_reward", "unscaled_policy_loss")

    # CRD's settings (tree.method "crd"). Defaults: Flow-Factory's CRDTrainingArguments and
    # its SD3.5-M example (examples/crd/lora/sd3_5/default.yaml, the paper's Table 3 OCR
    # setting): beta 1, the squared-error match, the old copy as the implicit reward's
    # reference with adaptive weights, uniform centring, the old copy's decay 0.25 rising by
    # 0.005 per optimizer step to 0.999, "discrete" times at the sampler's own sigmas over the
    # top 99% (shift 3 for the continuous draws), the KL's reference guided at 4.5 and
    # weighted by the reward; train.kl_beta is their kl_beta (0.1), advantage.clip their
    # adv_clip_range (5).
    settings = {
        "beta": Setting(1.0, "their crd_beta", low=0, open_low=True),
        "loss_type": Setting("mse", "the reward match: squared error or BCE", choices=LOSS_TYPES),
        "use_old_for_loss": Setting(
            True, "the implicit reward against the old copy (else initial)"
        ),
        "adaptive_logp": Setting(True, "each squared error over its own mean absolute error"),
        "weight_temp": Setting(-1.0, "centring: < 0 uniform, > 0 softmax temperature, 0 hard"),
        "train_timesteps": Setting(
            0,
            "times per group; 0: int(sampling.num_steps * timestep_range)",
            low=0,
            note="0: from the sampling steps",
        ),
        "time_sampling": Setting("discrete", "how times are drawn", choices=forward.TIME_SAMPLINGS),
        "timestep_range": Setting(
            0.99, "the top share of the noise levels drawn", low=0, high=1, open_low=True
        ),
        "time_shift": Setting(3.0, "the continuous draws' shift", low=0, open_low=True),
        "kl_cfg": Setting(
            4.5, "guidance of the KL's reference (1: none)", low=1, note="1: no guidance"
        ),
        "reward_adaptive_kl": Setting(True, "the KL weighted by the reward"),
        "old_decay_start": Setting(
            0, "optimizer steps before the old copy's decay starts rising", low=0
        ),
        "old_decay_initial": Setting(0.25, "the old copy's first decay", low=0, high=1),
        "old_decay_slope": Setting(0.005, "its rise per optimizer step", low=0),
        "old_decay_max": Setting(0.999, "its cap", low=0, high=1),
    }

    def check_run(self, config, spec):
        if config.tree.group_size < 2:
            return (
                f"tree.method={config.tree.method} centres rewards within each prompt's "
                f"group: tree.group_size must be at least 2, got {config.tree.group_size}."
            )
        return None

    def loss_reads_empty_prompt(self, config):
        return config.train.kl_beta > 0 and config.crd.kl_cfg > 1  # the guided KL reference

    def needs_initial_model(self, config):
        return not config.crd.use_old_for_loss  # the implicit reward against it

    def samples_with_old_policy(self, config, iteration):
        return False  # the trained weights sample; the old copy only measures the reward

    def train_timesteps(self, config) -> int:
        d = config.crd
        if d.train_timesteps:
            return int(d.train_timesteps)
        return max(1, int(config.sampling.num_steps * d.timestep_range))

    def rows(self, method, config, source: RowSource, key=None) -> CRDRows:
        """Every prompt's group at `train_timesteps` times, each with its normalised
        reward (advantages over the global batch's std, as on every process)."""
        c, d = config, config.crd
        adv = forward.advantages(np.asarray(source.rewards))[source.rows]
        optimality = forward.optimality(adv, c.advantage.clip)
        rng, noise_key = forward.time_and_noise_draws(key)
        times = forward.sample_times(
            d.time_sampling,
            rng,
            adv.shape[0],
            self.train_timesteps(c),
            np.asarray(source.schedule.sigmas),
            d.timestep_range,
            d.time_shift,
        )
        rows = gather_rows(source.tree.leaves, optimality, times, noise_key)
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        c, d = config, config.crd
        return crd_loss, CRDSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(c.train.kl_beta),
            beta=float(d.beta),
            loss_type=str(d.loss_type),
            use_old_for_loss=bool(d.use_old_for_loss),
            adaptive_logp=bool(d.adaptive_logp),
            weight_temp=float(d.weight_temp),
            kl_cfg=float(d.kl_cfg),
            reward_adaptive_kl=bool(d.reward_adaptive_kl),
            advantage_clip=float(c.advantage.clip),
        )

    def decay(self, config, iterations_done):
        """d once the optimizer steps of `iterations_done` iterations are done."""
        d = config.crd
        steps = iterations_done * int(config.train.updates_per_iteration)
        return old_decay(
            steps, d.old_decay_start, d.old_decay_initial, d.old_decay_slope, d.old_decay_max
        )

    def row_samples(self, config, spec):
        """Each sample and its noise, again, per time it is trained at."""
        return 2 * self.train_timesteps(config) * spec.leaves

    def training_counts(self, config, spec, prunes):
        """A row is a group at one time: G denoiser rows for the trained weights, G for the
        old copy (or the initial model), and G more (2 G when guided) for the KL's
        reference."""
        c, d = config, config.crd
        steps = self.train_timesteps(c)
        samples = spec.leaves * steps
        guided = d.kl_cfg > 1
        kl = 0 if c.train.kl_beta == 0 else (2 if guided else 1)
        return forward.row_counts(
            spec,
            c.sampling.guidance_scale != 1.0,
            edges=samples,
            rows=steps,
            forwards=samples * (2 + kl),
            grads=samples,  # the trained weights' only
        )


CRD = CRDObjective()
