"""Sampling maths against independent references: scipy densities, diffusers' DDIM
scheduler (its PyTorch class: diffusers 0.40 removed the Flax one), and the exact marginals of
a Gaussian data distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tree_grpo_jax.core import sampling

SD15_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    set_alpha_to_one=False,
    clip_sample=False,
)


def _diffusers_ddim(num_steps, prediction_type="epsilon"):
    pytest.importorskip("torch")
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config({**SD15_SCHEDULER, "prediction_type": prediction_type})
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_gaussian_log_prob_matches_scipy(reduce):
    rng = np.random.default_rng(0)
    sample, mean = rng.normal(size=(2, 3, 4, 5, 5)).astype(np.float32)
    std = np.float32(0.37)
    ours = sampling.gaussian_log_prob(sample, mean, std, event_ndim=3, reduce=reduce)
    dense = stats.norm.logpdf(sample, loc=mean, scale=std)
    expected = dense.mean(axis=(1, 2, 3)) if reduce == "mean" else dense.sum(axis=(1, 2, 3))
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_ddim_step_log_prob_matches_scipy(reduce):
    schedule = sampling.make_ddim_schedule(10, eta=1.0)
    rng = np.random.default_rng(1)
    x, eps, noise = rng.normal(size=(3, 6, 1, 8, 8)).astype(np.float32)
    out = sampling.sample_step(schedule, 3, x, eps, noise, event_ndim=3, reduce=reduce)
    dense = stats.norm.logpdf(
        np.asarray(out.sample), loc=np.asarray(out.mean), scale=float(out.std)
    )
    expected = dense.mean(axis=(1, 2, 3)) if reduce == "mean" else dense.sum(axis=(1, 2, 3))
    np.testing.assert_allclose(out.log_prob, expected, rtol=1e-5)


def test_flow_sde_log_prob_matches_scipy():
    schedule = sampling.make_flow_schedule(10, shift=3.0)
    rng = np.random.default_rng(2)
    x, v, noise = rng.normal(size=(3, 4, 2, 4, 4)).astype(np.float32)
    for i in (0, 5, 9):
        out = sampling.sample_step(schedule, i, x, v, noise, event_ndim=3)
        dense = stats.norm.logpdf(
            np.asarray(out.sample), loc=np.asarray(out.mean), scale=float(out.std)
        )
        np.testing.assert_allclose(out.log_prob, dense.mean(axis=(1, 2, 3)), rtol=1e-5)


def test_ddim_timesteps_match_diffusers():
    for n in (1, 10, 20, 50, 998, 999):
        timesteps = _diffusers_ddim(n).timesteps.numpy()
        np.testing.assert_array_equal(sampling.make_ddim_schedule(n).timesteps, timesteps)


def test_ddim_step_counts_stop_where_the_first_timestep_leaves_the_schedule():
    """With SD1.5's offset of 1, 1000 steps would start at timestep 1000 (diffusers' own
    scheduler sets it, and indexes past its 1000 alphas): the range ends at 999."""
    scheduler = _diffusers_ddim(1000)
    assert int(scheduler.timesteps[0]) == 1000 == len(scheduler.alphas_cumprod)
    with pytest.raises(ValueError, match=r"^num_steps must be in \[1, 999\], got 1000\.$"):
        sampling.make_ddim_schedule(1000)
    assert sampling.make_ddim_schedule(1000, steps_offset=0).timesteps[0] == 999
    for offset in (0, 1, 7):  # brute force over every step count
        fits = [n for n in range(1, 1001) if int(np.arange(n).max() * (1000 // n)) + offset < 1000]
        assert sampling.largest_ddim_step_count(1000, offset) == max(fits)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_mean_matches_diffusers_step(prediction_type, eta):
    """diffusers' DDIM step with zero noise returns the transition mean."""
    import torch

    num_steps = 10
    scheduler = _diffusers_ddim(num_steps, prediction_type)
    schedule = sampling.make_ddim_schedule(num_steps, eta=eta, prediction_type=prediction_type)
    rng = np.random.default_rng(3)
    x, pred = rng.normal(size=(2, 3, 4, 8, 8)).astype(np.float32)
    for i, t in enumerate(scheduler.timesteps.numpy()):
        x_t, pred_t = torch.from_numpy(x), torch.from_numpy(pred)
        step = scheduler.step(pred_t, int(t), x_t, eta=eta, variance_noise=torch.zeros_like(x_t))
        expected = step.prev_sample.numpy()
        mean, _ = schedule.transition(i, x, pred)
        np.testing.assert_allclose(mean, expected, rtol=2e-5, atol=2e-5)


