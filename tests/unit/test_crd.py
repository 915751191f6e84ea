"""CRD's centred reward-matching loss against a per-group float64 numpy version written from
the paper's formula and the release's weights, centrings and KL, its gradient where the
trained weights equal the old copy, the old copy's decay, its rows, its run check and one
training iteration of the tiny flow twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.core.sampling import make_flow_schedule
from tree_grpo_jax.methods import crd, forward

SHAPE = (3, 2)
NUM_STEPS = 10
GROUP = 4


def linear_denoiser(params, x, t, cond):
    out = jnp.einsum("bij,jk->bik", x, params["w"]) + t[:, None, None] / 1000.0 * params["b"]
    return out + cond.mean(axis=(1, 2))[:, None, None]


def _params(seed, scale=0.3):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(scale * rng.normal(size=(2, 2)), jnp.float32),
        "b": jnp.asarray(scale * rng.normal(size=SHAPE), jnp.float32),
    }


def _rows(seed, rows=3, prompts=2):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, GROUP), bool)
    mask[-1] = False  # a padded group
    mask[0, 3] = False  # and a padded sample in a real one
    return crd.CRDRows(
        x0=rng.normal(size=(rows, GROUP, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(rows, GROUP, *SHAPE)).astype(np.float32),
        time=rng.uniform(0.1, 0.9, size=rows).astype(np.float32),
        prompt=rng.integers(0, prompts, size=rows).astype(np.int32),
        optimality=rng.uniform(0.0, 1.0, size=(rows, GROUP)).astype(np.float32),
        mask=mask,
    )


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _weights(a, temperature, sign):
    if temperature < 0:
        return np.full(len(a), 1.0 / len(a))
    if temperature == 0:
        chosen = sign * a > 0
        if not chosen.any():
            return np.full(len(a), 1.0 / len(a))
        p = np.zeros(len(a))
        p[chosen] = _softmax(a[chosen])
        return p
    return _softmax(sign * a / temperature)


def reference(params, old, init, rows, cond, s, timestep_scale, uncond=None, scale=1.0):
    """CRD's loss one group at a time in float64, from the formula: the implicit reward
    r_i = -mean(err_i / w_i - err_old_i / w_old_i), both it and the normalised reward
    centred over the group, (beta Rr - Ra)^2 or the BCE, times clip / beta, plus the
    (reward-weighted) KL to the (guided) initial model."""
    p, po, pi = ({k: np.asarray(v, np.float64) for k, v in q.items()} for q in (params, old, init))
    cond = np.asarray(cond, np.float64)
    terms, kls = [], []
    for r in range(len(rows.time)):
        real = np.flatnonzero(rows.mask[r])
        if not len(real):
            continue
        sigma = float(rows.time[r])
        t = sigma * timestep_scale
        c = cond[rows.prompt[r]].mean()
        rewards, kl_terms = [], []
        for g in real:
            x0, eps = rows.x0[r, g].astype(np.float64), rows.noise[r, g].astype(np.float64)
            xt = (1 - sigma) * x0 + sigma * eps
            u = eps - x0

            def vel(q, cc, xt=xt, t=t):
                return xt @ q["w"] + t / 1000.0 * q["b"] + cc

            v = vel(p, c)
            v_old = vel(po if s["use_old"] else pi, c)
            w = max(np.mean(np.abs(v - u)), 1e-5) if s["adaptive"] else 1.0
            w_old = max(np.mean(np.abs(v_old - u)), 1e-5) if s["adaptive"] else 1.0
            rewards.append(-np.mean((v - u) ** 2 / w - (v_old - u) ** 2 / w_old))
            if uncond is not None and s["kl_cfg"] > 1:
                cu = float(np.asarray(uncond, np.float64).mean())
                v_ref = vel(pi, cu) + s["kl_cfg"] * (vel(pi, c) - vel(pi, cu))
            else:
                v_ref = vel(pi, c)
            kl_terms.append(np.mean((v - v_ref) ** 2))
        rr = np.asarray(rewards)
        a = rows.optimality[r, real].astype(np.float64)
        signs = [1.0] if s["temp"] < 0 else [1.0, -1.0]
        per = np.zeros(len(real))
        for sign in signs:
            wts = _weights(a, s["temp"], sign)
            ra, rc = a - wts @ a, rr - wts @ rr
            x = s["beta"] * rc
            if s["loss_type"] == "mse":
                per += (x - ra) ** 2 / len(signs)
            else:
                y = 1 / (1 + np.exp(-ra))
                per += (np.logaddexp(0, x) - x * y) / len(signs)
        terms.extend(per)
        k = np.asarray(kl_terms)
        if s["adaptive_kl"]:
            m = 1e-4 / s["kl_beta"]
            k = (m + a * (1 - m)) * k
        kls.extend(k)
    policy = np.mean(terms) * s["clip"] / s["beta"]
    return policy + s["kl_beta"] * np.mean(kls), policy


BASE = dict(
    beta=1.0,
    loss_type="mse",
    use_old=True,
    adaptive=True,
    temp=-1.0,
    kl_cfg=4.5,
    adaptive_kl=True,
    kl_beta=0.1,
    clip=5.0,
)
SETTINGS = {
    "release_default": BASE,
    "bce_softmax_initial": {
        **BASE,
        "loss_type": "bce",
        "temp": 0.5,
        "use_old": False,
        "adaptive": False,
        "adaptive_kl": False,
        "kl_beta": 0.02,
        "beta": 3.0,
    },
    "hard_centring_guided_kl": {**BASE, "temp": 0.0, "beta": 2.0, "adaptive_kl": False},
}


def _settings(s, denoise_fn=linear_denoiser):
    return crd.CRDSettings(
        denoise_fn,
        kl_beta=s["kl_beta"],
        beta=s["beta"],
        loss_type=s["loss_type"],
        use_old_for_loss=s["use_old"],
        adaptive_logp=s["adaptive"],
        weight_temp=s["temp"],
        kl_cfg=s["kl_cfg"],
        reward_adaptive_kl=s["adaptive_kl"],
        advantage_clip=s["clip"],
    )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_loss_matches_a_per_group_reference(name):
    s = SETTINGS[name]
    params, old, init = _params(0), _params(1), _params(2)
    rows = _rows(3)
    if name == "hard_centring_guided_kl":  # some members below 0 for the mirrored pool
        rows = rows.replace(optimality=rows.optimality - np.float32(0.5))
    rng = np.random.default_rng(4)
    cond = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    uncond = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32) if "guided" in name else None
    schedule = make_flow_schedule(NUM_STEPS, shift=3.0)
    loss, metrics = crd.crd_loss(
        params,
        rows,
        _settings(s),
        LossInputs(schedule, cond, uncond=uncond, ref_params=init, old_params=old),
    )
    expected, policy = reference(
        params, old, init, rows, cond, s, float(schedule.timestep_scale), uncond
    )
    np.testing.assert_allclose(float(loss), expected, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["policy_loss"]), policy, rtol=1e-4)
    assert int(metrics["trained_edges"]) == 2 * GROUP - 1 and int(metrics["rows"]) == 2
    assert float(metrics["kl"]) > 0


def _free_velocity(params, x, t, cond):
    return jnp.broadcast_to(params["v"], x.shape)


@pytest.mark.parametrize("adaptive", [False, True])
def test_where_the_trained_weights_are_the_old_copy_rewards_above_the_mean_pull(adaptive):
    """v = v_old: every implicit reward is 0, so the mse gradient on sample i is
    c / N * 2 * (-Ra_i) * beta * grad r_i = 4 c Ra_i (v_i - u_i) / (N n w_i): a descent step
    moves samples rewarded above their group's mean towards their data velocity and the
    others away; a sample at the mean does not move."""
    rng = np.random.default_rng(5)
    opt = np.array([[0.9, 0.1, 0.5, 0.5]], np.float32)  # centred: 0.4, -0.4, 0, 0
    rows = crd.CRDRows(
        x0=rng.normal(size=(1, GROUP, *SHAPE)).astype(np.float32),
        noise=rng.normal(size=(1, GROUP, *SHAPE)).astype(np.float32),
        time=np.array([0.7], np.float32),
        prompt=np.zeros(1, np.int32),
        optimality=opt,
        mask=np.ones((1, GROUP), bool),
    )
    v0 = rng.normal(size=(GROUP, *SHAPE)).astype(np.float32)
    p = {"v": jnp.asarray(v0)}
    s = {**BASE, "adaptive": adaptive, "kl_beta": 0.0, "beta": 2.0}

    def loss(q):
        return crd.crd_loss(
            q,
            rows,
            _settings(s, _free_velocity),
            LossInputs(
                make_flow_schedule(NUM_STEPS, shift=3.0), jnp.zeros((1, 1, 1)), old_params=p
            ),
        )

    (_, metrics), grad = jax.value_and_grad(loss, has_aux=True)(p)
    assert float(metrics["implicit_reward"]) == pytest.approx(0.0, abs=1e-7)
    g = np.asarray(grad["v"], np.float64)
    u = (rows.noise[0] - rows.x0[0]).astype(np.float64)
    n = v0[0].size
    centred = opt[0] - opt[0].mean()
    w = np.abs(v0 - u).mean(axis=(1, 2)) if adaptive else np.ones(GROUP)
    expected = np.stack(
        [4 * 5.0 * centred[i] * (v0[i] - u[i]) / (GROUP * n * w[i]) for i in range(GROUP)]
    )
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    assert np.sum(-g[0] * (u[0] - v0[0])) > 0  # above the mean: towards its data
    assert np.sum(-g[1] * (u[1] - v0[1])) < 0  # below: away
    np.testing.assert_allclose(g[2:], 0.0, atol=1e-7)


def test_the_old_copy_s_decay_by_hand():
    """The release's "0-0.25-0.005-0.999" and "75-0.0-0.0075-0.999" schedules."""
    assert crd.old_decay(0, 0, 0.25, 0.005, 0.999) == 0.25
    assert crd.old_decay(2, 0, 0.25, 0.005, 0.999) == pytest.approx(0.26)
    assert crd.old_decay(1000, 0, 0.25, 0.005, 0.999) == 0.999
    assert crd.old_decay(74, 75, 0.0, 0.0075, 0.999) == 0.0
    assert crd.old_decay(95, 75, 0.0, 0.0075, 0.999) == pytest.approx(0.15)


