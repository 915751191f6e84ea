"""DiffusionNFT: the forward-process objective of arXiv 2509.16117 on a flow model.

No step of the sampler is scored. The final samples x0 of a rollout (a tree's leaves) are
noised again along the flow, x_t = (1 - sigma) x0 + sigma * eps at sampling sigmas drawn per
sample, and the velocity is trained there, weighted by each sample's reward:

    r = clip(A / (2 * clip) + 1/2, 0, 1)        the optimality probability of a sample
    v+ = beta * v + (1 - beta) * v_old           the implicit positive policy
    v- = (1 + beta) * v_old - beta * v           the implicit negative policy
    x0+- = x_t - sigma * v+-                     what each policy says x0 was
    loss = clip / beta * [r |x0+ - x0|^2 / w+  +  (1 - r) |x0- - x0|^2 / w-]

with A the sample's advantage clipped to +-clip, |.|^2 a mean over the sample's entries and
w+- the (constant) mean absolute error of x0+- (the released code's adaptive weighting).
`v_old` is the old policy: the copy that samples, moved towards the trained weights after
every iteration as old <- d * old + (1 - d) * new, with d rising over the iterations
(`old_policy_decay`). A KL term kl_beta * |v - v_ref|^2 to the initial model is optional.

Rows (`NFTRows`) are (sample, sigma, noise) triples, built on the host once per iteration;
`transitions.minibatches` and the train step carry them as they carry PPO's transitions.
`NFT` is the objective the method table's DiffusionNFT entries hold (objective.py).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax.core.guidance import PyTree
from tree_grpo_jax.core.loss import LossInputs, LossSettings, check_kl_reference, masked_mean
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.transitions import MaskedRows
from tree_grpo_jax.methods import forward
from tree_grpo_jax.methods.objective import RowSource


@struct.dataclass
class NFTRows(MaskedRows):
    x0: np.ndarray  # [R, *S] a final sample (the rollout's leaf)
    noise: np.ndarray  # [R, *S] the forward process's noise for this row
    step: np.ndarray  # [R] int32: the sampling step whose sigma noises the sample
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    optimality: np.ndarray  # [R] float32 in [0, 1]: r of the row's sample
    mask: np.ndarray  # [R] bool, True = a real row


# ---------------------------------------------------------------------------------------------
# Rows: every leaf at a share of the sampling steps.


def steps_per_sample(num_steps: int, timestep_fraction: float) -> int:
    """Sigmas each sample is trained at: the released `int(num_steps * timestep_fraction)`,
    at least one."""
    return max(1, int(num_steps * timestep_fraction))


def gather_rows(
    leaves: np.ndarray,
    optimality: np.ndarray,
    key: jax.Array,
    num_steps: int,
    per_sample: int,
) -> NFTRows:
    """Every leaf [P, L, *S] at `per_sample` distinct sampling steps of the `num_steps`,
    each with its own noise: P * L * per_sample rows, sample-major. `optimality` is [P, L]."""
    leaves = np.asarray(leaves)
    num_prompts, num_leaves = leaves.shape[:2]
    chex.assert_shape(optimality, (num_prompts, num_leaves))
    if not 1 <= per_sample <= num_steps:
        raise ValueError(f"per_sample must be in 1..{num_steps}, got {per_sample}.")
    samples = num_prompts * num_leaves
    step_key, noise_key = jax.random.split(key)
    # A random subset of the steps per sample, as the released per-sample permutations.
    order = jax.vmap(lambda k: jax.random.permutation(k, num_steps))(
        jax.random.split(step_key, samples)
    )
    steps = np.asarray(order[:, :per_sample], np.int32).reshape(-1)
    flat = leaves.reshape(samples, *leaves.shape[2:])
    x0 = np.repeat(flat, per_sample, axis=0)
    noise = np.asarray(jax.random.normal(noise_key, x0.shape, jnp.float32)).astype(x0.dtype)
    prompt = np.repeat(np.arange(num_prompts, dtype=np.int32), num_leaves * per_sample)
    r = np.repeat(np.asarray(optimality, np.float32).reshape(-1), per_sample)
    return NFTRows(x0, noise, steps, prompt, r, np.ones(x0.shape[0], bool))


# ---------------------------------------------------------------------------------------------
# The objective.


def _weighted_error(x0_hat: jax.Array, x0: jax.Array) -> jax.Array:
    """|x0_hat - x0|^2 per row over its (constant) mean absolute error."""
    error = x0_hat - x0
    weight = jax.lax.stop_gradient(
        jnp.maximum(forward.row_mean(jnp.abs(error)), forward.WEIGHT_FLOOR)
    )
    return forward.row_mean(error**2) / weight


@dataclasses.dataclass(frozen=True)
class NFTSettings(LossSettings):
    """`nft_loss`'s settings: the implicit policies' step and the advantages' clip."""

    beta: float = 1.0
    clip: float = 5.0


