"""Advantage Weighted Matching's objective against a per-sample float64 numpy version written
from the release's formulas, its gradient's sign, its credit and its time samplers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.core.sampling import make_flow_schedule
from tree_grpo_jax.methods import awm, forward

SHAPE = (3, 2)
NUM_STEPS = 10


def linear_denoiser(params, x, t, cond):
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=SHAPE), jnp.float32),
    }


def _rows(seed, rows=6, prompts=2):
    rng = np.random.default_rng(seed)
    return awm.AWMRows(
        x0=rng.normal(size=(rows, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, *SHAPE)).astype(np.float32),
        time=rng.uniform(0.05, 1.0, size=rows).astype(np.float32),
        prompt=rng.integers(0, prompts, size=rows).astype(np.int32),
        advantage=rng.normal(size=rows).astype(np.float32),
        mask=np.array([True] * (rows - 1) + [False]),
    )


def _np(p):
    return {k: np.asarray(v, np.float64) for k, v in p.items()}


def _velocity(p, x, t, c):
    return x @ p["w"] + t * p["b"] + c


def _log_prob(v, target, t, weighting, power):
    """compute_log_prob_awm of the release, in float64."""
    lp = -np.mean((v - target) ** 2)
    if weighting == "t":
        return lp * t
    if weighting == "ghuber":
        return -((-lp + 1e-10) ** power - 1e-10**power) * t / power
    return lp


def reference_loss(params, old, ref, rows, cond, s):
    """The released per-sample loss: PPO-clip of exp(logp - logp_old) with the sample's
    advantage, + kl_beta |v - v_ref|^2 + ema_beta |v - v_ema|^2, means over the real rows.
    `old` is the EMA copy's weights; on-policy, logp_old is logp's value (`s["frozen"]`)."""
    p, po, pr = _np(params), _np(old), _np(ref)
    cond = np.asarray(cond, np.float64)
    policy = kl = ema = 0.0
    count = 0
    for i in range(len(rows.mask)):
        if not rows.mask[i]:
            continue
        t = float(rows.time[i])
        x0, eps = rows.x0[i].astype(np.float64), rows.noise[i].astype(np.float64)
        xt = (1 - t) * x0 + t * eps
        c = cond[rows.prompt[i]].mean()
        v, v_old, v_ref = (_velocity(q, xt, t, c) for q in (p, po, pr))
        lp = _log_prob(v, eps - x0, t, s["weighting"], s["power"])
        if s["off_policy"]:
            lp_old = _log_prob(v_old, eps - x0, t, s["weighting"], s["power"])
        else:
            lp_old = s["frozen"][i]
        ratio = np.exp(lp - lp_old)
        a = float(rows.advantage[i])
        eps_c = s["clip"]
        policy += max(-a * ratio, -a * np.clip(ratio, 1 - eps_c, 1 + eps_c))
        kl += np.mean((v - v_ref) ** 2)
        ema += np.mean((v - v_old) ** 2)
        count += 1
    return (policy + s["kl_beta"] * kl + s["ema_beta"] * ema) / count


def _run(params, rows, cond, old, ref, s):
    return awm.awm_loss(
        params,
        rows,
        awm.AWMSettings(
            linear_denoiser,
            kl_beta=s["kl_beta"],
            clip_range=s["clip"],
            weighting=s["weighting"],
            power=s["power"],
            off_policy=s["off_policy"],
            ema_beta=s["ema_beta"],
        ),
        LossInputs(
            make_flow_schedule(NUM_STEPS),
            cond,
            ref_params=ref if s["kl_beta"] else None,
            old_params=old,
        ),
    )


OFF_POLICY = dict(off_policy=True, weighting="t", power=0.25, clip=0.2, kl_beta=0.5, ema_beta=0.3)
ON_POLICY = dict(
    off_policy=False, weighting="ghuber", power=0.25, clip=1.0, kl_beta=0.0, ema_beta=1.0
)


@pytest.mark.parametrize("s", [OFF_POLICY, ON_POLICY], ids=["off_policy_t", "on_policy_ghuber"])
def test_the_loss_and_its_gradient_match_a_per_sample_reference(s):
    params, old, ref = _params(0), _params(1), _params(2)
    rows = _rows(3)
    cond = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 4)), jnp.float32)
    s = dict(s)
    # on-policy the old log-prob is the current one, held: the ratio is 1, the gradient
    # A * grad(logp) (checked below against finite differences of the reference)
    frozen = []
    for i in range(len(rows.mask)):
        t = float(rows.time[i])
        x0, eps = rows.x0[i].astype(np.float64), rows.noise[i].astype(np.float64)
        c = np.asarray(cond, np.float64)[rows.prompt[i]].mean()
        v = _velocity(_np(params), (1 - t) * x0 + t * eps, t, c)
        frozen.append(_log_prob(v, eps - x0, t, s["weighting"], s["power"]))
    s["frozen"] = frozen
    loss, metrics = _run(params, rows, cond, old, ref, s)
    expected = reference_loss(params, old, ref, rows, cond, s)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    assert int(metrics["rows"]) == 5  # the masked row is left out
    grad = jax.grad(lambda p: _run(p, rows, cond, old, ref, s)[0])(params)
    h = 1e-6
    for name in ("w", "b"):
        flat = np.asarray(params[name], np.float64).reshape(-1)
        numeric = np.zeros_like(flat)
        for j in range(flat.size):
            up, down = flat.copy(), flat.copy()
            up[j] += h
            down[j] -= h
            f = [
                reference_loss(
                    {**params, name: z.reshape(params[name].shape)}, old, ref, rows, cond, s
                )
                for z in (up, down)
            ]
            numeric[j] = (f[0] - f[1]) / (2 * h)
        np.testing.assert_allclose(
            np.asarray(grad[name]).reshape(-1), numeric, rtol=2e-3, atol=2e-5, err_msg=name
        )


def _free_velocity(params, x, t, cond):
    return jnp.broadcast_to(params["v"], x.shape)


def test_a_winner_is_pulled_to_the_data_s_velocity_a_loser_pushed_and_zero_is_still():
    """On-policy, without KL terms: the gradient is A times the weighted matching error's
    gradient, towards v_data = eps - x0 for A > 0, away for A < 0, nothing at A = 0."""
    rng = np.random.default_rng(5)
    v0 = rng.normal(size=(1, *SHAPE)).astype(np.float32)

    def gradient(a, weighting):
        rows = awm.AWMRows(
            x0=rng.normal(size=(1, *SHAPE)).astype(np.float32),
            noise=rng.normal(size=(1, *SHAPE)).astype(np.float32),
            time=np.array([0.6], np.float32),
            prompt=np.zeros(1, np.int32),
            advantage=np.array([a], np.float32),
            mask=np.ones(1, bool),
        )
        loss = lambda p: awm.awm_loss(  # noqa: E731
            p,
            rows,
            awm.AWMSettings(_free_velocity, weighting=weighting),
            LossInputs(make_flow_schedule(NUM_STEPS), jnp.zeros((1, 1, 1)), old_params={"v": v0}),
        )[0]
        g = np.asarray(jax.grad(loss)({"v": jnp.asarray(v0)})["v"])
        return g, rows.noise - rows.x0

    for weighting in awm.WEIGHTINGS:
        winner, v_data = gradient(0.8, weighting)
        assert float(np.sum(-winner * (v_data - v0))) > 0, weighting
        loser, v_data = gradient(-0.8, weighting)
        assert float(np.sum(-loser * (v_data - v0))) < 0, weighting
        still, _ = gradient(0.0, weighting)
        np.testing.assert_allclose(still, 0.0, atol=1e-7)


def test_advantages_by_hand():
    rewards = np.array([[1.0, 2.0, 3.0], [10.0, 10.0, 40.0]])
    std = np.sqrt(np.mean((rewards - rewards.mean()) ** 2))  # the batch's, population
    raw = np.array([[-1.0, 0.0, 1.0], [-10.0, -10.0, 20.0]]) / (std + 1e-4)
    expected = np.clip(raw, -0.5, 0.5) / 0.5 * 1.0
    np.testing.assert_allclose(
        awm.scaled_advantages(rewards, clip=0.5, advantage_max=1.0), expected
    )
    assert std > 5 and np.abs(raw).min() < 0.5 < np.abs(raw).max()  # both clipped and not


def test_the_time_samplers_follow_the_released_strata():
    sigmas = np.asarray(make_flow_schedule(14, shift=3.0).sigmas)
    rng = np.random.default_rng(0)
    # discrete_wo_init, 6 of int(14 * 0.9) = 12: steps one per stratum of [1, 12)
    t = forward.sample_times("discrete_wo_init", rng, 200, 6, sigmas, 0.9, 3.0)
    steps = np.array([[int(np.argmin(np.abs(sigmas - x))) for x in row] for row in t])
    bounds = np.floor(np.linspace(1, 12, 7))
    for j in range(6):
        assert (
            (steps[:, j] >= bounds[j]) & (steps[:, j] < max(bounds[j + 1], bounds[j] + 1))
        ).all()
    assert len(np.unique(steps)) == 11  # every step of [1, 12) drawn somewhere, none other
    t = forward.sample_times("discrete_with_init", rng, 50, 6, sigmas, 0.9, 3.0)
    np.testing.assert_array_equal(t[:, 0], sigmas[0])
    # uniform: one draw per fifth of [0.2, 1], shifted by 3
    t = forward.sample_times("uniform", rng, 100, 5, sigmas, 0.9, 3.0)
    u = (t / (3 - 2 * t) - 0.2) / 0.8  # the shift's inverse, back to [0, 1]
    np.testing.assert_array_equal(np.sort(np.floor(u * 5), axis=1), np.tile(np.arange(5), (100, 1)))
    t = forward.sample_times("logit_normal", rng, 100, 6, sigmas, 0.9, 3.0)
    assert t.min() >= forward.MIN_TIME and t.max() < 1
    # stratified: each sample's six times fall one in each sixth of the normal's mass
    z = np.log((t / (3 - 2 * t)) / (1 - t / (3 - 2 * t)))  # unshift, logit
    from scipy.stats import norm

    np.testing.assert_array_equal(
        np.sort(np.floor(norm.cdf(z) * 6), axis=1), np.tile(np.arange(6), (100, 1))
    )


@pytest.mark.slow
def test_a_tiny_run_raises_its_reward(tmp_path):
    """The shipped flow twin on JPEG compressibility, which it starts far from: four
    iterations of AWM (configs/tiny_flow_awm.py) make its fixed eval samples smaller files."""
    from configs import tiny_flow_awm
    from tree_grpo_jax.run import loop as train

    c = tiny_flow_awm.get_config()
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.tree.group_size = 8
    c.prompts.eval_count = 20
    c.train.iterations = 4
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    summary = train.train(c, str(tmp_path))
    first, last = summary["first_eval_reward"], summary["last_eval_reward"]
    # measured: -0.3932 -> -0.3891; the eval noise is fixed, so before and after compare
    # the same 20 samples
    assert last > first + 0.002, (first, last)
