"""DGPO's group preference loss against a per-sample float64 numpy version written from the
release's formula, its gradient's sign and its neutral point, its credit and its rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.core.sampling import make_flow_schedule
from tree_grpo_jax.methods import dgpo

SHAPE = (3, 2)
NUM_STEPS = 10
GROUP = 3


def linear_denoiser(params, x, t, cond):
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(scale * rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(scale * rng.normal(size=SHAPE), jnp.float32),
    }


def _rows(seed, rows=4, prompts=2):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, GROUP), bool)
    mask[-1] = False  # a masked row
    mask[0, 2] = False  # and a masked sample in a live one
    return dgpo.DGPORows(
        x0=rng.normal(size=(rows, GROUP, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, GROUP, *SHAPE)).astype(np.float32),
        step=rng.integers(0, 5, size=rows).astype(np.int32),
        prompt=rng.integers(0, prompts, size=rows).astype(np.int32),
        advantage=rng.normal(size=(rows, GROUP)).astype(np.float32),
        mask=mask,
    )


def _np(p):
    return {k: np.asarray(v, np.float64) for k, v in p.items()}


def reference(params, old, init, rows, cond, schedule, s):
    """compute_group_dgpo_loss_allreduce and the release's clip and KL, one sample at a
    time in float64: the loss and its gradient's coefficients d(loss)/d(dsm_i)."""
    sigmas = np.asarray(schedule.sigmas, np.float64)
    p, po, pi = _np(params), _np(old), _np(init)
    cond = np.asarray(cond, np.float64)
    total, kl, count = 0.0, 0.0, int(rows.mask.sum())
    for r in range(len(rows.step)):
        sigma = sigmas[rows.step[r]]
        c = cond[rows.prompt[r]].mean()
        terms = []
        for g in range(GROUP):
            if not rows.mask[r, g]:
                continue
            x0, eps = rows.x0[r, g].astype(np.float64), rows.noise[r, g].astype(np.float64)
            xt = (1 - sigma) * x0 + sigma * eps
            target = eps - x0

            v, v_old, v_init = (xt @ q["w"] + sigma * q["b"] + c for q in (p, po, pi))
            dsm, dsm_old, dsm_init = (np.mean((target - u) ** 2) for u in (v, v_old, v_init))
            ref = dsm_old if s["reference"] == "ema" else dsm_init
            a = float(rows.advantage[r, g])
            terms.append((a, dsm, ref, np.mean((v - v_init) ** 2)))
        group_sum = sum(a * s["beta_dpo"] * (d - ref) / s["group_size"] for a, d, ref, _ in terms)
        weight = 1 / (1 + np.exp(-group_sum))
        for a, d, _, k in terms:
            total += weight * a * d
            kl += k
    return (total + s["kl_beta"] * kl) / count


SETTINGS = [
    dict(beta_dpo=100.0, group_size=16, reference="initial", kl_beta=0.02, clip=False),
    dict(beta_dpo=7.0, group_size=GROUP, reference="ema", kl_beta=0.0, clip=False),
]


def _loss(params, rows, cond, old, init, s, clip_range=1e-2):
    return dgpo.dgpo_loss(
        params,
        rows,
        dgpo.DGPOSettings(
            linear_denoiser,
            kl_beta=s["kl_beta"],
            beta_dpo=s["beta_dpo"],
            group_size=s["group_size"],
            reference=s["reference"],
            clip_dsm=s["clip"],
            clip_range=clip_range,
        ),
        LossInputs(
            make_flow_schedule(NUM_STEPS, shift=3.0),
            cond,
            ref_params=init if (s["reference"] == "initial" or s["kl_beta"]) else None,
            old_params=old,
        ),
    )


@pytest.mark.parametrize("s", SETTINGS, ids=["initial_reference_kl", "ema_reference"])
def test_the_loss_matches_a_per_sample_reference(s):
    params, old, init = _params(0, 0.3), _params(1, 0.3), _params(2, 0.3)
    rows = _rows(3)
    cond = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 4)), jnp.float32)
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    loss, metrics = _loss(params, rows, cond, old, init, s)
    expected = reference(params, old, init, rows, cond, schedule, s)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    assert int(metrics["trained_edges"]) == 3 * GROUP - 1 and int(metrics["rows"]) == 3
    # the group weights are neither 0, 1/2 nor 1: the preference term matters here
    assert 0.05 < float(metrics["group_weight"]) < 0.95
    assert abs(float(metrics["group_weight"]) - 0.5) > 1e-3


