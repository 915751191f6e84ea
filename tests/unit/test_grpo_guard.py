"""GRPO-Guard's regulated ratio and step weights against a float64 numpy version written from
the released formula, its neutral first step, and the PPO loss left as it was when it is off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import transitions
from tree_grpo_jax.core.loss import LossInputs, PPOSettings, ppo_loss
from tree_grpo_jax.core.sampling import make_flow_schedule

SHAPE = (3, 2)
NUM_STEPS = 6
K = 2


def linear_denoiser(params, x, t, cond):
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=SHAPE), jnp.float32),
    }


def _np_velocity(p, x, sigma, cond_mean):
    return x @ np.asarray(p["w"], np.float64) + sigma * np.asarray(p["b"], np.float64) + cond_mean


def _np_step(schedule, p, x, i, cond_mean, noise_scale):
    """The Flow-GRPO SDE step in float64: (mean, std) at step i (sampling.FlowSchedule's)."""
    sigmas = np.asarray(schedule.sigmas, np.float64)
    sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
    sig = schedule.noise_level * float(schedule.unit_sig[i])
    v = _np_velocity(p, x, sigma, cond_mean)
    mean = x * (1 + sig**2 * dt / (2 * sigma)) + v * (1 + sig**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, sig * np.sqrt(-dt) * noise_scale


def _batch(schedule, rollout_params, seed, rows=5):
    """Random parents at random steps, their children drawn from the rollout's Gaussian,
    scored there (old_log_probs) and its means kept; the last row's second child masked."""
    rng = np.random.default_rng(seed)
    cond = rng.normal(size=(2, 3, 4))
    x = rng.normal(size=(rows, *SHAPE))
    step = rng.integers(0, NUM_STEPS - 1, size=rows)
    prompt = rng.integers(0, 2, size=rows)
    noise_scale = rng.uniform(0.8, 1.5, size=rows)
    actions, old_lp, old_means = [], [], []
    for r in range(rows):
        mu, std = _np_step(schedule, rollout_params, x[r], step[r], cond[prompt[r]].mean(), 1.0)
        std = std * noise_scale[r]
        kids = mu + std * rng.normal(size=(K, *SHAPE))
        actions.append(kids)
        old_lp.append(
            [
                np.mean(-((a - mu) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi))
                for a in kids
            ]
        )
        old_means.append(mu)
    mask = np.ones((rows, K), bool)
    mask[-1, 1] = False
    batch = transitions.Transitions(
        x=x.astype(np.float32),
        step=step.astype(np.int32),
        prompt=prompt.astype(np.int32),
        noise_scale=noise_scale.astype(np.float32),
        actions=np.asarray(actions, np.float32),
        old_log_probs=np.asarray(old_lp, np.float32),
        advantages=rng.normal(size=(rows, K)).astype(np.float32),
        mask=mask,
        old_means=np.asarray(old_means, np.float32),
    )
    return batch, cond.astype(np.float32)


def reference_loss(params, batch, schedule, cond, clip_range, reweight):
    """Per edge, in float64: s = the step's std, mu / mu_old the trained / rollout means,
    log r = s * (logp - logp_old + mean((mu - mu_old)^2) / (2 s^2)); the PPO-clip term,
    divided by |dt| with reweight "dt"; the mean over the trained edges."""
    sigmas = np.asarray(schedule.sigmas, np.float64)
    x = batch.x.astype(np.float64)
    total, count = 0.0, 0
    for r in range(len(batch.step)):
        i = int(batch.step[r])
        c = np.asarray(cond, np.float64)[batch.prompt[r]].mean()
        mu, std = _np_step(schedule, params, x[r], i, c, float(batch.noise_scale[r]))
        for k in range(K):
            if not batch.mask[r, k]:
                continue
            a = batch.actions[r, k].astype(np.float64)
            logp = np.mean(-((a - mu) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi))
            gap = np.mean((mu - batch.old_means[r].astype(np.float64)) ** 2)
            ratio = np.exp(std * (logp - float(batch.old_log_probs[r, k]) + gap / (2 * std**2)))
            adv = float(batch.advantages[r, k])
            term = max(-adv * ratio, -adv * np.clip(ratio, 1 - clip_range, 1 + clip_range))
            if reweight == "dt":
                term /= sigmas[i] - sigmas[i + 1]
            total += term
            count += 1
    return total / count


@pytest.mark.parametrize("clip_range, reweight", [(1e-4, "dt"), (0.2, "none")])
def test_the_guarded_loss_matches_the_released_formula(clip_range, reweight):
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0, noise_level=0.7)
    rollout_params, params = _params(0), _params(1)
    batch, cond = _batch(schedule, rollout_params, seed=2)
    inputs = LossInputs(schedule, jnp.asarray(cond))
    guarded = PPOSettings(
        linear_denoiser, clip_range=clip_range, guard=True, guard_reweight=reweight
    )
    loss, metrics = ppo_loss(params, batch, guarded, inputs)
    expected = reference_loss(params, batch, schedule, cond, clip_range, reweight)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-4)
    assert int(metrics["trained_edges"]) == 2 * 5 - 1
    # the guard changes the loss: the plain ratio gives another number
    plain, _ = ppo_loss(params, batch, PPOSettings(linear_denoiser, clip_range=clip_range), inputs)
    assert abs(float(plain) - expected) > 1e-3 * abs(expected)


def test_the_guarded_ratio_is_one_under_the_rollout_s_own_weights():
    """mu = mu_old and logp = logp_old: the ratio is exactly 1 and its gradient is s times
    the plain one's (the normalised log-ratio is s * (logp - logp_old) + O(gap))."""
    schedule = make_flow_schedule(NUM_STEPS, noise_level=0.7)
    params = _params(3)
    batch, cond = _batch(schedule, params, seed=4)
    settings = PPOSettings(linear_denoiser, clip_range=0.2, guard=True)
    _, metrics = ppo_loss(params, batch, settings, LossInputs(schedule, jnp.asarray(cond)))
    assert float(metrics["ratio_min"]) == pytest.approx(1.0, abs=2e-5)
    assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=2e-5)


def test_the_loss_without_the_guard_ignores_the_recorded_means():
    schedule = make_flow_schedule(NUM_STEPS, noise_level=0.7)
    batch, cond = _batch(schedule, _params(5), seed=6)
    settings = PPOSettings(linear_denoiser, clip_range=0.2)
    inputs = LossInputs(schedule, jnp.asarray(cond))
    grad = jax.grad(lambda p, b: ppo_loss(p, b, settings, inputs)[0])
    with_means = grad(_params(7), batch)
    without = grad(_params(7), batch.replace(old_means=None))
    jax.tree_util.tree_map(np.testing.assert_array_equal, with_means, without)
