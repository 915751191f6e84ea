"""The trainer end to end on the tiny architecture with random weights: every preset trains,
writes its files, and a crashed run resumes exactly."""

import json
import os

import jax
import numpy as np
import optax
import pytest
from small_configs import small_config

from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.checkpoint import Checkpointer
from tree_grpo_jax.run.train_step import old_params


@pytest.mark.parametrize("method", ["grpo", "mixgrpo", "treegrpo", "branchgrpo", "branchgrpo_mix"])
def test_two_iterations_of_every_preset(tmp_path, method):
    c = small_config(method)
    if method == "branchgrpo":
        c.advantage.width_pruning = "top_per_branch"
    summary = train.train(c, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [m for m in metrics if "train/reward_mean" in m]
    assert [m["step"] for m in train_rows] == [1, 2]
    assert all(m["train/trained_edges"] > 0 and np.isfinite(m["train/loss"]) for m in train_rows)
    assert os.path.exists(tmp_path / "eval_00000.png") and os.path.exists(
        tmp_path / "eval_00002.png"
    )
    assert os.path.exists(summary["reward_curve"])
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 2
    assert np.isfinite(summary["last_eval_reward"])


def nft_config(method: str = "diffusion_nft"):
    """A small DiffusionNFT run: a flow model, no guidance."""
    c = small_config(method)
    c.model.name = "random_tiny_flow"
    c.sampling.guidance_scale = 1.0
    c.diffusion_nft.old_policy_rate = 0.25  # the old policy's decay moves within the run
    return c


def awm_config(method: str = "awm"):
    """A small off-policy AWM run: the EMA copy samples, anchors the ratio and moves."""
    c = nft_config(method)
    c.awm.train_timesteps = 2  # strata of [1, int(4 * 0.9)) = [1, 3)
    c.awm.off_policy = True
    c.awm.ema_decay_rate = 0.25
    return c


def dgpo_config():
    """A small DGPO run that samples with its EMA copy from the second iteration on."""
    c = nft_config("dgpo")
    c.dgpo.trunc_steps = 2
    c.dgpo.train_timesteps = 2
    c.dgpo.switch_ema_ref = 1
    c.dgpo.ema_decay_rate = 0.25
    c.train.kl_beta = 0.02
    c.train.rows_per_minibatch = 2
    return c


def test_two_iterations_of_awm_on_the_tree(tmp_path):
    c = awm_config("awm_tree")
    c.train.kl_beta = 0.1
    train.train(c, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "train/reward_mean" in m]
    leaves = 4  # k2 over a window of 2
    assert [m["train/train_rows"] for m in rows] == [2 * leaves * 2] * 2
    # min(0.25 * iterations done, 0.3)
    assert [m["train/ema_decay"] for m in rows] == [0.25, 0.3]
    assert all(m["train/ema_kl"] >= 0 and m["train/matching_error"] > 0 for m in rows)
    assert all(np.isfinite(m["train/loss"]) and m["train/kl"] >= 0 for m in rows)


def test_two_iterations_of_diffusion_nft_on_the_tree(tmp_path):
    # (the plain diffusion_nft run is the resume test's)
    c = nft_config("diffusion_nft_tree")
    c.train.kl_beta = 0.1
    train.train(c, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "train/reward_mean" in m]
    leaves = 4  # k2 over a window of 2
    per_sample = int(c.sampling.num_steps * c.diffusion_nft.timestep_fraction)  # 3 of 4
    assert [m["train/train_rows"] for m in rows] == [2 * leaves * per_sample] * 2
    assert [m["train/old_policy_decay"] for m in rows] == [0.25, 0.5]
    assert all(np.isfinite(m["train/loss"]) and m["train/kl"] >= 0 for m in rows)
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 2


def _final_params(c, workdir):
    _, state = train.setup(c, str(workdir))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    restored, meta, _ = ckpt.restore(state)
    return jax.device_get((restored.params, old_params(restored))), meta


@pytest.mark.parametrize("method", ["grpo", "diffusion_nft", "awm", "dgpo"])
def test_killed_run_resumes_exactly(tmp_path, monkeypatch, method):
    # DiffusionNFT, AWM, DGPO: the old policy / EMA copy is part of the state, compared too
    configs = {"grpo": lambda: small_config("grpo"), "diffusion_nft": nft_config}
    c = {**configs, "awm": awm_config, "dgpo": dgpo_config}[method]()
    c.advantage.stat_tracker = True
    c.advantage.tracker_min_count = 2
    c.train.iterations = 4
    c.checkpoint.every = 2
    c.eval.every = 0
    c.prompts.source = "digits"

    straight = tmp_path / "straight"
    train.train(c, str(straight))

    crashed = tmp_path / "crashed"
    real_iteration = train.Trainer.iteration

    def dies_at_iteration_3(trainer, state, iteration):
        if iteration == 3:
            raise SystemExit("killed")  # like a kill: nothing is saved on the way out
        return real_iteration(trainer, state, iteration)

    monkeypatch.setattr(train.Trainer, "iteration", dies_at_iteration_3)
    with pytest.raises(SystemExit):
        train.train(c, str(crashed))
    assert Checkpointer(str(crashed / "checkpoints")).latest_step == 2
    monkeypatch.setattr(train.Trainer, "iteration", real_iteration)
    train.train(c, str(crashed))  # same command, same workdir: resumes after iteration 2

    expected, meta_a = _final_params(c, straight)
    resumed, meta_b = _final_params(c, crashed)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), expected, resumed
    )
    assert meta_a["prompt_iterator"] == meta_b["prompt_iterator"]
    assert meta_a.get("stat_tracker") == meta_b.get("stat_tracker")
    moved = jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(
            lambda a, b: float(np.abs(a - b).max()), expected, _initial_params(c)
        )
    )
    assert max(moved) > 1e-5  # training changed the weights, so the comparison means something


