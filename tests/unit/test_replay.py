"""Replay (`train.replay`, core/replay.py): what the buffer holds after more iterations than
it keeps, the conditioning each held row is looked up in, the importance ratios of replayed
rows against a float64 scipy recomputation, their round trip through the saved arrays, the
counts the benchmarks derive, and the refusal for an objective whose rows are not PPO's."""

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy import stats

from tree_grpo_jax import config as cfg
from tree_grpo_jax import methods
from tree_grpo_jax.config import base_config
from tree_grpo_jax.core import sampling
from tree_grpo_jax.core import tree_spec as ts
from tree_grpo_jax.core.loss import LossInputs, PPOSettings, ppo_loss, score_actions
from tree_grpo_jax.core.replay import ReplayBuffer
from tree_grpo_jax.core.rollout import rollout
from tree_grpo_jax.core.transitions import Transitions, gather_transitions
from tree_grpo_jax.rewards import registry as rewards

SAMPLE_SHAPE = (1, 2, 2)
P, L, D = 2, 3, 4
NUM_STEPS = 4
NOISE_LEVEL = 0.7
SPEC = ts.TreeSpec((ts.SDE, ts.BRANCH(2), ts.SDE, ts.ODE), 2)


def _rows(iteration: int, count: int, prompts: int = P) -> Transitions:
    """`count` rows whose every value names `iteration` (x) and the row (step)."""
    return Transitions(
        x=np.full((count, *SAMPLE_SHAPE), iteration, np.float32),
        step=np.arange(count, dtype=np.int32),
        prompt=np.arange(count, dtype=np.int32) % prompts,
        noise_scale=np.ones(count, np.float32),
        actions=np.full((count, 2, *SAMPLE_SHAPE), iteration, np.float32),
        old_log_probs=np.full((count, 2), -iteration, np.float32),
        advantages=np.full((count, 2), 10 * iteration, np.float32),
        mask=np.ones((count, 2), bool),
    )


def _cond(iteration: int) -> np.ndarray:
    """A prompt batch whose prompt p's embedding is 100 * iteration + p everywhere."""
    return (100.0 * iteration + np.arange(P, dtype=np.float32))[:, None, None] * np.ones(
        (P, L, D), np.float32
    )


def test_the_buffer_keeps_the_last_n_iterations_and_indexes_their_own_prompts():
    n = 2
    buffer = ReplayBuffer(n)
    rows, cond = buffer.mixed(_rows(0, 1), _cond(0))
    assert rows.num_rows == 1 and cond.shape == ((n + 1) * P, L, D)  # one shape, empty or full
    np.testing.assert_array_equal(cond[P:], 0.0)
    for iteration in range(n + 2):  # rows 1, 2, 3, 4: iterations 0 and 1 are dropped
        buffer.push(iteration, _rows(iteration, iteration + 1), _cond(iteration))
    assert [s.iteration for s in buffer.slots] == [2, 3]
    assert buffer.num_rows == 3 + 4

    fresh = _rows(4, 5)
    rows, cond = buffer.mixed(fresh, _cond(4))
    assert cond.shape == ((n + 1) * P, L, D)
    # fresh rows first, then the held iterations oldest first, each row as it was kept
    iterations = [4] * 5 + [2] * 3 + [3] * 4
    np.testing.assert_array_equal(rows.x[:, 0, 0, 0], iterations)
    np.testing.assert_array_equal(rows.advantages[:, 0], 10 * np.asarray(iterations))
    np.testing.assert_array_equal(rows.old_log_probs[:, 0], -np.asarray(iterations))
    np.testing.assert_array_equal(rows.step, [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3])
    # every row meets its own iteration's prompt p: 100 * iteration + p
    own_prompt = np.concatenate([np.arange(5) % P, np.arange(3) % P, np.arange(4) % P])
    looked_up = cond[rows.prompt][:, 0, 0]
    np.testing.assert_array_equal(looked_up, 100 * np.asarray(iterations) + own_prompt)


def test_saved_arrays_give_back_the_same_buffer_bit_for_bit():
    buffer = ReplayBuffer(3)
    for iteration in range(2):
        rows = _rows(iteration + 1, 2 + iteration)
        rows = rows.replace(
            x=(rows.x + 0.123).astype(ml_dtypes.bfloat16),  # a dtype numpy does not name
            old_means=np.random.default_rng(iteration).normal(size=rows.x.shape),
        )
        buffer.push(iteration + 5, rows, _cond(iteration).astype(ml_dtypes.bfloat16))
    back = ReplayBuffer(3)
    back.load(buffer.arrays())
    assert [s.iteration for s in back.slots] == [5, 6]
    for a, b in zip(buffer.slots, back.slots, strict=True):
        assert b.cond.dtype == ml_dtypes.bfloat16 and b.rows.x.dtype == ml_dtypes.bfloat16
        for x, y in zip(
            jax.tree_util.tree_leaves((a.rows, a.cond)),
            jax.tree_util.tree_leaves((b.rows, b.cond)),
            strict=True,
        ):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
    with pytest.raises(ValueError, match="holds 3 iterations, this run 2"):
        ReplayBuffer(2).load(buffer.arrays())


