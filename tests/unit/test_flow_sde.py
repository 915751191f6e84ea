"""The released FLUX codes' flow SDE ("dancegrpo") beside Flow-GRPO's: its step against the
formulas in numpy and scipy densities, its draws' moments, split steps through the rollout,
one training iteration; and the default SDE unchanged, bit for bit."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from scipy import stats

from tree_grpo_jax import config as cfg
from tree_grpo_jax import rewards
from tree_grpo_jax.config import base_config
from tree_grpo_jax.core import sampling
from tree_grpo_jax.core import tree_spec as ts
from tree_grpo_jax.core.rollout import noise_by_step, rollout
from tree_grpo_jax.models.base import DDIMScheduleConfig, FlowScheduleConfig, Sampling
from tree_grpo_jax.run import loop as train

# Includes sigma = 1 (the first step) and a last step to 0, unevenly spaced.
SIGMAS = np.array([1.0, 0.93, 0.6, 0.25, 0.02, 0.0])
ETA = 0.3


def dancegrpo(score_correction=True, noise_level=ETA, sigmas=SIGMAS):
    return sampling.flow_schedule_from_sigmas(
        sigmas, noise_level, sde="dancegrpo", score_correction=score_correction
    )


def released_flux_step(x, v, sigmas, i, eta, sde_solver):
    """(mean, std) of step i as the released `flux_step` computes them, in float64."""
    sigma = sigmas[i]
    dsigma = sigmas[i + 1] - sigma
    mean = x + dsigma * v
    x0 = x - sigma * v
    std = max(eta * np.sqrt(sigma - sigmas[i + 1]), 1e-8)
    if sde_solver:
        score = -(x - x0 * (1 - sigma)) / sigma**2
        mean = mean + (-0.5 * eta**2 * score) * dsigma
    return mean, std


def _xv(seed, shape=(3, 2, 4, 4)):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(2, *shape)).astype(np.float32)


@pytest.mark.parametrize("score_correction", [True, False])
def test_mean_and_std_match_the_released_formulas(score_correction):
    schedule = dancegrpo(score_correction)
    x, v = _xv(0)
    for i in range(len(SIGMAS) - 1):
        mean, std = schedule.transition(i, x, v)
        want_mean, want_std = released_flux_step(
            x.astype(np.float64), v.astype(np.float64), SIGMAS, i, ETA, score_correction
        )
        np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(std, want_std, rtol=1e-6)
    # with the correction, the step is Flow-GRPO's mean with a constant sig_t = eta
    if score_correction:
        x64, v64 = x.astype(np.float64), v.astype(np.float64)
        s, ds = SIGMAS[2], SIGMAS[3] - SIGMAS[2]
        flow_grpo_form = (
            x64 * (1 + ETA**2 * ds / (2 * s)) + v64 * (1 + ETA**2 * (1 - s) / (2 * s)) * ds
        )
        np.testing.assert_allclose(schedule.transition(2, x, v).mean, flow_grpo_form, rtol=1e-5)


def test_std_is_clamped_below_at_1e_8():
    schedule = dancegrpo(noise_level=1e-12)
    _, std = schedule.transition(1, jnp.zeros(3), jnp.zeros(3))
    assert float(std) == np.float32(1e-8)


@pytest.mark.parametrize("score_correction", [True, False])
@pytest.mark.parametrize("noise_scale", [1.0, 4.0])
def test_log_prob_matches_scipy_averaged_over_dimensions(score_correction, noise_scale):
    schedule = dancegrpo(score_correction)
    x, v = _xv(1)
    noise = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
    for i in (0, 2, 4):
        out = sampling.sample_step(schedule, i, x, v, noise, event_ndim=3, noise_scale=noise_scale)
        mean, std = released_flux_step(
            x.astype(np.float64), v.astype(np.float64), SIGMAS, i, ETA, score_correction
        )
        np.testing.assert_allclose(out.sample, mean + noise_scale * std * noise, atol=1e-5)
        dense = stats.norm.logpdf(np.asarray(out.sample, np.float64), mean, noise_scale * std)
        np.testing.assert_allclose(out.log_prob, dense.mean(axis=(1, 2, 3)), rtol=1e-5)
        # a given action (not drawn here) scored the same way
        action = x + 0.1
        scored = sampling.score_step(schedule, i, x, v, action, event_ndim=3)
        dense = stats.norm.logpdf(action.astype(np.float64), mean, std)
        np.testing.assert_allclose(scored.log_prob, dense.mean(axis=(1, 2, 3)), rtol=1e-5)


@pytest.mark.parametrize("score_correction", [True, False])
def test_draws_have_the_stated_mean_and_std(score_correction):
    schedule = dancegrpo(score_correction)
    n, i = 200_000, 1
    x, v = np.float32([0.8, -1.2, 0.3]), np.float32([-0.5, 0.4, 1.5])
    noise = jax.random.normal(jax.random.PRNGKey(7), (n, 3))
    draws = np.asarray(sampling.sample_step(schedule, i, x, v, noise, event_ndim=1).sample)
    mean, std = released_flux_step(x.astype(np.float64), v, SIGMAS, i, ETA, score_correction)
    np.testing.assert_allclose(draws.mean(axis=0), mean, atol=5 * std / np.sqrt(n))
    np.testing.assert_allclose(draws.std(axis=0), std, rtol=0.01)


def _gaussian_data_step(schedule, sigmas, s0=0.6):
    """(variance after one SDE step, the variance the flow has at the next sigma) for data
    N(0, s0^2), whose exact velocity is linear in x."""

    def variance(sigma):
        return (1 - sigma) ** 2 * s0**2 + sigma**2

    sigma = sigmas[0]
    slope = (sigma - (1 - sigma) * s0**2) / variance(sigma)
    x = jnp.linspace(-1.0, 1.0, 5)
    mean, std = schedule.transition(0, x, slope * x)
    c = float(mean[-1] / x[-1])
    return c**2 * variance(sigma) + float(std) ** 2, variance(sigmas[1])


def test_score_correction_keeps_the_flow_marginals_and_euler_widens_them():
    sigmas = np.array([0.5, 0.499, 0.0])
    eta = 0.7
    got, want = _gaussian_data_step(dancegrpo(True, eta, sigmas), sigmas)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    got, want = _gaussian_data_step(dancegrpo(False, eta, sigmas), sigmas)
    np.testing.assert_allclose(got - want, eta**2 * 0.001, rtol=0.02)


def test_ode_step_is_euler_for_every_sde():
    x, v = _xv(3)
    for schedule in (dancegrpo(True), dancegrpo(False), sampling.flow_schedule_from_sigmas(SIGMAS)):
        for i in range(len(SIGMAS) - 1):
            step = schedule.deterministic_step(i, x, v)
            np.testing.assert_allclose(step, x + v * (SIGMAS[i + 1] - SIGMAS[i]), atol=1e-6)
            assert float(schedule.transition(i, x, v, stochastic=False).std) == 0.0
            default = sampling.flow_schedule_from_sigmas(SIGMAS).deterministic_step(i, x, v)
            np.testing.assert_array_equal(step, default)


# ---------------------------------------------------------------------------------------------
# The default SDE, against the Flow-GRPO schedule as it was before the option existed.


@struct.dataclass
class FlowGRPOBefore:
    sigmas: jax.Array
    dt: jax.Array
    sqrt_neg_dt: jax.Array
    unit_sig: jax.Array
    noise_level: jax.Array
    timestep_scale: float = struct.field(pytree_node=False, default=1000.0)

    @property
    def num_steps(self):
        return self.sigmas.shape[0] - 1

    @property
    def timesteps(self):
        return self.sigmas[:-1] * self.timestep_scale

    def transition(self, i, x, prediction, stochastic=True):
        x = x.astype(jnp.float32)
        v = prediction.astype(jnp.float32)
        sigma, dt = self.sigmas[i], self.dt[i]
        if not stochastic:
            return sampling.Transition(x + v * dt, jnp.zeros_like(dt))
        sig = self.noise_level * self.unit_sig[i]
        x_coef = 1.0 + sig**2 * dt / (2.0 * sigma)
        v_coef = (1.0 + sig**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
        return sampling.Transition(x * x_coef + v * v_coef, sig * self.sqrt_neg_dt[i])

    def deterministic_step(self, i, x, prediction):
        return self.transition(i, x, prediction, stochastic=False).mean


def flow_grpo_before(num_steps, shift, noise_level):
    sigmas = np.linspace(1.0, 0.0, num_steps + 1)
    sigmas = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    dt = sigmas[1:] - sigmas[:-1]
    current = sigmas[:-1]
    denominator = 1.0 - np.where(current >= 1.0, sigmas[1], current)
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float64), jnp.float32)  # noqa: E731
    return FlowGRPOBefore(
        sigmas=f32(sigmas),
        dt=f32(dt),
        sqrt_neg_dt=f32(np.sqrt(-dt)),
        unit_sig=f32(np.sqrt(current / denominator)),
        noise_level=jnp.asarray(noise_level, jnp.float32),
    )


SAMPLE_SHAPE = (1, 4, 4)
P = 2
PARAMS = {"a": jnp.float32(0.8), "b": jnp.float32(0.5)}
COND = jax.random.normal(jax.random.PRNGKey(11), (P, 3, 5))


def toy_denoiser(params, x, t, cond):
    c = cond.mean(axis=(1, 2)).reshape(-1, 1, 1, 1)
    return jnp.tanh(params["a"] * x) + params["b"] * c + 1e-3 * t.reshape(-1, 1, 1, 1)


def _rollout(schedule, spec, split_log_prob="sampled"):
    return rollout(
        toy_denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(3),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
        split_log_prob=split_log_prob,
    )


def test_default_flow_sde_is_unchanged_bit_for_bit():
    new, old = sampling.make_flow_schedule(6, shift=3.0), flow_grpo_before(6, 3.0, 0.7)
    assert new.sde == "flow_grpo"
    for name in ("sigmas", "dt", "sqrt_neg_dt", "unit_sig", "noise_level"):
        np.testing.assert_array_equal(getattr(new, name), getattr(old, name))
    x, v = _xv(4)
    rows = jnp.arange(3).reshape(3, 1, 1, 1) + 1  # one step per row, as the loss gathers
    for i in (0, 3, 5, rows):
        for stochastic in (True, False):
            for a, b in zip(
                new.transition(i, x, v, stochastic), old.transition(i, x, v, stochastic)
            ):
                np.testing.assert_array_equal(a, b)
    # the whole tree, through the compiled rollout
    spec = ts.branchgrpo(6, (0, 3), k=2, split_noise_scale=2.0)
    a, b = _rollout(new, spec), _rollout(old, spec)
    np.testing.assert_array_equal(a.leaves, b.leaves)
    for sa, sb in zip(a.segments, b.segments):
        np.testing.assert_array_equal(sa.children, sb.children)
        np.testing.assert_array_equal(sa.log_probs, sb.log_probs)


# ---------------------------------------------------------------------------------------------
# Split steps through the rollout.


@pytest.mark.parametrize("split_log_prob", ["sampled", "unscaled"])
def test_split_steps_widen_the_std_and_are_scored_by_the_convention(split_log_prob):
    sigmas = np.linspace(1.0, 0.0, 5) ** 1.5
    schedule = dancegrpo(True, sigmas=sigmas)
    spec = ts.branchgrpo(4, (0, 2), k=2, split_noise_scale=4.0)
    tree = _rollout(schedule, spec, split_log_prob)
    _, noise_of_step = noise_by_step(jax.random.PRNGKey(3), spec, P, SAMPLE_SHAPE)
    splits_seen = 0
    for seg in tree.segments:
        for t, i in enumerate(seg.step_indices):
            parents = np.asarray(seg.parents[t], np.float64)  # [P, n, *S]
            n = parents.shape[1]
            flat = parents.reshape(P * n, *SAMPLE_SHAPE)
            time = np.full((P * n,), float(schedule.timesteps[i]))
            v = toy_denoiser(PARAMS, jnp.float32(flat), time, jnp.repeat(COND, n, axis=0))
            v = np.asarray(v, np.float64).reshape(parents.shape)
            mean, std = released_flux_step(parents, v, sigmas, i, ETA, True)
            split = i in (0, 2)
            splits_seen += split
            scale = 4.0 if split else 1.0
            children = np.asarray(seg.children[t], np.float64).reshape(P, n, seg.k, *SAMPLE_SHAPE)
            noise = np.asarray(noise_of_step[int(i)], np.float64)
            drawn = mean[:, :, None] + scale * std * noise
            np.testing.assert_allclose(children, drawn, rtol=1e-4, atol=1e-5)
            score_std = std * (scale if split_log_prob == "sampled" else 1.0)
            assert seg.score_scale == (scale if split_log_prob == "sampled" else 1.0)
            dense = stats.norm.logpdf(children, mean[:, :, None], score_std)
            want = dense.mean(axis=(3, 4, 5)).reshape(P, n * seg.k)
            np.testing.assert_allclose(seg.log_probs[t], want, rtol=1e-4, atol=1e-4)
    assert splits_seen == 2


# ---------------------------------------------------------------------------------------------
# Options, checks and one training iteration.


def test_schedule_configs_read_the_options():
    plain = types.SimpleNamespace(eta=0.5, noise_level=0.4, shift=2.0)
    flow = FlowScheduleConfig().make_schedule(6, plain)
    assert (flow.sde, flow.score_correction) == ("flow_grpo", True)
    jax.tree.map(
        np.testing.assert_array_equal,
        flow,
        sampling.make_flow_schedule(6, shift=2.0, noise_level=0.4),
    )
    options = Sampling(
        noise_level=0.3, shift=2.0, flow_sde="dancegrpo", flow_score_correction=False
    )
    flow = FlowScheduleConfig().make_schedule(6, options)
    assert (flow.sde, flow.score_correction, float(flow.noise_level)) == (
        "dancegrpo",
        False,
        np.float32(0.3),
    )
    c = base_config()
    c.sampling.flow_sde = "dancegrpo"
    assert FlowScheduleConfig().make_schedule(6, c.sampling).sde == "dancegrpo"
    # so does SD3's scheduler, over its own sigmas
    from tree_grpo_jax.models.sd3.load import FlowMatchScheduleConfig

    sd3 = FlowMatchScheduleConfig(shift=3.0).make_schedule(6, options)
    assert (sd3.sde, sd3.score_correction) == ("dancegrpo", False)
    assert float(sd3.noise_level) == np.float32(0.3)
    np.testing.assert_allclose(sd3.sigmas, FlowMatchScheduleConfig(shift=3.0).sigmas(6), rtol=1e-6)
    # DDIM models ignore it
    ddim = DDIMScheduleConfig().make_schedule(10, c.sampling)
    jax.tree.map(np.testing.assert_array_equal, ddim, sampling.make_ddim_schedule(10, eta=1.0))


def test_bad_flow_sde_is_one_sentence():
    with pytest.raises(ValueError, match="the flow SDE must be one of"):
        sampling.make_flow_schedule(4, sde="flux")
    c = base_config()
    c.sampling.flow_sde = "flux"
    with pytest.raises(cfg.ConfigError, match=r"^sampling.flow_sde must be one of .*'flux'\.$"):
        cfg.validate(c, known_rewards=rewards.available_rewards())


def with_flags(config, *overrides):
    """`config` with command-line overrides applied as the trainer's flag applies them."""
    from tree_grpo_jax.cli import config_flag

    parsed, _ = config_flag._split_overrides(list(overrides))
    return config_flag.apply_overrides(config, parsed)


