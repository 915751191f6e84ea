"""The GRPO objective: PPO-clip over a minibatch of transitions.

One denoiser forward per row (a parent) gives the step's Gaussian; all K actions taken from
that parent are scored against it, so a BRANCH(k) parent costs one forward for k edges.
Masked slots (chain padding, pruned edges, padded rows) contribute nothing, and a batch
with no trained edge has loss 0 and zero gradient.

Each row's std is multiplied by its `noise_scale`, the multiplier the rollout scored the
actions with (`Segment.score_scale`): the split's noise scale by default, 1 when the rollout
ran with `split_log_prob="unscaled"` (BranchGRPO's released convention). The loss thus
follows the rollout's convention and the importance ratio is 1 before an update either way.

GRPO-Guard (arXiv 2510.22319; `guard=True`, flow schedules) regulates the ratio: with s the
step's std and mu, mu_old the step means under the trained and the rollout's parameters
(`Transitions.old_means`), log r = s * (logp - logp_old + |mu - mu_old|^2 / (2 s^2)), which
is |.|-reduced (mu - mu_old) . (x - mu_old) / s: centred under the rollout's Gaussian and of
one scale at every step, where the plain log-ratio is biased below 0 and grows as s shrinks.
`guard_reweight="dt"` then divides each edge's term by its step's |dt| (the released
trainers' `policy_loss / sqrt_dt**2`), which evens the steps' gradients.

Every loss is called as `loss(params, batch, settings, inputs)`. `settings` is one record
(`PPOSettings` here, each method's own beside its loss), built once from the config by the
method's objective; the train step closes over it, so its fields are constants of the
compiled program: jit a loss with the record static. `inputs` (`LossInputs`) holds the
arrays the train step hands every loss besides the trained weights and the minibatch: the
schedule, the prompt embeddings and the frozen weights a loss compares with.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import struct

from tree_grpo_jax.core import sampling
from tree_grpo_jax.core.guidance import DenoiseFn, PyTree, guided_prediction, traced_once
from tree_grpo_jax.core.transitions import Transitions


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over the True entries; 0 when there are none."""
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1)


def _per_row(values: jax.Array, ndim: int) -> jax.Array:
    """[R] -> [R, 1, ...] with `ndim` trailing ones, to broadcast against [R, K, *S]."""
    return values.reshape(values.shape[0], *([1] * ndim))


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """What every loss is built with; each loss extends it with its own fields."""

    denoise_fn: DenoiseFn
    kl_beta: float = 0.0  # weight of the KL term to the reference (`ref_params`)


@struct.dataclass
class LossInputs:
    """What the train step hands every loss besides the trained weights, the minibatch and
    the settings; a loss reads the fields it needs. The frozen weights are None where the
    run keeps none: `ref_params` without a KL term or an initial-model reference, and
    `old_params` for a state without an old copy of the policy."""

    schedule: sampling.Schedule  # the sampler's (a flow's `FlowSchedule` for its methods)
    cond: jax.Array  # [B, T, D] the prompt batch's embeddings; a row's `prompt` indexes it
    uncond: jax.Array | None = None  # the empty prompt's embedding, for a guided forward
    ref_params: PyTree | None = None  # the initial model (KL or preference reference)
    old_params: PyTree | None = None  # the old copy of the policy (`keeps_old_policy`)


@dataclasses.dataclass(frozen=True)
class PPOSettings(LossSettings):
    """`ppo_loss`'s settings. `reduce` must match the rollout's; `guard`: GRPO-Guard's
    ratio and, with `guard_reweight="dt"`, its per-step weights (module docstring);
    `correction`: "clip" (PPO) or "truncated" (`truncated_surrogate`, capped at
    `weight_max`)."""

    guidance_scale: float = 1.0
    clip_range: float = 1e-4
    reduce: str = "mean"
    guard: bool = False
    guard_reweight: str = "dt"
    correction: str = "clip"
    weight_max: float = 1.0


# how a row's ratio to the policy that drew it enters the loss (train.replay_correction)
REPLAY_CORRECTIONS = ("clip", "truncated")