# -- the importance ratio of replayed rows -------------------------------------------------------


def denoiser(params, x, t, cond):
    """Velocity from the state, the prompt's embedding and the time (elementwise)."""
    c = cond.mean(axis=(1, 2)).reshape(-1, 1, 1, 1)
    return jnp.tanh(params["a"] * x) + params["b"] * c + 1e-3 * t.reshape(-1, 1, 1, 1)


def _reference_log_probs(params, rows: Transitions, cond: np.ndarray) -> np.ndarray:
    """[R, K] float64: each action's log-density under the Flow-GRPO step Gaussian the
    denoiser gives at its parent (FlowSchedule's documented mean and std, written out here),
    scipy's normal density averaged over the sample's entries."""
    sigmas = np.linspace(1.0, 0.0, NUM_STEPS + 1)
    a, b = float(params["a"]), float(params["b"])
    out = np.zeros(rows.old_log_probs.shape)
    for r in range(rows.num_rows):
        i = int(rows.step[r])
        sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
        unit = np.sqrt(sigma / (1.0 - (sigmas[1] if sigma == 1.0 else sigma)))
        sig = NOISE_LEVEL * unit
        x = np.asarray(rows.x[r], np.float64)
        t = sigma * 1000.0
        v = np.tanh(a * x) + b * np.mean(np.asarray(cond[rows.prompt[r]], np.float64)) + 1e-3 * t
        mean = (
            x * (1 + sig**2 * dt / (2 * sigma)) + v * (1 + sig**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        std = sig * np.sqrt(-dt) * float(rows.noise_scale[r])
        for k in range(out.shape[1]):
            action = np.asarray(rows.actions[r, k], np.float64)
            out[r, k] = np.mean(stats.norm.logpdf(action, mean, std))
    return out


def _iteration_rows(params, cond, seed: int) -> Transitions:
    """One iteration's PPO rows, sampled from `params` for `cond`."""
    schedule = sampling.make_flow_schedule(NUM_STEPS, noise_level=NOISE_LEVEL)
    tree = rollout(
        denoiser,
        params,
        jnp.asarray(cond),
        jax.random.PRNGKey(seed),
        schedule,
        spec=SPEC,
        sample_shape=SAMPLE_SHAPE,
    )
    tree = jax.tree_util.tree_map(np.asarray, tree)
    rng = np.random.default_rng(seed)
    advantages = [rng.normal(size=seg.log_probs.shape) for seg in tree.segments]
    return gather_transitions(tree, advantages)


def test_replayed_rows_ratios_match_a_scipy_recomputation_and_clip_as_ppo():
    sampled_with = {"a": jnp.float32(0.8), "b": jnp.float32(0.5)}  # iteration 0's policy
    now = {"a": jnp.float32(0.9), "b": jnp.float32(0.44)}  # the policy two iterations on
    cond_0, cond_1 = _cond(1) / 100.0, _cond(2) / 50.0  # different prompts each iteration
    buffer = ReplayBuffer(2)
    old_rows = _iteration_rows(sampled_with, cond_0, seed=0)
    buffer.push(0, old_rows, cond_0)
    fresh = _iteration_rows(now, cond_1, seed=1)
    rows, cond = buffer.mixed(fresh, cond_1)
    held = slice(fresh.num_rows, None)
    mask = rows.mask.astype(bool)

    # the stored log-probs are those of the sampling policy and its own prompts
    expected_old = _reference_log_probs(sampled_with, old_rows, cond_0)
    live = old_rows.mask.astype(bool)
    np.testing.assert_allclose(
        old_rows.old_log_probs[live], expected_old[live], rtol=1e-5, atol=1e-5
    )

    schedule = sampling.make_flow_schedule(NUM_STEPS, noise_level=NOISE_LEVEL)
    settings = PPOSettings(denoise_fn=denoiser, clip_range=0.05)
    new = score_actions(now, rows, settings, schedule=schedule, cond=jnp.asarray(cond))
    ratio = np.exp(np.asarray(new, np.float64) - rows.old_log_probs)
    expected_now = np.concatenate(
        [_reference_log_probs(now, fresh, cond_1), _reference_log_probs(now, old_rows, cond_0)]
    )
    expected_ratio = np.exp(expected_now - np.concatenate([fresh.old_log_probs, expected_old]))
    np.testing.assert_allclose(ratio[mask], expected_ratio[mask], rtol=1e-4)
    # replayed ratios are off 1 (the policy moved), the fresh ones are 1
    np.testing.assert_allclose(ratio[: fresh.num_rows][mask[: fresh.num_rows]], 1.0, atol=1e-4)
    off = np.abs(expected_ratio[held][mask[held]] - 1.0)
    assert off.max() > 1e-2

    # PPO's clip over the mixed rows: the share of edges outside [1 - eps, 1 + eps]
    eps = float(np.median(off))
    settings = PPOSettings(denoise_fn=denoiser, clip_range=eps)
    _, metrics = ppo_loss(now, rows, settings, LossInputs(schedule, jnp.asarray(cond)))
    clipped = np.mean(np.abs(expected_ratio[mask] - 1.0) > eps)
    assert 0.0 < clipped < 1.0
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clipped, atol=1e-6)
    # the loss itself: mean over edges of max(-A r, -A clip(r)), A the rows' own advantages
    adv = rows.advantages[mask]
    r = expected_ratio[mask]
    expected_loss = np.mean(np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps)))
    np.testing.assert_allclose(float(metrics["policy_loss"]), expected_loss, rtol=1e-4)