def nft_loss(
    params: PyTree,
    batch: NFTRows,
    settings: NFTSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DiffusionNFT loss averaged over the batch's real rows, plus kl_beta times the
    mean squared velocity gap to `ref_params` when given. Two forwards per row (three with
    the KL); the gradient flows through `params` alone. `uncond` is not read: the method
    samples and trains the conditional velocity (the config refuses guidance with it)."""
    chex.assert_rank(inputs.cond, 3)
    chex.assert_equal_shape([batch.x0, batch.noise])
    chex.assert_equal_shape([batch.step, batch.prompt, batch.optimality, batch.mask])
    check_kl_reference(settings.kl_beta, inputs.ref_params)
    beta, clip = settings.beta, settings.clip
    mask = batch.mask.astype(bool)
    x0 = batch.x0.astype(jnp.float32)
    sigma = inputs.schedule.sigmas[batch.step].reshape(-1, *([1] * (x0.ndim - 1)))
    xt = (1.0 - sigma) * x0 + sigma * batch.noise.astype(jnp.float32)
    t = inputs.schedule.timesteps[batch.step]
    row_cond = inputs.cond[batch.prompt]

    def velocity(p):
        return settings.denoise_fn(p, xt, t, row_cond).astype(jnp.float32)

    v = velocity(params)
    v_old = jax.lax.stop_gradient(velocity(inputs.old_params))
    positive = xt - sigma * (beta * v + (1.0 - beta) * v_old)
    negative = xt - sigma * ((1.0 + beta) * v_old - beta * v)
    r = batch.optimality.astype(jnp.float32)
    per_row = r * _weighted_error(positive, x0) + (1.0 - r) * _weighted_error(negative, x0)
    policy_loss = masked_mean(per_row * (clip / beta), mask)
    if inputs.ref_params is not None:
        v_ref = jax.lax.stop_gradient(velocity(inputs.ref_params))
        kl = masked_mean(forward.row_mean((v - v_ref) ** 2), mask)
    else:
        kl = jnp.zeros((), jnp.float32)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        # how far the trained velocity has moved from the sampling policy's
        "old_deviation": masked_mean(forward.row_mean((v - v_old) ** 2), mask),
        "optimality_mean": masked_mean(r, mask),
        "trained_edges": jnp.sum(mask),
        "rows": jnp.sum(mask),
    }
    return policy_loss + settings.kl_beta * kl, metrics


# ---------------------------------------------------------------------------------------------
# The objective as the method table holds it.


class NFTObjective(forward.ForwardObjective):
    name = "nft"
    section = "diffusion_nft"
    rows_type = NFTRows

    # DiffusionNFT's settings (tree.method "diffusion_nft" / "diffusion_nft_tree"): the
    # velocity is trained on the leaves noised again at sampling sigmas, between the implicit
    # policies beta * v + (1 - beta) * v_old and (1 + beta) * v_old - beta * v, each leaf
    # weighted by its optimality r = clip(A / (2 * advantage.clip) + 1/2, 0, 1). Defaults:
    # the released SD3.5-M configs (NVlabs/DiffusionNFT config/nft.py); train.kl_beta is its
    # KL to the initial model (theirs: 1e-4) and advantage.clip its adv_clip_max (5).
    settings = {
        "beta": Setting(
            1.0, "the implicit policies' step (theirs: 1.0; 0.1 for OCR)", low=0, open_low=True
        ),
        # The old policy samples and anchors the loss: after each iteration
        # old <- d * old + (1 - d) * new, d = min(max(0, iterations done - flat) * rate, max)
        # (their decay_type 1: 0, 0.001, 0.5; decay_type 2, for OCR: 75, 0.0075, 0.999).
        "old_policy_flat": Setting(0, "iterations before the old policy starts moving", low=0),
        "old_policy_rate": Setting(0.001, "the decay's rise per iteration", low=0),
        "old_policy_max": Setting(
            0.5,
            "the decay's cap",
            low=0,
            high=1,
            open_high=True,
            note="1 would never move the old policy",
        ),
        "timestep_fraction": Setting(
            0.99,
            "sigmas each leaf is trained at: int(sampling.num_steps * fraction) of the sampling "
            "steps, drawn per leaf without repeats, each with its own noise (theirs: 0.99)",
            low=0,
            high=1,
            open_low=True,
        ),
    }

    def check_run(self, config, spec):
        if config.sampling.guidance_scale == 1.0:
            return None
        return (
            f"{config.tree.method} samples and trains the conditional velocity without guidance "
            "(DiffusionNFT's CFG-free setting); set sampling.guidance_scale=1, not "
            f"{config.sampling.guidance_scale}."
        )

    def rows(self, method, config, source: RowSource, key=None) -> NFTRows:
        """Every leaf at `timestep_fraction` of the sampling steps, weighted by its
        optimality (normalised over the global batch, as every process)."""
        c = config
        (leaf_advantages,) = method.clipped_advantages(
            c, source.spec, source.tree, jnp.asarray(source.rewards)
        )
        r = forward.optimality(np.asarray(leaf_advantages)[source.rows], c.advantage.clip)
        num_steps = c.sampling.num_steps
        per_sample = steps_per_sample(num_steps, c.diffusion_nft.timestep_fraction)
        key = jax.random.fold_in(key, jax.process_index())  # each process its own noise
        rows = gather_rows(source.tree.leaves, r, key, num_steps, per_sample)
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        return nft_loss, NFTSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(config.train.kl_beta),
            beta=float(config.diffusion_nft.beta),
            clip=float(config.advantage.clip),
        )

    def decay(self, config, iterations_done):
        n = config.diffusion_nft
        return forward.old_policy_decay(
            iterations_done, n.old_policy_flat, n.old_policy_rate, n.old_policy_max
        )

    def _per_sample(self, config) -> int:
        return steps_per_sample(config.sampling.num_steps, config.diffusion_nft.timestep_fraction)

    def row_samples(self, config, spec):
        """Each leaf and its noise, again, per sigma it is trained at."""
        return 2 * self._per_sample(config) * spec.leaves

    def training_counts(self, config, spec, prunes):
        """Every leaf at its share of the sampling steps, one row each; a row runs the
        trained and the old policy (and the reference with a KL term)."""
        forwards = 3 if config.train.kl_beta > 0 else 2
        return forward.leaf_row_counts(spec, spec.leaves * self._per_sample(config), forwards)


NFT = NFTObjective()