def check_kl_reference(kl_beta: float, ref_params) -> None:
    """A KL term needs its reference."""
    if ref_params is None and kl_beta != 0:
        raise ValueError("kl_beta is set but no ref_params were given for the KL reference.")


def _row_gaussian(settings: PPOSettings, params, batch, schedule, cond, uncond):
    """The step Gaussian of every row: (mean [R, 1, *S], std broadcastable to it)."""
    event_ndim = batch.x.ndim - 1
    t = schedule.timesteps[batch.step]
    denoise = traced_once(settings.denoise_fn)
    pred = guided_prediction(
        denoise, params, batch.x, t, cond[batch.prompt], uncond, settings.guidance_scale
    )
    # Each row has its own step index: gather the schedule per row, broadcasting over
    # the child axis and the sample axes.
    i = _per_row(batch.step, event_ndim + 1)
    mean, std = schedule.transition(i, batch.x[:, None], pred[:, None])
    return mean, std * _per_row(batch.noise_scale, event_ndim + 1)


def score_actions(
    params: PyTree,
    batch: Transitions,
    settings: PPOSettings,
    *,
    schedule: sampling.Schedule,
    cond: jax.Array,
    uncond: jax.Array | None = None,
) -> jax.Array:
    """Log-probs [R, K] of the batch's actions under `params`: one forward per row."""
    mean, std = _row_gaussian(settings, params, batch, schedule, cond, uncond)
    event_ndim = batch.x.ndim - 1
    return sampling.gaussian_log_prob(batch.actions, mean, std, event_ndim, settings.reduce)


GUARD_REWEIGHTS = ("dt", "none")


def guard_log_ratio(
    log_ratio: jax.Array,
    mean: jax.Array,
    old_mean: jax.Array,
    std: jax.Array,
    event_ndim: int,
    reduce: str,
) -> jax.Array:
    """GRPO-Guard's normalised log-ratio [R, K] from the plain one [R, K], the step means
    [R, 1, *S] (trained) and [R, *S] (rollout's) and the std broadcastable to the means."""
    scale = jnp.mean(jnp.broadcast_to(std, mean.shape), axis=tuple(range(2, mean.ndim)))
    gap = sampling.reduce_event(
        (mean[:, 0] - old_mean.astype(jnp.float32)) ** 2, event_ndim, reduce
    )
    return (log_ratio + gap[:, None] / (2.0 * scale**2)) * scale


def clipped_surrogate(advantages: jax.Array, ratio: jax.Array, clip_range: float) -> jax.Array:
    """PPO's per-term loss max(-A * r, -A * clip(r, 1 - eps, 1 + eps))."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return jnp.maximum(unclipped, clipped)


def truncated_surrogate(advantages: jax.Array, log_ratio: jax.Array, weight_max: float):
    """The truncated importance-weighted policy gradient's per-term loss: its value is
    -A * min(r, weight_max) and its gradient -A * min(r, weight_max) * grad log pi, the
    weight held constant; r = exp(log_ratio) to the policy that drew the action, never
    clipped. Where r = 1 (a fresh row in one update per iteration) it is PPO's term."""
    fixed = jax.lax.stop_gradient(log_ratio)
    weight = jnp.minimum(jnp.exp(fixed), weight_max)
    return -advantages * weight * jnp.exp(log_ratio - fixed)


def ratio_metrics(ratio: jax.Array, mask: jax.Array, clip_range: float) -> dict[str, jax.Array]:
    """The clipped share and the mean, least and greatest ratio over the True entries of
    `mask` (1 for the ratios when there are none)."""
    big = jnp.finfo(jnp.float32).max
    any_live = jnp.any(mask)
    return {
        "clip_fraction": masked_mean((jnp.abs(ratio - 1.0) > clip_range).astype(jnp.float32), mask),
        "ratio_mean": jnp.where(any_live, masked_mean(ratio, mask), 1.0),
        "ratio_min": jnp.where(any_live, jnp.min(jnp.where(mask, ratio, big)), 1.0),
        "ratio_max": jnp.where(any_live, jnp.max(jnp.where(mask, ratio, -big)), 1.0),
    }