def test_the_truncated_correction_weights_each_replayed_edge_by_its_capped_ratio():
    """`train.replay_correction="truncated"`: the loss is mean(-A * min(r, cap)) and its
    gradient that of mean(-A * w * log pi) with w = min(r, cap) held fixed: against float64
    scipy log-densities and central differences in the policy's two parameters, with a cap
    that binds on some replayed edges and not on others."""
    sampled_with = {"a": jnp.float32(0.8), "b": jnp.float32(0.5)}
    now = {"a": jnp.float32(0.9), "b": jnp.float32(0.44)}
    cond_0, cond_1 = _cond(1) / 100.0, _cond(2) / 50.0
    buffer = ReplayBuffer(1)
    old_rows = _iteration_rows(sampled_with, cond_0, seed=0)
    buffer.push(0, old_rows, cond_0)
    fresh = _iteration_rows(now, cond_1, seed=1)
    rows, cond = buffer.mixed(fresh, cond_1)
    mask = rows.mask.astype(bool)
    behaviour = np.concatenate(
        [
            _reference_log_probs(now, fresh, cond_1),
            _reference_log_probs(sampled_with, old_rows, cond_0),
        ]
    )

    def reference_log_probs(a, b):
        params = {"a": a, "b": b}
        return np.concatenate(
            [
                _reference_log_probs(params, fresh, cond_1),
                _reference_log_probs(params, old_rows, cond_0),
            ]
        )

    ratio = np.exp(reference_log_probs(0.9, 0.44) - behaviour)[mask]
    held = ratio[fresh.mask.astype(bool).sum() :]
    cap = float(np.median(held))
    assert held.min() < cap < held.max()  # the cap binds on some replayed edges
    weight = np.minimum(ratio, cap)
    adv = rows.advantages[mask].astype(np.float64)

    def reference_objective(a, b):
        return np.mean(-adv * weight * reference_log_probs(a, b)[mask])

    h = 1e-4
    expected_grad = {
        "a": (reference_objective(0.9 + h, 0.44) - reference_objective(0.9 - h, 0.44)) / (2 * h),
        "b": (reference_objective(0.9, 0.44 + h) - reference_objective(0.9, 0.44 - h)) / (2 * h),
    }
    schedule = sampling.make_flow_schedule(NUM_STEPS, noise_level=NOISE_LEVEL)
    settings = PPOSettings(
        denoise_fn=denoiser, clip_range=1e-4, correction="truncated", weight_max=cap
    )

    def loss(params):
        return ppo_loss(params, rows, settings, LossInputs(schedule, jnp.asarray(cond)))

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(now)
    np.testing.assert_allclose(float(metrics["policy_loss"]), np.mean(-adv * weight), rtol=1e-4)
    for name in ("a", "b"):
        assert abs(expected_grad[name]) > 1e-3
        np.testing.assert_allclose(float(grad[name]), expected_grad[name], rtol=2e-3, atol=1e-5)
    # PPO's clip at 1e-4 on the same rows: the replayed edges past it on their advantage's
    # side give nothing, so its gradient differs
    clipped = PPOSettings(denoise_fn=denoiser, clip_range=1e-4)
    grad_clip = jax.grad(
        lambda p: ppo_loss(p, rows, clipped, LossInputs(schedule, jnp.asarray(cond)))[0]
    )(now)
    assert abs(float(grad_clip["a"]) - float(grad["a"])) > 1e-3


# -- counts and config ---------------------------------------------------------------------------


def _small(method: str):
    c = base_config()
    c.model.name = "random_tiny"
    c.prompts.batch_size = 2
    c.sampling.num_steps = 4
    c.tree.method = method
    c.tree.group_size = 4
    c.rewards = "jpeg_compressibility"
    return c