def _initial_params(c):
    _, state = train.setup(c, "/tmp/unused")
    return jax.device_get((state.params, old_params(state)))


def test_nan_reward_stops_with_one_sentence_and_keeps_progress(tmp_path):
    from tree_grpo_jax.rewards import registry

    calls = {"n": 0}

    def flaky(images, prompts):
        calls["n"] += 1
        values = np.zeros(len(images))
        # the start's check on blank images, eval at 0, iterations 0 and 1 are fine, then NaN
        if calls["n"] > 4:
            values[0] = np.nan
        return values

    registry.register("test_flaky", flaky, on_host=True, overwrite=True)
    c = small_config("treegrpo")
    c.rewards = "test_flaky"
    c.train.iterations = 5
    c.eval.every = 0
    c.checkpoint.every = 0
    with pytest.raises(train.RewardError, match="non-finite value") as info:
        train.train(c, str(tmp_path))
    assert "\n" not in str(info.value)
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 2


def test_sliding_window_compiles_the_rollout_and_the_step_once(tmp_path):
    """Every window position of a sliding TreeGRPO window is served by one compiled rollout
    and one compiled train step."""
    from compiles import count_compiles

    c = small_config("treegrpo")
    c.sampling.num_steps = 5
    c.tree.window = 2
    c.tree.window_slide_every = 1
    c.train.iterations = 4
    trainer, state = train.setup(c, str(tmp_path))
    starts = []
    with count_compiles() as compiles:
        for iteration in range(4):  # window positions 0, 1, 2, 3
            state, metrics = trainer.iteration(state, iteration)
            starts.append(metrics["window_start"])
    assert starts == [0, 1, 2, 3]
    assert compiles["_rollout"] == 1
    assert trainer.train_step._cache_size() == 1


def _adam_count(state) -> int:
    """How many updates Adam has applied (its moment estimates' step count)."""
    return int(optax.tree_utils.tree_get(state.opt_state, "count"))


def _one_iteration(c, workdir):
    trainer, state = train.setup(c, str(workdir))
    before = jax.device_get(state.params)
    state, metrics = trainer.iteration(state, 0)
    return before, jax.device_get(state.params), metrics, _adam_count(state)