def test_rows_hold_each_group_at_one_sigma_with_its_normalised_rewards():
    leaves = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    rewards = np.array([[1.0, 2.0, 6.0], [0.0, 0.0, 0.0]])
    opt = forward.optimality(forward.advantages(rewards), 5.0)
    # (r - prompt mean) / batch std / 10 + 1/2 by hand
    std = rewards.std()
    np.testing.assert_allclose(opt[0], (np.array([-2, -1, 3]) / (std + 1e-4)) / 10 + 0.5)
    np.testing.assert_allclose(opt[1], 0.5)
    times = np.array([[0.3, 0.8], [0.5, 0.9]])
    rows = crd.gather_rows(leaves, opt, times, jax.random.PRNGKey(0))
    assert rows.num_rows == 4 and rows.num_edges == 12
    np.testing.assert_array_equal(rows.x0[1], leaves[0])
    np.testing.assert_allclose(rows.optimality[3], opt[1])
    np.testing.assert_allclose(rows.time, times.reshape(-1))
    np.testing.assert_array_equal(rows.prompt, [0, 0, 1, 1])
    assert not np.allclose(rows.noise[0, 0], rows.noise[0, 1])  # each sample its own noise


def test_one_iteration_of_the_tiny_flow_twin_trains_and_moves_the_old_copy(tmp_path):
    """`tree.method=crd` through the in-process runner, unguided with the KL's reference
    guided (the release's setting): the loss alone gets the empty prompt's embedding; one
    iteration gives a finite loss, moves the weights and moves the old copy (d = 0.255
    after one step) towards them."""
    from configs import tiny_flow
    from tree_grpo_jax.run import loop as train

    c = tiny_flow.get_config()
    c.tree.method = "crd"
    c.tree.group_size = 4
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.eval.every = 0
    c.crd.train_timesteps = 1
    c.train.kl_beta = 0.1
    c.train.updates_per_iteration = 1
    c.log.progress = False
    c.log.tensorboard = False
    trainer, state = train.setup(c, str(tmp_path))
    assert trainer.uncond is None and trainer.loss_uncond is not None
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]
    state, metrics = trainer.iteration(state, 0)
    assert np.isfinite(metrics["loss"]) and metrics["trained_edges"] > 0
    assert metrics["old_decay"] == pytest.approx(0.255)
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]
    old = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.old_params)]
    assert max(np.abs(a - b).max() for a, b in zip(after, before, strict=True)) > 0
    for o, a, b in zip(old, after, before, strict=True):
        np.testing.assert_allclose(o, 0.255 * b + 0.745 * a, rtol=1e-5, atol=1e-6)