def _one_group(a, seed=5):
    rng = np.random.default_rng(seed)
    return dgpo.DGPORows(
        x0=rng.normal(size=(1, GROUP, *SHAPE)).astype(np.float32),
        noise=np.broadcast_to(rng.normal(size=(1, 1, *SHAPE)), (1, GROUP, *SHAPE)).astype(
            np.float32
        ),
        step=np.array([2], np.int32),
        prompt=np.zeros(1, np.int32),
        advantage=np.asarray([a], np.float32),
        mask=np.ones((1, GROUP), bool),
    )


def _free_velocity(params, x, t, cond):
    return jnp.broadcast_to(params["v"], x.shape)


def test_winners_are_pulled_losers_pushed_and_the_reference_weighs_one_half():
    """At the reference (dsm = ref), every group's sigmoid is 1/2: the gradient is
    A_i / 2 * grad(dsm_i) / n, towards each winner's data velocity, away from each loser's;
    A = 0 does not move."""
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    v0 = np.random.default_rng(6).normal(size=(GROUP, *SHAPE)).astype(np.float32)
    s = dict(beta_dpo=100.0, group_size=GROUP, reference="ema", kl_beta=0.0, clip=True)
    a = [1.0, -1.0, 0.0]
    rows = _one_group(a)

    def per_sample_velocity(params, x, t, cond):
        return jnp.broadcast_to(params["v"], x.shape)

    p = {"v": jnp.asarray(v0)}
    loss = lambda q: dgpo.dgpo_loss(  # noqa: E731
        q,
        rows,
        dgpo.DGPOSettings(
            per_sample_velocity,
            beta_dpo=s["beta_dpo"],
            group_size=GROUP,
            reference="ema",
            clip_dsm=True,
        ),
        LossInputs(schedule, jnp.zeros((1, 1, 1)), old_params=p),
    )
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(p)
    assert float(metrics["group_weight"]) == pytest.approx(0.5)
    assert float(metrics["clip_fraction"]) == 0.0  # ratio 1: inside the clip
    g = np.asarray(grad["v"])
    v_data = rows.noise[0] - rows.x0[0]
    # d/dv of 1/2 * A_i * mean((v_data - v)^2) / GROUP
    expected = np.stack(
        [0.5 * a[i] * -2 * (v_data[i] - v0[i]) / v0[i].size / GROUP for i in range(3)]
    )
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    assert float(np.sum(-g[0] * (v_data[0] - v0[0]))) > 0  # the winner towards its data
    assert float(np.sum(-g[1] * (v_data[1] - v0[1]))) < 0  # the loser away
    np.testing.assert_array_equal(g[2], 0.0)


def test_the_clip_holds_a_sample_that_has_moved_too_far_its_way():
    """The EMA copy far better than the trained weights on the winner (ratio below 1 - c is
    not clipped for a winner) and far worse on the loser's side: only samples whose ratio
    left [1 - c, 1 + c] in their advantage's direction stop giving a gradient."""
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    rows = _one_group([1.0, -1.0, 1.0])
    v_data = rows.noise[0] - rows.x0[0]
    v = v_data + 0.5  # trained: dsm 0.25 each
    old = np.stack([v_data[0] + 1.0, v_data[1] + 1.0, v_data[2]])  # dsm 1, 1, 0
    p = {"v": jnp.asarray(v)}
    loss = lambda q: dgpo.dgpo_loss(  # noqa: E731
        q,
        rows,
        dgpo.DGPOSettings(
            _free_velocity, group_size=GROUP, reference="ema", clip_dsm=True, clip_range=0.1
        ),
        LossInputs(schedule, jnp.zeros((1, 1, 1)), old_params={"v": jnp.asarray(old)}),
    )
    (_, metrics), grad = jax.value_and_grad(loss, has_aux=True)(p)
    g = np.asarray(grad["v"])
    # ratio = exp(dsm_old - dsm): e^0.75 for the winner 0 (A > 0, above 1 + c: held),
    # e^0.75 for the loser 1 (A < 0: only below 1 - c holds), e^-0.25 for winner 2 (kept)
    np.testing.assert_array_equal(g[0], 0.0)
    assert np.abs(g[1]).sum() > 0 and np.abs(g[2]).sum() > 0
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3)


