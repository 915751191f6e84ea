"""The trainer end to end on the tiny architecture with random weights: every preset trains,
writes its files (the forward-process methods and exact resumes: test_train_resume.py)."""

import json
import os

import jax
import numpy as np
import optax
import pytest
from small_configs import small_config

from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.checkpoint import Checkpointer


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


def test_nan_reward_stops_with_one_sentence_and_keeps_progress(tmp_path):
    from tree_grpo_jax.rewards import registry

    calls = {"n": 0}

    def flaky(images, prompts):
        values = np.zeros(len(images))
        if not np.any(images):  # the start's check, on blank images (in one call or several)
            return values
        calls["n"] += 1
        # eval at 0, iterations 0 and 1 are fine, then NaN
        if calls["n"] > 3:
            values[0] = np.nan
        return values

    registry.register("test_flaky", flaky, on_host=True, overwrite=True)
    c = small_config("treegrpo")
    c.rewards = "test_flaky"
    c.reward_options.decode_chunks = 1  # one call per batch, as counted
    c.train.iterations = 5
    c.eval.every = 0
    c.checkpoint.every = 0
    with pytest.raises(train.RewardError, match="non-finite value") as info:
        train.train(c, str(tmp_path))
    assert "\n" not in str(info.value)
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 2


@pytest.mark.slow
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
    # an equal step built earlier in this process is reused, with the programs it holds
    step_programs = trainer.train_step._cache_size()
    starts = []
    with count_compiles() as compiles:
        for iteration in range(4):  # window positions 0, 1, 2, 3
            state, metrics = trainer.iteration(state, iteration)
            starts.append(metrics["window_start"])
    assert starts == [0, 1, 2, 3]
    assert compiles["_rollout"] == 1
    assert trainer.train_step._cache_size() <= step_programs + 1


def _adam_count(state) -> int:
    """How many updates Adam has applied (its moment estimates' step count)."""
    return int(optax.tree_utils.tree_get(state.opt_state, "count"))


def _one_iteration(c, workdir):
    trainer, state = train.setup(c, str(workdir))
    before = jax.device_get(state.params)
    state, metrics = trainer.iteration(state, 0)
    return before, jax.device_get(state.params), metrics, _adam_count(state)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        _, images, rewards, _ = trainer.evaluator.evaluate_samples(state.params)
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
