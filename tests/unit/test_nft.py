"""DiffusionNFT's objective against a per-sample numpy reference, its gradient on a toy
problem whose optimum is known, its credit and its old policy's schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.core.sampling import make_flow_schedule
from tree_grpo_jax.methods import forward, nft

SHAPE = (3, 2)  # a sample's entries
NUM_STEPS = 5


def linear_denoiser(params, x, t, cond):
    """v = x @ W + t * b + cond's mean: a model whose velocity depends on every input."""
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=SHAPE), jnp.float32),
    }


def _rows(seed: int, rows: int = 6, prompts: int = 2) -> nft.NFTRows:
    rng = np.random.default_rng(seed)
    return nft.NFTRows(
        x0=rng.normal(size=(rows, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, *SHAPE)).astype(np.float32),
        step=rng.integers(0, NUM_STEPS, size=rows).astype(np.int32),
        prompt=rng.integers(0, prompts, size=rows).astype(np.int32),
        optimality=rng.uniform(size=rows).astype(np.float32),
        mask=np.array([True] * (rows - 1) + [False]),
    )


def reference_loss(params, old, ref, rows, schedule, cond, beta, clip, kl_beta):
    """The loss one row at a time in float64 numpy, from the method's formulas."""
    sigmas = np.asarray(schedule.sigmas, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    w_old = {k: np.asarray(v, np.float64) for k, v in old.items()}
    w_ref = {k: np.asarray(v, np.float64) for k, v in ref.items()}
    cond = np.asarray(cond, np.float64)

    def velocity(p, x, step, prompt):
        t = sigmas[step] * 1000.0
        return x @ p["w"] + t / 1000.0 * p["b"] + cond[prompt].mean()

    policy, kl, count = 0.0, 0.0, 0
    for i in range(len(rows.mask)):
        if not rows.mask[i]:
            continue
        s = sigmas[rows.step[i]]
        x0 = rows.x0[i].astype(np.float64)
        xt = (1 - s) * x0 + s * rows.noise[i]
        v = velocity(w, xt, rows.step[i], rows.prompt[i])
        v_old = velocity(w_old, xt, rows.step[i], rows.prompt[i])
        r = float(rows.optimality[i])
        terms = []
        for v_implicit in (beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v):
            error = (xt - s * v_implicit) - x0
            terms.append(np.mean(error**2) / max(np.mean(np.abs(error)), forward.WEIGHT_FLOOR))
        policy += clip / beta * (r * terms[0] + (1 - r) * terms[1])
        kl += np.mean((v - velocity(w_ref, xt, rows.step[i], rows.prompt[i])) ** 2)
        count += 1
    return policy / count + kl_beta * kl / count


@pytest.mark.parametrize("beta, kl_beta", [(1.0, 0.0), (0.1, 0.5)])
def test_the_loss_matches_a_per_sample_reference(beta, kl_beta):
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    params, old, ref = _params(0), _params(1), _params(2)
    rows = _rows(3)
    cond = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 4)), jnp.float32)
    loss, metrics = nft.nft_loss(
        params,
        rows,
        nft.NFTSettings(linear_denoiser, kl_beta=kl_beta, beta=beta, clip=5.0),
        LossInputs(schedule, cond, ref_params=ref if kl_beta else None, old_params=old),
    )
    expected = reference_loss(params, old, ref, rows, schedule, cond, beta, 5.0, kl_beta)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    assert int(metrics["rows"]) == 5  # the masked row is left out