def test_training_counts_add_the_rows_of_the_replayed_iterations():
    c = _small("grpo")
    method = methods.get("grpo")
    plain = method.training_counts(c)
    c.train.replay = 2
    counts = [method.training_counts(c, i) for i in range(5)]
    assert [x["train_rows"] for x in counts] == [plain["train_rows"] * m for m in (1, 2, 3, 3, 3)]
    assert [x["replayed_rows"] for x in counts] == [
        plain["train_rows"] * m for m in (0, 1, 2, 2, 2)
    ]
    assert counts[4]["trained_edges"] == 3 * plain["trained_edges"]
    assert counts[4]["rollout_rows"] == plain["rollout_rows"]  # nothing more is sampled


def test_replay_is_refused_for_an_objective_whose_rows_are_not_ppo_transitions():
    c = _small("diffusion_nft")
    c.model.name = "random_tiny_flow"
    c.sampling.guidance_scale = 1.0
    cfg.validate(c, known_rewards=rewards.available_rewards())  # without replay: fine
    c.train.replay = 1
    with pytest.raises(cfg.ConfigError) as e:
        cfg.validate(c, known_rewards=rewards.available_rewards())
    assert str(e.value) == (
        "train.replay trains past iterations' PPO transitions again, but diffusion_nft trains "
        "through the nft objective, whose rows are not PPO transitions; set "
        "train.replay=0."
    )


def test_checkpoints_keep_each_steps_buffer_beside_it_and_drop_it_with_the_step(tmp_path):
    from tree_grpo_jax.run.checkpoint import HOST_FOLDER, Checkpointer, CheckpointError

    ckpt = Checkpointer(str(tmp_path), keep=2)
    buffers = {}
    for step in (1, 2, 3):
        buffer = ReplayBuffer(2)
        buffer.push(step, _rows(step, step), _cond(step))
        buffers[step] = buffer
        ckpt.save(step, {"w": np.full(3, step, np.float32)}, {"step": step}, buffer.arrays())
    assert ckpt.all_steps() == [2, 3]
    assert sorted(os.listdir(tmp_path / HOST_FOLDER)) == ["2.process0.npz", "3.process0.npz"]
    for step in (2, 3):
        back = ReplayBuffer.from_arrays(ckpt.read_host_arrays(step))
        assert [s.iteration for s in back.slots] == [step]
        assert back.slots[0].rows.x.tobytes() == buffers[step].slots[0].rows.x.tobytes()
    # a damaged archive is one sentence, naming the step and the file
    path = tmp_path / HOST_FOLDER / "3.process0.npz"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"checkpoint 3 in .* lacks readable host arrays"):
        ckpt.read_host_arrays(3)
    ckpt.close()


@pytest.mark.parametrize(
    "changes, sentence",
    [
        ({"replay": 0}, "corrects replayed rows; set train.replay=N"),
        ({"updates_per_iteration": 0}, "set train.updates_per_iteration=1 and"),
        ({"inner_epochs": 2}, "set train.updates_per_iteration=1 and train.inner_epochs=1"),
        ({"guard": True}, "GRPO-Guard (grpo_guard.enabled) normalises it"),
        ({"replay_correction": "truncate"}, "train.replay_correction must be one of"),
    ],
)
def test_the_truncated_correction_needs_replay_and_one_update_per_iteration(changes, sentence):
    c = _small("treegrpo")
    c.train.replay = 1
    c.train.updates_per_iteration = 1
    c.train.replay_correction = "truncated"
    cfg.validate(c, known_rewards=rewards.available_rewards())  # as the study runs it
    for name, value in changes.items():
        if name == "guard":
            c.grpo_guard.enabled = value
        else:
            c.train[name] = value
    with pytest.raises(cfg.ConfigError, match=re.escape(sentence)):
        cfg.validate(c, known_rewards=rewards.available_rewards())


def test_a_buffer_the_free_host_memory_cannot_hold_is_one_sentence(monkeypatch):
    from tree_grpo_jax.run import build

    c = _small("grpo")
    method = methods.get("grpo")
    spec, shape = method.run_spec(c), (4, 8, 8)
    build.check_sizes(c, spec, shape, method.objective)  # replay off: no bound asked
    c.train.replay = 3
    # grpo on 4 steps, G = 4: 16 rows a prompt, each a state and its action (K = 1)
    held = 3 * 2 * 16 * 2 * 4 * 4 * 8 * 8
    monkeypatch.setattr(build, "_host_available", lambda: held)
    build.check_sizes(c, spec, shape, method.objective)  # it fits, just
    monkeypatch.setattr(build, "_host_available", lambda: held - 1)
    with pytest.raises(cfg.ConfigError, match=r"^train.replay=3 keeps about .* of past rows"):
        build.check_sizes(c, spec, shape, method.objective)