def test_one_update_per_iteration_spans_every_minibatch(tmp_path):
    """`updates_per_iteration=1` over 3 minibatches of 2 rows (the last topped up, masked)
    gives the update one plain step gives on one minibatch holding every row."""
    c = small_config("treegrpo")
    c.train.adam_eps = 1.0  # so the update follows the gradient, not only its sign
    whole = c.copy_and_resolve_references()
    whole.train.rows_per_minibatch = 64
    before, expected, metrics, count = _one_iteration(whole, tmp_path / "whole")
    assert metrics["minibatches"] == 1 and count == 1
    c.train.rows_per_minibatch = 4
    c.train.updates_per_iteration = 1
    c.train.inner_epochs = 2
    c.train.learning_rate = whole.train.learning_rate
    _, got_two_epochs, metrics, count = _one_iteration(c, tmp_path / "two_epochs")
    assert metrics["minibatches"] > 2 and count == 1
    c.train.inner_epochs = 1
    _, got, metrics, count = _one_iteration(c, tmp_path / "split")
    assert metrics["minibatches"] > 1 and count == 1
    change = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(before))
    )
    assert change > 1e-5
    for a, b, d in zip(*(jax.tree_util.tree_leaves(t) for t in (expected, got, got_two_epochs))):
        np.testing.assert_allclose(b, a, atol=1e-4 * change)
        # two epochs see every edge twice: the same mean gradient, so the same update
        np.testing.assert_allclose(d, a, atol=1e-4 * change)


def test_updates_per_iteration_counts_adam_steps(tmp_path):
    c = small_config("treegrpo")
    c.train.rows_per_minibatch = 2
    c.train.inner_epochs = 2
    c.train.updates_per_iteration = 3
    _, _, metrics, count = _one_iteration(c, tmp_path)
    assert metrics["minibatches"] >= 3 and count == 3


def test_more_updates_than_minibatches_is_one_update_each_and_said(tmp_path, capsys):
    c = small_config("treegrpo")
    c.train.rows_per_minibatch = 4
    c.train.updates_per_iteration = 1000
    _, _, metrics, count = _one_iteration(c, tmp_path)
    minibatches = int(metrics["minibatches"])
    assert 1 < minibatches < 1000 and count == minibatches
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert note == [
        f"note: train.updates_per_iteration=1000 is more than the {minibatches} minibatch(es) "
        f"an iteration trains on; each minibatch is one update ({minibatches} per iteration)."
    ]


def test_denoise_rows_change_no_number(tmp_path):
    """The denoiser over 3 rows at a time (chunks that divide no level: the last is topped
    up) gives the rollout, the update and the eval rows that every row at once gives, to
    float32 rounding (the CPU's matmuls round differently for another number of rows)."""
    runs = {}
    for rows in (0, 3):
        c = small_config("treegrpo")
        c.prompts.source = "digits"
        c.rewards = "digit_alignment"  # smooth in the pixels: rounding cannot move it far
        c.train.adam_eps = 1.0  # so the update follows the gradient, not only its sign
        c.sampling.denoise_rows = rows
        trainer, state = train.setup(c, str(tmp_path / f"rows_{rows}"))
        sampled = trainer.rollout(state.params, ["0", "1"], jax.random.PRNGKey(1))
        before = jax.device_get(state.params)
        state, metrics = trainer.iteration(state, 0)
        _, images, rewards, _ = trainer.evaluate_samples(state.params)
        after = jax.device_get(state.params)
        moved = jax.tree_util.tree_map(lambda a, b: a - b, after, before)
        runs[rows] = (jax.device_get(sampled.tree), moved, np.asarray(images), rewards)
    (tree, moved, images, rewards), (tree_3, moved_3, images_3, rewards_3) = runs[0], runs[3]
    assert np.std(images) > 0 and np.std(rewards) > 0  # rows that differ from each other
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(tree_3)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    step = max(float(np.abs(m).max()) for m in jax.tree_util.tree_leaves(moved))
    assert step > 1e-6  # the update moved the weights
    for a, b in zip(jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(moved_3)):
        np.testing.assert_allclose(b, a, atol=1e-3 * step)
    np.testing.assert_allclose(images_3, images, atol=1e-4)
    np.testing.assert_allclose(rewards_3, rewards, rtol=1e-4, atol=1e-5)