def release_velocity_gradient(v, v_ema, v_init, target, a, mask, s, clip_range):
    """The release's loss differentiated by hand in the trained velocity, one sample at a
    time in float64: the preference against the EMA copy (its sigmoid held), the DSM clip
    against it, and d/dv of beta * mean((v - v_init)^2) towards the initial model, every
    term over the batch's n real samples. Returns (dL/dv, the KL term's part)."""
    v, v_ema, v_init, target = (np.asarray(x, np.float64) for x in (v, v_ema, v_init, target))
    n, size = int(mask.sum()), v[0, 0].size
    grad, grad_kl = np.zeros_like(v), np.zeros_like(v)
    for r in range(v.shape[0]):
        dsm = [np.mean((target[r, g] - v[r, g]) ** 2) for g in range(v.shape[1])]
        old = [np.mean((target[r, g] - v_ema[r, g]) ** 2) for g in range(v.shape[1])]
        real = [g for g in range(v.shape[1]) if mask[r, g]]
        group_sum = sum(a[r, g] * s["beta_dpo"] * (dsm[g] - old[g]) for g in real)
        weight = 1 / (1 + np.exp(-group_sum / s["group_size"]))
        for g in real:
            ratio = np.exp(old[g] - dsm[g])
            held = ratio > 1 + clip_range if a[r, g] > 0 else ratio < 1 - clip_range
            if not held:
                grad[r, g] = weight * a[r, g] * -2 * (target[r, g] - v[r, g]) / size / n
            grad_kl[r, g] = s["kl_beta"] * 2 * (v[r, g] - v_init[r, g]) / size / n
    return grad + grad_kl, grad_kl


def test_the_kl_pulls_towards_the_initial_model_with_the_ema_copy_as_reference():
    """`dgpo.reference=ema` with `train.kl_beta` > 0 (the setting whose runs fell): the
    gradient in the trained velocity is the release's, its KL part points from the trained
    velocity to the initial model's (not to the EMA copy's), and the clip and the
    preference act against the EMA copy alone."""
    rng = np.random.default_rng(11)
    rows, groups = 2, GROUP
    batch = dgpo.DGPORows(
        x0=rng.normal(size=(rows, groups, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, groups, *SHAPE)).astype(np.float32),
        step=np.array([1, 3], np.int32),
        prompt=np.zeros(rows, np.int32),
        advantage=np.array([[1.2, -0.4, -0.8], [0.5, -1.5, 1.0]], np.float32),
        mask=np.array([[True, True, True], [True, True, False]]),
    )
    target = batch.noise - batch.x0
    v = target + rng.normal(scale=0.3, size=target.shape).astype(np.float32)
    v_ema = v + rng.normal(scale=0.05, size=target.shape).astype(np.float32)
    v_ema[0, 0] = v[0, 0] + 0.6  # the winner has moved far its way since the EMA copy: held
    v_init = v + rng.normal(scale=0.5, size=target.shape).astype(np.float32)
    s = dict(beta_dpo=100.0, group_size=16, kl_beta=0.02)

    def stored_velocity(params, x, t, cond):  # each sample's velocity is a parameter
        return params["v"].reshape(x.shape)

    def loss(params, kl_beta):
        return dgpo.dgpo_loss(
            params,
            batch,
            dgpo.DGPOSettings(
                stored_velocity,
                kl_beta=kl_beta,
                beta_dpo=s["beta_dpo"],
                group_size=s["group_size"],
                reference="ema",
                clip_dsm=True,
                clip_range=1e-2,
            ),
            LossInputs(
                make_flow_schedule(NUM_STEPS, shift=3.0),
                jnp.zeros((1, 1, 1)),
                ref_params={"v": jnp.asarray(v_init)},
                old_params={"v": jnp.asarray(v_ema)},
            ),
        )

    p = {"v": jnp.asarray(v)}
    (_, metrics), grad = jax.value_and_grad(lambda q: loss(q, s["kl_beta"]), has_aux=True)(p)
    grad_no_kl = jax.grad(lambda q: loss(q, 0.0)[0])(p)
    expected, expected_kl = release_velocity_gradient(
        v, v_ema, v_init, target, batch.advantage, batch.mask, s, 1e-2
    )
    g = np.asarray(grad["v"], np.float64)
    g_kl = g - np.asarray(grad_no_kl["v"], np.float64)
    np.testing.assert_allclose(g, expected, rtol=2e-4, atol=1e-8)
    np.testing.assert_allclose(g_kl, expected_kl, rtol=2e-3, atol=1e-9)
    # a descent step on the KL part moves each real velocity towards the initial model's
    real = batch.mask
    toward_init = np.sum(-g_kl[real] * (v_init - v)[real], axis=tuple(range(1, g_kl.ndim - 1)))
    assert np.all(toward_init > 0)
    assert np.sum(np.abs(g_kl[~real])) == 0.0
    # the KL metric is the mean squared gap to the initial model's velocity
    kl = np.mean(((v - v_init).astype(np.float64) ** 2)[real].reshape(int(real.sum()), -1), 1)
    assert float(metrics["kl"]) == pytest.approx(kl.mean(), rel=1e-5)
    # the held winner gives only its KL gradient; the clip reads the EMA copy alone
    np.testing.assert_allclose(g[0, 0], expected_kl[0, 0], rtol=2e-3, atol=1e-9)
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / real.sum())
    assert 0.05 < float(metrics["group_weight"]) < 0.95


