"""Online Diffusion-DPO's pair loss against a per-pair float64 numpy version written from the
paper's formula with the release's -beta/2 scale, its gradient at the reference, its pairs,
its times and one training iteration of the tiny flow twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.core.sampling import make_flow_schedule
from tree_grpo_jax.methods import dpo

SHAPE = (3, 2)
NUM_STEPS = 10


def linear_denoiser(params, x, t, cond):
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed, scale=0.3):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(scale * rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(scale * rng.normal(size=SHAPE), jnp.float32),
    }


def _rows(seed, rows=4, prompts=2):
    rng = np.random.default_rng(seed)
    mask = np.ones(rows, bool)
    mask[-1] = False  # a padded pair
    return dpo.DPORows(
        x0=rng.normal(size=(rows, 2, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, *SHAPE)).astype(np.float32),
        time=rng.uniform(0.05, 0.95, size=rows).astype(np.float32),
        prompt=rng.integers(0, prompts, size=rows).astype(np.int32),
        mask=mask,
    )


def reference(params, init, rows, cond, beta, kl_beta, timestep_scale):
    """Diffusion-DPO's loss one pair at a time in float64: both arms noised at the pair's
    sigma with its noise, err = mean((eps - x0) - v)^2, -log sigmoid(-beta/2 * ((err_w -
    err_ref_w) - (err_l - err_ref_l))), plus kl_beta * mean |v - v_ref|^2."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    q = {k: np.asarray(v, np.float64) for k, v in init.items()}
    cond = np.asarray(cond, np.float64)
    losses, kls = [], []
    for r in np.flatnonzero(rows.mask):
        sigma = float(rows.time[r])
        t = sigma * timestep_scale
        c = cond[rows.prompt[r]].mean()
        eps = rows.noise[r].astype(np.float64)
        gaps, kl = [], 0.0
        for arm in range(2):
            x0 = rows.x0[r, arm].astype(np.float64)
            xt = (1 - sigma) * x0 + sigma * eps
            v = xt @ p["w"] + t / 1000.0 * p["b"] + c
            v_ref = xt @ q["w"] + t / 1000.0 * q["b"] + c
            gaps.append(np.mean((eps - x0 - v) ** 2) - np.mean((eps - x0 - v_ref) ** 2))
            kl += np.mean((v - v_ref) ** 2) / 2
        z = -beta / 2 * (gaps[0] - gaps[1])
        losses.append(np.logaddexp(0.0, -z))
        kls.append(kl)
    return np.mean(losses) + kl_beta * np.mean(kls), np.asarray(losses)


@pytest.mark.parametrize("beta, kl_beta", [(100.0, 0.0), (20.0, 0.05)])
def test_the_loss_matches_a_per_pair_reference(beta, kl_beta):
    params, init = _params(0), _params(1)
    rows = _rows(2)
    cond = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 4)), jnp.float32)
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    settings = dpo.DPOSettings(linear_denoiser, kl_beta=kl_beta, beta=beta)
    loss, metrics = dpo.dpo_loss(
        params, rows, settings, LossInputs(schedule, cond, ref_params=init)
    )
    expected, per_pair = reference(
        params, init, rows, cond, beta, kl_beta, float(schedule.timestep_scale)
    )
    np.testing.assert_allclose(float(loss), expected, rtol=1e-4)
    # the pairs' losses differ and are not log 2: the preference term matters here
    assert np.ptp(per_pair) > 1e-3 and np.all(np.abs(per_pair - np.log(2)) > 1e-4)
    assert int(metrics["rows"]) == 3 and int(metrics["trained_edges"]) == 6


def _free_velocity(params, x, t, cond):
    return jnp.broadcast_to(params["v"], x.shape)