def test_ddim_std_matches_formula_and_eta_zero_is_deterministic():
    schedule = sampling.make_ddim_schedule(50, eta=1.0)
    ac = sampling.scaled_linear_alphas_cumprod()
    x = jnp.ones((1, 1, 2, 2))
    for i, t in enumerate(np.asarray(schedule.timesteps)):
        prev = t - 20
        a, a_prev = ac[t], (ac[prev] if prev >= 0 else ac[0])
        variance = (1 - a_prev) / (1 - a) * (1 - a / a_prev)
        _, std = schedule.transition(i, x, x)
        np.testing.assert_allclose(std, np.sqrt(variance), rtol=1e-4)
    _, std0 = schedule.transition(4, x, x, stochastic=False)
    assert float(std0) == 0.0


def test_bf16_inputs_are_computed_in_float32():
    schedule = sampling.make_ddim_schedule(10)
    x = jnp.ones((2, 1, 4, 4), jnp.bfloat16)
    out = sampling.sample_step(schedule, 0, x, x, x, event_ndim=3)
    assert out.sample.dtype == out.log_prob.dtype == jnp.float32


@pytest.mark.parametrize("score_scale", [None, 1.0, 0.5])
def test_split_scoring_conventions_match_scipy(score_scale):
    """Drawn with noise_scale * std; scored under the Gaussian drawn from (score_scale None,
    our default) or under score_scale * std (1.0: BranchGRPO's released code)."""
    schedule = sampling.make_flow_schedule(10, shift=3.0)
    rng = np.random.default_rng(4)
    x, v, noise = rng.normal(size=(3, 5, 1, 4, 4)).astype(np.float32)
    scale = 4.0
    out = sampling.sample_step(
        schedule, 3, x, v, noise, event_ndim=3, noise_scale=scale, score_scale=score_scale
    )
    mean, std = (np.asarray(a, np.float64) for a in schedule.transition(3, x, v))
    np.testing.assert_allclose(out.sample, mean + scale * std * noise, rtol=1e-5, atol=1e-6)
    score_std = std * (scale if score_scale is None else score_scale)
    dense = stats.norm.logpdf(np.asarray(out.sample, np.float64), loc=mean, scale=score_std)
    np.testing.assert_allclose(out.log_prob, dense.mean(axis=(1, 2, 3)), rtol=1e-5)


def test_ddim_eta_above_one_is_refused():
    with pytest.raises(ValueError, match="eta must be in"):
        sampling.make_ddim_schedule(10, eta=1.5)
    with pytest.raises(ValueError, match="eta must be in"):
        sampling.make_ddim_schedule(10, eta=-0.1)
    assert float(sampling.make_ddim_schedule(10, eta=1.0).eta) == 1.0


def test_score_step_reproduces_sample_step_log_prob():
    schedule = sampling.make_flow_schedule(8)
    x, v, noise = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 1, 4, 4))
    drawn = sampling.sample_step(schedule, 2, x, v, noise, event_ndim=3, noise_scale=1.7)
    scored = sampling.score_step(schedule, 2, x, v, drawn.sample, event_ndim=3, noise_scale=1.7)
    np.testing.assert_array_equal(drawn.log_prob, scored.log_prob)


def test_flow_sde_preserves_gaussian_marginals():
    """With the exact velocity of Gaussian data, one small SDE step maps the sigma marginal
    to the next sigma's marginal (to first order in dt): Flow-GRPO's SDE is built so."""
    s0 = 0.6  # data std

    def variance(sigma):
        return (1 - sigma) ** 2 * s0**2 + sigma**2

    sigmas = np.array([0.5, 0.499, 0.0])
    schedule = sampling.flow_schedule_from_sigmas(sigmas, noise_level=0.7)
    sigma = sigmas[0]
    slope = (sigma - (1 - sigma) * s0**2) / variance(sigma)  # v(x) = slope * x, exactly
    x = jnp.linspace(-1.0, 1.0, 5)
    mean, std = schedule.transition(0, x, slope * x)
    c = float(mean[-1] / x[-1])
    next_variance = c**2 * variance(sigma) + float(std) ** 2
    ode_c = 1 + slope * (sigmas[1] - sigma)
    np.testing.assert_allclose(next_variance, variance(sigmas[1]), rtol=2e-5)
    np.testing.assert_allclose(ode_c**2 * variance(sigma), variance(sigmas[1]), rtol=2e-5)


def test_flow_schedule_shift_and_endpoints():
    schedule = sampling.make_flow_schedule(4, shift=3.0)
    sig = np.linspace(1, 0, 5)
    np.testing.assert_allclose(schedule.sigmas, 3 * sig / (1 + 2 * sig), rtol=1e-6)
    assert float(schedule.sigmas[0]) == 1.0 and float(schedule.sigmas[-1]) == 0.0
    _, std = schedule.transition(0, jnp.zeros(3), jnp.zeros(3))
    assert np.isfinite(float(std)) and float(std) > 0


def test_bad_arguments_raise_one_sentence():
    with pytest.raises(ValueError, match="reduce must be one of"):
        sampling.reduce_event(jnp.ones((2, 2)), 1, "max")
    with pytest.raises(ValueError, match="prediction_type"):
        sampling.make_ddim_schedule(10, prediction_type="sample")
    with pytest.raises(ValueError, match="num_steps"):
        sampling.make_ddim_schedule(0)