@pytest.mark.slow
@pytest.mark.parametrize("split_log_prob", ["sampled", "unscaled"])
def test_training_iteration_with_the_dancegrpo_sde_starts_at_ratio_one(tmp_path, split_log_prob):
    """The first update's ratios are 1 to float32 rounding: the rollout and the train step
    are two compiled programs, which may round the denoiser differently (the Flow-GRPO SDE's
    deviation here is of the same few 1e-7); far inside the clip range."""
    c = base_config()
    c.name = "test_dancegrpo"
    c.model.name = "random_tiny_flow"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.sampling.noise_level = 0.3
    c.tree.method = "branchgrpo"
    c.tree.k = 2
    c.tree.split_steps = (0, 2)
    c.tree.split_noise_scale = 4.0
    c.tree.split_log_prob = split_log_prob
    c.train.iterations = 1
    c.train.learning_rate = 1e-3
    c.train.rows_per_minibatch = 64  # every row in one minibatch: the update's first ratio
    c.rewards = "jpeg_compressibility"
    c.log.progress = False
    c.log.tensorboard = False
    c = with_flags(c, "--config.sampling.flow_sde=dancegrpo")
    trainer, state = train.setup(c, str(tmp_path))
    schedule = trainer.schedule()
    assert (schedule.sde, schedule.score_correction) == ("dancegrpo", True)
    before = jax.device_get(state.params)
    state, metrics = trainer.iteration(state, 0)
    assert metrics["minibatches"] == 1 and metrics["trained_edges"] > 0
    assert 1 - 1e-5 < metrics["ratio_min"] <= metrics["ratio_max"] < 1 + 1e-5, metrics
    assert metrics["clip_fraction"] == 0.0
    assert np.isfinite(metrics["loss"])
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(state.params), before)
    assert max(jax.tree_util.tree_leaves(moved)) > 0