def test_advantages_by_hand_with_the_prompt_s_std_or_the_batch_s():
    rewards = np.array([[1.0, 2.0, 3.0], [10.0, 10.0, 16.0]])
    per_prompt = dgpo.advantages(rewards, global_std=False)
    np.testing.assert_allclose(per_prompt[0], np.array([-1, 0, 1]) / (np.sqrt(2 / 3) + 1e-4))
    np.testing.assert_allclose(per_prompt[1], np.array([-2, -2, 4]) / (np.sqrt(8) + 1e-4))
    std = np.sqrt(np.mean((rewards - rewards.mean()) ** 2))
    np.testing.assert_allclose(
        dgpo.advantages(rewards, global_std=True)[1], np.array([-2, -2, 4]) / (std + 1e-4)
    )
    np.testing.assert_array_equal(dgpo.advantages(np.full((2, 3), 0.3), False), 0.0)


@pytest.mark.parametrize("shared", [True, False])
def test_rows_hold_each_group_at_distinct_early_steps(shared):
    leaves = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    adv = np.arange(6, dtype=np.float32).reshape(2, 3)
    rows = dgpo.gather_rows(
        leaves, adv, jax.random.PRNGKey(0), steps=5, per_group=4, shared_noise=shared
    )
    assert rows.num_rows == 2 * 4 and rows.num_edges == 2 * 4 * 3
    for p in range(2):
        steps = rows.step[p * 4 : (p + 1) * 4]
        assert len(set(steps)) == 4 and set(steps) <= set(range(5))
        np.testing.assert_array_equal(rows.x0[p * 4], leaves[p])
        np.testing.assert_array_equal(rows.advantage[p * 4], adv[p])
    np.testing.assert_array_equal(rows.prompt, np.repeat([0, 1], 4))
    same = np.all(rows.noise[:, :1] == rows.noise, axis=(1, 2)).all()
    assert same == shared


@pytest.mark.slow
def test_a_tiny_run_raises_its_reward(tmp_path):
    """The shipped flow twin on JPEG compressibility: four iterations of DGPO
    (configs/tiny_flow_dgpo.py) make its fixed eval samples smaller files."""
    from configs import tiny_flow_dgpo
    from tree_grpo_jax.run import loop as train

    c = tiny_flow_dgpo.get_config()
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
    assert last > first + 0.002, (first, last)


def test_the_initial_model_is_kept_as_reference_without_a_kl_term(tmp_path):
    """`dgpo.reference=initial` at `train.kl_beta=0` (the release's compressibility setting,
    configs/sd35m_dgpo_jpeg.py): the run keeps a copy of the initial weights for the
    preference alone, trains on it, and keeps none with the EMA copy as reference."""
    from configs import tiny_flow_dgpo
    from tree_grpo_jax.run import loop as train

    c = tiny_flow_dgpo.get_config()
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.tree.group_size = 4
    c.train.kl_beta = 0.0
    c.dgpo.reference = "initial"
    c.log.progress = False
    c.log.tensorboard = False
    trainer, state = train.setup(c, str(tmp_path / "initial"))
    assert trainer.ref_params is not None
    for kept, initial in zip(
        jax.tree_util.tree_leaves(trainer.ref_params),
        jax.tree_util.tree_leaves(state.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(initial))
    state, metrics = trainer.iteration(state, 0)
    assert np.isfinite(metrics["loss"]) and metrics["trained_edges"] > 0
    moved = [
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(trainer.ref_params)
        )
    ]
    assert max(moved) > 0  # the weights moved; the reference did not
    c.dgpo.reference = "ema"
    ema_trainer, _ = train.setup(c, str(tmp_path / "ema"))
    assert ema_trainer.ref_params is None