def test_at_the_reference_the_winner_is_pulled_and_the_loser_pushed():
    """At the initial weights z = 0: the gradient is beta / 4 * (grad err_w - grad err_l),
    so a step moves the winner's velocity towards its data velocity and the loser's away."""
    rng = np.random.default_rng(4)
    rows = dpo.DPORows(
        x0=rng.normal(size=(1, 2, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(1, *SHAPE)).astype(np.float32),
        time=np.array([0.6], np.float32),
        prompt=np.zeros(1, np.int32),
        mask=np.ones(1, bool),
    )
    v0 = rng.normal(size=(2, *SHAPE)).astype(np.float32)
    p = {"v": jnp.asarray(v0)}
    beta = 50.0

    def loss(q):
        return dpo.dpo_loss(
            q,
            rows,
            dpo.DPOSettings(_free_velocity, beta=beta),
            LossInputs(
                make_flow_schedule(NUM_STEPS, shift=3.0), jnp.zeros((1, 1, 1)), ref_params=p
            ),
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(p)
    assert float(value) == pytest.approx(np.log(2))
    g = np.asarray(grad["v"], np.float64)
    u = (rows.noise[0][None] - rows.x0[0]).astype(np.float64)  # data velocities [2, *S]
    n = v0[0].size
    expected = np.stack([beta / 4 * -2 * (u[0] - v0[0]) / n, -beta / 4 * -2 * (u[1] - v0[1]) / n])
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    assert np.sum(-g[0] * (u[0] - v0[0])) > 0  # a descent step: winner towards its data
    assert np.sum(-g[1] * (u[1] - v0[1])) < 0  # loser away from its own


def test_pairs_are_each_group_s_best_and_worst():
    rewards = np.array([[0.1, 0.9, 0.5], [3.0, 3.0, 3.0], [2.0, -1.0, 0.0]])
    np.testing.assert_array_equal(dpo.pair_indices(rewards), [[1, 0], [0, 0], [0, 1]])
    leaves = np.arange(3 * 3 * 2, dtype=np.float32).reshape(3, 3, 2)
    times = np.array([[0.2, 0.4], [0.5, 0.6], [0.7, 0.9]])
    rows = dpo.gather_rows(leaves, rewards, times, jax.random.PRNGKey(0))
    assert rows.num_rows == 6 and rows.x0.shape == (6, 2, 2) and rows.noise.shape == (6, 2)
    np.testing.assert_array_equal(rows.x0[0], leaves[0, [1, 0]])
    np.testing.assert_array_equal(rows.x0[1], leaves[0, [1, 0]])
    np.testing.assert_array_equal(rows.x0[5], leaves[2, [0, 1]])
    np.testing.assert_array_equal(rows.prompt, [0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(rows.time, times.reshape(-1))
    assert len({tuple(n) for n in rows.noise}) == 6  # every row its own noise


def test_times_follow_the_logit_normal_over_the_range():
    """sigma = 1 - 0.99 * sigmoid(n), n ~ N(0, 1): P(sigma < 1 - 0.99 sigmoid(1)) = P(n > 1);
    a shift s > 1 moves u up (sigma down)."""
    rng = np.random.default_rng(0)
    sigma = dpo.sample_times(rng, 40000, 0.99, 0.0, 1.0, 1.0)
    assert sigma.min() >= 1 - 0.99 * (1 - 1e-6) and sigma.max() <= 1 - 0.99 * 0.01
    threshold = 1 - 0.99 / (1 + np.exp(-1.0))
    assert np.mean(sigma < threshold) == pytest.approx(0.158655, abs=0.006)
    shifted = dpo.sample_times(np.random.default_rng(0), 40000, 0.99, 0.0, 1.0, 3.0)
    assert np.median(shifted) < np.median(sigma) - 0.1


def test_one_iteration_of_the_tiny_flow_twin_trains_against_the_initial_model(tmp_path):
    """`tree.method=dpo` through the in-process runner: the initial weights are kept as the
    reference, one iteration gives a finite loss and moves the weights, not the reference."""
    from configs import tiny_flow
    from tree_grpo_jax.run import loop as train

    c = tiny_flow.get_config()
    c.tree.method = "dpo"
    c.tree.group_size = 4
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.eval.every = 0
    c.train.kl_beta = 0.0
    c.train.updates_per_iteration = 1
    c.log.progress = False
    c.log.tensorboard = False
    trainer, state = train.setup(c, str(tmp_path))
    assert trainer.ref_params is not None
    state, metrics = trainer.iteration(state, 0)
    assert np.isfinite(metrics["loss"]) and metrics["trained_edges"] > 0
    assert "reward_margin" in metrics and "implicit_accuracy" in metrics
    moved = [
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(trainer.ref_params)
        )
    ]
    assert max(moved) > 0
