"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) on a flow: each prompt's group of G
deterministic (ODE) samples gives one preference pair, its best sample by reward (the winner
w) against its worst (the loser l), trained with the flow-matching error of both.

A row is one pair at one forward-noised time: winner and loser share one sigma and one noise
eps, x_t = (1 - sigma) x0 + sigma eps, and

    err(p, x0) = mean((eps - x0) - v_p(x_t, sigma))^2     (the velocity's matching error)
    z = -beta / 2 * ((err(theta, w) - err(ref, w)) - (err(theta, l) - err(ref, l)))
    loss = mean over pairs of -log sigmoid(z) + kl_beta * mean |v - v_ref|^2

with `ref` the initial model (`ref_params`): the trained velocity is pulled towards the
winner's data velocity and pushed from the loser's, relative to where the initial model is.
sigma is drawn per pair from a logit-normal: u = sigmoid(logit_mean + logit_std * n),
n ~ N(0, 1), shifted u <- s u / (1 + (s - 1) u), clipped to [0.01, 1 - 1e-6], and
sigma = 1 - timestep_range * u. A group of equal rewards pairs a sample with itself: its
loss is log 2 and gives no gradient (the release keeps such pairs too).

Source: Flow-Factory src/flow_factory/trainers/dpo.py (DPOTrainer: best/worst pairs from
each group, the shared sigma and noise, the -beta/2 scale, the velocity-MSE errors) and
hparams/training_args.py (DPOTrainingArguments) with examples/dpo/lora/sd3_5/default.yaml
(the SD3.5-M setting); utils/noise_schedule.py (the logit-normal times).
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

# the released logit-normal draw's floor and ceiling on u before sigma = 1 - range * u
TIME_FLOOR, TIME_CEILING = 0.01, 1.0 - 1e-6


@struct.dataclass
class DPORows(MaskedRows):
    x0: np.ndarray  # [R, 2, *S] the pair's final samples: winner, loser
    noise: np.ndarray  # [R, *S] the forward noise both share
    time: np.ndarray  # [R] float32 in (0, 1): the sigma both are noised to
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    mask: np.ndarray  # [R] bool, True = a real pair


def pair_indices(rewards: np.ndarray) -> np.ndarray:
    """[P, G] rewards -> [P, 2] each group's (best, worst) sample (the first of equals)."""
    rewards = np.asarray(rewards)
    chex.assert_rank(rewards, 2)
    return np.stack([np.argmax(rewards, axis=1), np.argmin(rewards, axis=1)], axis=1)


def sample_times(
    rng: np.random.Generator,
    count: int,
    timestep_range: float,
    logit_mean: float,
    logit_std: float,
    shift: float,
) -> np.ndarray:
    """[count] sigmas from the released logit-normal draw (module docstring), float64."""
    u = 1.0 / (1.0 + np.exp(-(logit_mean + logit_std * rng.standard_normal(count))))
    u = shift * u / (1.0 + (shift - 1.0) * u)
    return 1.0 - timestep_range * np.clip(u, TIME_FLOOR, TIME_CEILING)


def gather_rows(
    leaves: np.ndarray, rewards: np.ndarray, times: np.ndarray, key: jax.Array
) -> DPORows:
    """Each prompt's pair [P, G, *S] -> P * T rows, prompt-major, at `times` [P, T], each
    row with its own noise shared by its winner and loser. `rewards` is [P, G]."""
    leaves = np.asarray(leaves)
    num_prompts, group = leaves.shape[:2]
    chex.assert_shape(rewards, (num_prompts, group))
    per_prompt = times.shape[1]
    best_worst = pair_indices(rewards)
    pairs = np.take_along_axis(
        leaves, best_worst.reshape(num_prompts, 2, *([1] * (leaves.ndim - 2))), axis=1
    )
    x0 = np.repeat(pairs, per_prompt, axis=0)  # [P * T, 2, *S]
    shape = (x0.shape[0], *leaves.shape[2:])
    noise = np.asarray(jax.random.normal(key, shape, jnp.float32)).astype(x0.dtype)
    prompt = np.repeat(np.arange(num_prompts, dtype=np.int32), per_prompt)
    time = np.asarray(times, np.float32).reshape(-1)
    return DPORows(x0, noise, time, prompt, np.ones(len(x0), bool))


@dataclasses.dataclass(frozen=True)
class DPOSettings(LossSettings):
    """`dpo_loss`'s settings: the preference's scale beta."""

    beta: float = 100.0


def dpo_loss(
    params: PyTree,
    batch: DPORows,
    settings: DPOSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Diffusion-DPO's loss over the batch's real pairs (module docstring); the gradient
    flows through `params` alone. `uncond` is not read: the conditional velocity is
    trained, as the release does."""
    chex.assert_rank(inputs.cond, 3)
    chex.assert_equal_shape([batch.x0[:, 0], batch.noise])
    if inputs.ref_params is None:
        raise ValueError("Diffusion-DPO compares with the initial model: it needs ref_params.")
    mask = batch.mask.astype(bool)
    rows = batch.x0.shape[0]
    sample_shape = batch.x0.shape[2:]
    x0 = batch.x0.astype(jnp.float32).reshape(rows * 2, *sample_shape)
    noise = jnp.repeat(batch.noise.astype(jnp.float32), 2, axis=0)
    sigma = jnp.repeat(batch.time.astype(jnp.float32), 2)
    s = sigma.reshape(-1, *([1] * len(sample_shape)))
    xt = (1.0 - s) * x0 + s * noise
    target = (noise - x0).reshape(rows, 2, *sample_shape)
    t = sigma * inputs.schedule.timestep_scale
    pair_cond = jnp.repeat(inputs.cond[batch.prompt], 2, axis=0)
    axes = tuple(range(2, 2 + len(sample_shape)))

    def velocity(p):
        v = settings.denoise_fn(p, xt, t, pair_cond).astype(jnp.float32)
        return v.reshape(rows, 2, *sample_shape)

    v = velocity(params)
    v_ref = jax.lax.stop_gradient(velocity(inputs.ref_params))
    err = jnp.mean((target - v) ** 2, axis=axes)  # [R, 2]: winner, loser
    ref_err = jnp.mean((target - v_ref) ** 2, axis=axes)
    gap = err - ref_err  # how much worse than the initial model on each arm
    z = -0.5 * settings.beta * (gap[:, 0] - gap[:, 1])
    policy_loss = masked_mean(-jax.nn.log_sigmoid(z), mask)
    kl = masked_mean(jnp.mean((v - v_ref) ** 2, axis=(1, *axes)), mask)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        # the implicit rewards -beta/2 * gap of winner and loser, and how often w leads
        "reward_margin": masked_mean(z, mask),
        "implicit_accuracy": masked_mean((z > 0).astype(jnp.float32), mask),
        "winner_err": masked_mean(err[:, 0], mask),
        "loser_err": masked_mean(err[:, 1], mask),
        "trained_edges": 2 * jnp.sum(mask),
        "rows": jnp.sum(mask),
    }
    return policy_loss + settings.kl_beta * kl, metrics


class DPOObjective(forward.ForwardObjective):
    name = "dpo"
    keeps_old_policy = False  # the preference is measured against the initial model
    section = "dpo"
    rows_type = DPORows
    grouped_fields = ("x0",)  # a pair: the winner and the loser
    reported_metrics = ("reward_margin", "implicit_accuracy")

    # Diffusion-DPO's settings (tree.method "dpo"). Defaults: Flow-Factory's SD3.5-M example
    # (examples/dpo/lora/sd3_5/default.yaml over DPOTrainingArguments): beta 100 (the
    # arguments' own default is 2000), one time per pair from a logit-normal (mean 0, std 1,
    # no shift) over the top 99% of the noise levels.
    settings = {
        "beta": Setting(100.0, "the preference's temperature", low=0, open_low=True),
        "train_timesteps": Setting(
            1, "times each pair is trained at (their num_train_timesteps)", low=1
        ),
        "timestep_range": Setting(
            0.99, "sigma = 1 - timestep_range * u", low=0, high=1, open_low=True
        ),
        "logit_mean": Setting(0.0, "the logit-normal's mean"),
        "logit_std": Setting(1.0, "the logit-normal's std", low=0, open_low=True),
        "time_shift": Setting(1.0, "t -> s t / (1 + (s - 1) t)", low=0, open_low=True),
    }

    def check_run(self, config, spec):
        if config.tree.group_size < 2:
            return (
                f"tree.method={config.tree.method} pairs each prompt's best sample with its "
                f"worst: tree.group_size must be at least 2, got {config.tree.group_size}."
            )
        return None

    def needs_initial_model(self, config):
        return True  # the preference is measured against it

    def rows(self, method, config, source: RowSource, key=None) -> DPORows:
        """Every prompt's (best, worst) pair at `train_timesteps` times."""
        d = config.dpo
        rewards = np.asarray(source.rewards)[source.rows]
        rng, noise_key = forward.time_and_noise_draws(key)
        times = sample_times(
            rng,
            rewards.shape[0] * d.train_timesteps,
            d.timestep_range,
            d.logit_mean,
            d.logit_std,
            d.time_shift,
        ).reshape(rewards.shape[0], d.train_timesteps)
        rows = gather_rows(source.tree.leaves, rewards, times, noise_key)
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        return dpo_loss, DPOSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(config.train.kl_beta),
            beta=float(config.dpo.beta),
        )

    def row_group(self, config):
        return 2

    def row_samples(self, config, spec):
        """Per time a pair is trained at: its winner, its loser and their noise."""
        return 3 * config.dpo.train_timesteps

    def training_counts(self, config, spec, prunes):
        """A row is a pair at one time: its two samples through the trained weights and
        through the initial model."""
        c, d = config, config.dpo
        return forward.row_counts(
            spec,
            c.sampling.guidance_scale != 1.0,
            edges=2 * d.train_timesteps,
            rows=d.train_timesteps,
            forwards=4 * d.train_timesteps,
            grads=2 * d.train_timesteps,  # the trained weights' pair
        )


DPO = DPOObjective()
