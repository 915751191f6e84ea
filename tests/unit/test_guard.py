"""The eval guard's decisions on explicit histories, the exact eval KL against the DDIM
formulas written out in numpy, and a best checkpoint that outlives `checkpoint.keep`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax import config as cfg
from tree_grpo_jax.config import base_config
from tree_grpo_jax.core import sampling
from tree_grpo_jax.core.rollout import sample_with_kl
from tree_grpo_jax.evaluation import guard
from tree_grpo_jax.run.checkpoint import Checkpointer


def _config(fraction=0.0, drop=0.0):
    c = base_config()
    c.eval.extra_rewards = ("held",)
    c.eval.guard.min_diversity_fraction = fraction
    c.eval.guard.held_out_drop = drop
    return c


def _eval(iteration, reward, div, held):
    return {"iteration": iteration, "reward_mean": reward, "diversity": div, "held": held}


def test_diversity_below_the_fraction_of_the_first_trips():
    evals = [_eval(0, -1.0, 10.0, 0.5), _eval(5, -0.5, 6.0, 0.5)]
    assert guard.check(_config(fraction=0.5), evals) is None  # 0.6 of the first
    evals.append(_eval(10, -0.2, 4.9, 0.5))
    reason = guard.check(_config(fraction=0.5), evals)
    assert reason.startswith("diversity fell to 0.49 of its first value (10 -> 4.9)")
    assert guard.check(_config(fraction=0.0), evals) is None  # off


def test_held_out_drop_trips_only_while_the_reward_rises():
    c = _config(drop=0.1)
    assert guard.check(c, [_eval(0, -1.0, 1, 0.9), _eval(5, -0.5, 1, 0.85)]) is None
    reason = guard.check(c, [_eval(0, -1.0, 1, 0.9), _eval(5, -0.5, 1, 0.75)])
    assert reason.startswith("held-out held fell by 0.15 (0.9 -> 0.75)")
    assert "while the eval reward rose (-1 -> -0.5)" in reason
    # the same drop with a falling reward is not reward hacking
    assert guard.check(c, [_eval(0, -1.0, 1, 0.9), _eval(5, -1.5, 1, 0.75)]) is None
    assert guard.check(_config(), [_eval(0, -1.0, 1, 0.9), _eval(5, -0.5, 1, 0.0)]) is None


def test_best_is_the_highest_eval_reward_earliest_first():
    evals = [
        _eval(0, -1.0, 1, 1),
        _eval(5, -0.2, 1, 1),
        _eval(10, -0.2, 1, 1),
        _eval(15, -0.5, 1, 1),
    ]
    assert guard.best(evals)["iteration"] == 5
    line = guard.stop_line("why", 15, guard.best(evals), "/r/checkpoints")
    assert line == (
        "stopped by the guard after 15 iterations: why; the best checkpoint is step 5 "
        "(eval reward -0.2) in /r/checkpoints."
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("samples_per_prompt", 0, "eval.samples_per_prompt must be at least 1, got 0."),
        ("guard.min_diversity_fraction", -0.1, "eval.guard.min_diversity_fraction must be in"),
        ("guard.min_diversity_fraction", 1.5, "eval.guard.min_diversity_fraction must be in"),
        ("guard.held_out_drop", -0.1, "eval.guard.held_out_drop must be >= 0 (0: off), got -0.1."),
        ("guard.action", "halt", "eval.guard.action must be one of stop, warn, got 'halt'."),
    ],
)
def test_bad_guard_settings_are_one_sentence(field, value, message):
    c = base_config()
    section = c.eval
    *parents, name = field.split(".")
    for p in parents:
        section = section[p]
    section[name] = value
    with pytest.raises(cfg.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate(c)


def test_the_guard_needs_what_it_watches():
    from tree_grpo_jax.run import build

    c = base_config()
    c.model.name = "random_tiny"
    c.eval.samples_per_prompt = 1
    assert build.diversity_embed(c, ["a", "b"], None) is None  # nothing to compare: no figure
    assert build.diversity_embed(c, ["a", "b", "a"], None) is not None  # a repeated prompt
    c.eval.guard.min_diversity_fraction = 0.5
    with pytest.raises(cfg.ConfigError, match="needs several samples of an eval prompt"):
        build.diversity_embed(c, ["a", "b"], None)
    c.eval.samples_per_prompt = 2
    assert build.diversity_embed(c, ["a", "b"], None) is not None
    c = base_config()
    c.eval.guard.held_out_drop = 0.1
    with pytest.raises(cfg.ConfigError, match="name them in eval.extra_rewards"):
        cfg.validate(c)


def _toy_denoise(params, x, t, cond):
    """eps = w * x + b + the prompt embedding's mean: a denoiser whose output is known."""
    del t
    return params["w"] * x + params["b"] + jnp.mean(cond, axis=(1, 2))[:, None, None, None]


def test_eval_kl_is_the_exact_gaussian_kl_of_the_ddim_steps():
    eta, steps = 0.8, 4
    schedule = sampling.make_ddim_schedule(steps, eta=eta)
    rng = np.random.default_rng(0)
    noise = rng.normal(size=(3, 2, 4, 4)).astype(np.float32)
    cond = rng.normal(size=(3, 5, 6)).astype(np.float32)
    theta = {"w": np.float32(0.3), "b": np.float32(0.1)}
    ref = {"w": np.float32(0.2), "b": np.float32(-0.05)}
    x_out, kl = sample_with_kl(
        _toy_denoise, theta, ref, jnp.asarray(cond), jnp.asarray(noise), schedule, None, 1.0
    )

    # DDIM with eta written out (x0 from eps, the eta std, the mean of x_t'), with the
    # training schedule's alpha-bars
    a_all, a_prev_all = (
        np.asarray(schedule.alpha_bar, np.float64),
        np.asarray(schedule.alpha_bar_prev, np.float64),
    )
    shift = cond.astype(np.float64).mean(axis=(1, 2))[:, None, None, None]
    x = noise.astype(np.float64)
    per_step = []
    for i in range(steps):
        a, a_prev = a_all[i], a_prev_all[i]
        s = eta * np.sqrt((1 - a_prev) / (1 - a)) * np.sqrt(1 - a / a_prev)

        def mu(p, s, x=x, a=a, a_prev=a_prev):
            eps = float(p["w"]) * x + float(p["b"]) + shift
            x0 = (x - np.sqrt(1 - a) * eps) / np.sqrt(a)
            return np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - s**2) * eps

        per_step.append(((mu(theta, s) - mu(ref, s)) ** 2 / (2 * s**2)).sum(axis=(1, 2, 3)))
        x = mu(theta, 0.0)  # the deterministic sampler's step (eta 0)
    np.testing.assert_allclose(kl, np.mean(per_step, axis=0), rtol=2e-3)
    np.testing.assert_allclose(x_out, x, rtol=1e-3, atol=1e-4)
    _, same = sample_with_kl(
        _toy_denoise, ref, ref, jnp.asarray(cond), jnp.asarray(noise), schedule, None, 1.0
    )
    np.testing.assert_allclose(same, 0.0, atol=1e-8)


def test_a_protected_step_outlives_keep(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=1)
    state = {"w": jnp.zeros(3)}
    ckpt.save(1, state, {"step": 1})
    ckpt.protect(1)
    for step in (2, 3, 4):
        ckpt.save(step, jax.tree_util.tree_map(lambda a, s=step: a + s, state), {"step": step})
    assert ckpt.all_steps() == [1, 4]
    ckpt.protect(None)
    ckpt.save(5, state, {"step": 5})
    assert ckpt.all_steps() == [5]
    ckpt.close()