def _log_ratio(settings: PPOSettings, batch: Transitions, mean, std, mask) -> jax.Array:
    """log r [R, K] of every edge (0 at masked slots), GRPO-Guard's with `guard`."""
    event_ndim = batch.x.ndim - 1
    new_log_probs = sampling.gaussian_log_prob(
        batch.actions, mean, std, event_ndim, settings.reduce
    )
    # Masked slots may hold anything: zero their log-ratio before exp so they stay finite.
    log_ratio = jnp.where(mask, new_log_probs - batch.old_log_probs, 0.0)
    if settings.guard:
        if batch.old_means is None:
            raise ValueError("guard needs the rollout's step means (record_means=True).")
        guarded = guard_log_ratio(
            log_ratio, mean, batch.old_means, std, event_ndim, settings.reduce
        )
        log_ratio = jnp.where(mask, guarded, 0.0)
    return log_ratio


def ppo_loss(
    params: PyTree,
    batch: Transitions,
    settings: PPOSettings,
    inputs: LossInputs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip loss averaged over the trained edges, plus kl_beta * KL to a reference.

    per edge: max(-A * r, -A * clip(r, 1 - eps, 1 + eps)), r = exp(logp_new - logp_old),
    A as given (the method table has clipped it); with `correction="truncated"`,
    `truncated_surrogate` in its place. The KL term (when `ref_params` is given)
    is the KL between the step Gaussians of the policy and the frozen reference, which
    share the policy's std (noise_scale included): mean((mu - mu_ref)^2) / (2 std^2),
    Flow-GRPO's form; it is averaged over the rows that have a trained edge and costs one
    more forward per row. `inputs.old_params` is not read: the rollout's log-probs are the
    old policy's.
    """
    schedule, cond, uncond = inputs.schedule, inputs.cond, inputs.uncond
    ref_params = inputs.ref_params
    chex.assert_rank(cond, 3)
    chex.assert_equal_shape_prefix([batch.x, batch.actions, batch.mask], 1)
    chex.assert_equal_shape([batch.old_log_probs, batch.advantages, batch.mask])
    check_kl_reference(settings.kl_beta, ref_params)

    mask = batch.mask.astype(bool)
    mean, std = _row_gaussian(settings, params, batch, schedule, cond, uncond)
    log_ratio = _log_ratio(settings, batch, mean, std, mask)
    ratio = jnp.exp(log_ratio)
    advantages = batch.advantages.astype(jnp.float32)  # clipped once, by the method table
    if settings.correction == "truncated":  # replayed rows weighted, not clipped
        per_edge = truncated_surrogate(advantages, log_ratio, settings.weight_max)
    else:
        per_edge = clipped_surrogate(advantages, ratio, settings.clip_range)
    if settings.guard and settings.guard_reweight == "dt":
        per_edge = per_edge / -schedule.dt[batch.step][:, None]
    policy_loss = masked_mean(per_edge, mask)

    live_rows = mask.any(axis=1)
    if ref_params is not None:
        ref_mean, _ = _row_gaussian(
            settings, jax.lax.stop_gradient(ref_params), batch, schedule, cond, uncond
        )
        event_ndim = batch.x.ndim - 1
        row_kl = sampling.gaussian_kl(mean, ref_mean, std, event_ndim, settings.reduce)[:, 0]
        kl = masked_mean(row_kl, live_rows)
    else:
        kl = jnp.zeros((), jnp.float32)
    loss = policy_loss + settings.kl_beta * kl

    adv_mean = masked_mean(advantages, mask)
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "approx_kl": 0.5 * masked_mean(log_ratio**2, mask),
        **ratio_metrics(ratio, mask, settings.clip_range),
        "advantage_mean": adv_mean,
        "advantage_std": jnp.sqrt(masked_mean((advantages - adv_mean) ** 2, mask)),
        "trained_edges": jnp.sum(mask),
        "rows": jnp.sum(live_rows),
    }
    return loss, metrics