def _one_row(r: float):
    rng = np.random.default_rng(7)
    return nft.NFTRows(
        x0=rng.normal(size=(1, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(1, *SHAPE)).astype(np.float32),
        step=np.array([2], np.int32),
        prompt=np.zeros(1, np.int32),
        optimality=np.array([r], np.float32),
        mask=np.ones(1, bool),
    )


def _free_velocity(params, x, t, cond):
    return jnp.broadcast_to(params["v"], x.shape)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_a_sure_winner_is_learned_at_the_known_optimum(beta):
    """With r = 1 the loss asks the positive policy to recover x0 exactly: its minimiser is
    v = v_old + (v_data - v_old) / beta, v_data = noise - x0 (the flow's own velocity)."""
    schedule = make_flow_schedule(NUM_STEPS)
    rows = _one_row(1.0)
    v_old = np.random.default_rng(8).normal(size=(1, *SHAPE)).astype(np.float32)
    v_data = rows.noise - rows.x0
    settings = nft.NFTSettings(_free_velocity, beta=beta)
    inputs = LossInputs(schedule, jnp.zeros((1, 1, 1)), old_params={"v": v_old})
    loss = jax.jit(lambda p: nft.nft_loss(p, rows, settings, inputs)[0])
    grad = jax.jit(jax.grad(loss))
    optimum = v_old + (v_data - v_old) / beta
    assert float(loss({"v": jnp.asarray(optimum)})) == pytest.approx(0.0, abs=1e-6)
    params = {"v": jnp.asarray(v_old)}
    # the first step points from the old velocity towards the data's
    assert float(jnp.sum(-grad(params)["v"] * (v_data - v_old))) > 0
    # descent (the adaptive weight makes the gradient's size about constant: a shrinking
    # step) ends at the optimum
    for i in range(2000):
        params = {"v": params["v"] - 0.05 * 0.997**i * grad(params)["v"]}
    np.testing.assert_allclose(np.asarray(params["v"]), optimum, atol=2e-3)


def test_a_sure_loser_pushes_away_and_the_mean_sample_does_not_move():
    schedule = make_flow_schedule(NUM_STEPS)
    v_old = np.random.default_rng(9).normal(size=(1, *SHAPE)).astype(np.float32)
    settings = nft.NFTSettings(_free_velocity, beta=1.0)
    inputs = LossInputs(schedule, jnp.zeros((1, 1, 1)), old_params={"v": v_old})

    def gradient(r):
        rows = _one_row(r)
        loss = lambda p: nft.nft_loss(p, rows, settings, inputs)[0]  # noqa: E731
        return np.asarray(jax.grad(loss)({"v": jnp.asarray(v_old)})["v"]), rows

    loser, rows = gradient(0.0)
    v_data = rows.noise - rows.x0
    assert float(np.sum(-loser * (v_data - v_old))) < 0  # away from the data's velocity
    winner, _ = gradient(1.0)
    np.testing.assert_allclose(loser, -winner, rtol=1e-5)
    middle, _ = gradient(0.5)  # r = 1/2: both policies pull equally, nothing moves
    np.testing.assert_allclose(middle, 0.0, atol=1e-6)


def test_advantages_centre_each_prompt_and_scale_by_the_batch():
    rewards = np.array([[1.0, 2.0, 3.0], [10.0, 10.0, 13.0]])
    a = forward.advantages(rewards)
    std = np.sqrt(np.mean((rewards - rewards.mean()) ** 2))
    np.testing.assert_allclose(a[0], np.array([-1.0, 0.0, 1.0]) / (std + 1e-4))
    np.testing.assert_allclose(a[1], np.array([-1.0, -1.0, 2.0]) / (std + 1e-4))
    np.testing.assert_array_equal(forward.advantages(np.full((2, 3), -3.7)), 0.0)  # r = 1/2
    r = forward.optimality(np.array([-7.0, -5.0, 0.0, 2.5, 9.0]), clip=5.0)
    np.testing.assert_allclose(r, [0.0, 0.0, 0.5, 0.75, 1.0])


def test_rows_hold_every_leaf_at_distinct_steps():
    leaves = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    r = np.linspace(0, 1, 6).reshape(2, 3)
    rows = nft.gather_rows(leaves, r, jax.random.PRNGKey(0), num_steps=10, per_sample=9)
    assert rows.num_rows == 2 * 3 * 9
    steps = rows.step.reshape(6, 9)
    assert all(len(set(s)) == 9 and set(s) <= set(range(10)) for s in steps)
    np.testing.assert_array_equal(
        rows.x0.reshape(6, 9, 4), np.repeat(leaves.reshape(6, 1, 4), 9, 1)
    )
    np.testing.assert_array_equal(rows.prompt, np.repeat([0, 1], 27))
    np.testing.assert_allclose(rows.optimality, np.repeat(r.reshape(-1), 9))
    assert np.unique(rows.noise).size == rows.noise.size  # every row its own noise
    assert nft.steps_per_sample(10, 0.99) == 9 and nft.steps_per_sample(3, 0.1) == 1


def test_the_old_policy_follows_the_released_schedules():
    # decay_type 1 (flat 0, 0.001 per step, up to 0.5) and 2 (flat 75, 0.0075, up to 0.999)
    assert forward.old_policy_decay(0, 0, 0.001, 0.5) == 0.0
    assert forward.old_policy_decay(100, 0, 0.001, 0.5) == pytest.approx(0.1)
    assert forward.old_policy_decay(5000, 0, 0.001, 0.5) == 0.5
    assert forward.old_policy_decay(74, 75, 0.0075, 0.999) == 0.0
    assert forward.old_policy_decay(175, 75, 0.0075, 0.999) == pytest.approx(0.75)
    assert forward.old_policy_decay(500, 75, 0.0075, 0.999) == 0.999
    old = {"w": jnp.full((2,), 2.0), "h": jnp.full((1,), 4.0, jnp.bfloat16)}
    new = {"w": jnp.zeros((2,)), "h": jnp.zeros((1,), jnp.bfloat16)}
    mixed = forward.mix_old_policy(old, new, jnp.float32(0.25))
    np.testing.assert_allclose(np.asarray(mixed["w"]), [0.5, 0.5])
    assert mixed["h"].dtype == jnp.bfloat16 and float(mixed["h"][0]) == 1.0


def test_a_model_that_is_not_a_flow_is_one_sentence(tmp_path):
    from configs import tiny
    from tree_grpo_jax import config as cfg
    from tree_grpo_jax.run import loop as train

    c = tiny.get_config()
    c.model.name = "random_tiny"  # DDIM: its denoiser predicts noise, not a velocity
    c.tree.method = "diffusion_nft"
    with pytest.raises(cfg.ConfigError, match="needs a rectified-flow model"):
        train.setup(c, str(tmp_path))


@pytest.mark.slow
def test_a_tiny_run_raises_its_reward(tmp_path):
    """The shipped flow twin on JPEG compressibility, which it starts far from: six
    iterations of DiffusionNFT make its fixed eval samples smaller files."""
    from configs import tiny_flow_nft
    from tree_grpo_jax.run import loop as train

    c = tiny_flow_nft.get_config()
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.tree.group_size = 8
    c.prompts.eval_count = 20
    c.train.iterations = 6
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    summary = train.train(c, str(tmp_path))
    first, last = summary["first_eval_reward"], summary["last_eval_reward"]
    # measured: -0.3932 -> -0.3863 (a file about 7 bytes smaller); the eval noise is fixed,
    # so before and after compare the same 20 samples
    assert last > first + 0.002, (first, last)
