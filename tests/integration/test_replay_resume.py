"""A run with `train.replay` resumes exactly: three iterations straight against two, a kill,
and the same command resuming for the third give the same weights, the same replay buffer
(saved beside the checkpoint, host_state/) and the same logged rows; the rows trained grow
with the buffer until it holds its N iterations, and the train step compiles once however
full the buffer is."""

import json
import os

import jax
import numpy as np
import pytest
from small_configs import small_config

from tree_grpo_jax.core.replay import ReplayBuffer
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.checkpoint import Checkpointer


def replay_config():
    c = small_config("grpo")
    c.train.replay = 1
    c.train.iterations = 3
    c.checkpoint.every = 2
    c.eval.every = 0
    c.prompts.eval_count = 2
    c.prompts.source = "digits"
    return c


def _logged(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "/time_" not in k} for row in rows]


def _saved(c, workdir, step):
    """(params, replay buffer) of checkpoint `step` in `workdir`."""
    _, state = train.setup(c, str(workdir))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    restored, _, _ = ckpt.restore(state, step)
    return jax.device_get(restored.params), ReplayBuffer.from_arrays(ckpt.read_host_arrays(step))


@pytest.mark.slow  # its programs compile for over a minute on a 2-core CPU
def test_a_killed_run_with_replay_resumes_with_the_same_buffer_and_weights(tmp_path, monkeypatch):
    c = replay_config()
    straight = tmp_path / "straight"
    train.train(c, str(straight))
    logged = [row for row in _logged(straight) if "train/train_rows" in row]
    fresh = logged[0]["train/train_rows"]
    # the buffer holds one iteration: the second and third train their own rows and the last
    assert [row["train/replayed_rows"] for row in logged] == [0, fresh, fresh]
    assert [row["train/train_rows"] for row in logged] == [fresh, 2 * fresh, 2 * fresh]

    crashed = tmp_path / "crashed"
    real_iteration = train.Trainer.iteration

    def iteration_or_kill(trainer, state, iteration):
        if iteration == 2:
            raise SystemExit("killed")  # like a kill: nothing is saved on the way out
        return real_iteration(trainer, state, iteration)

    monkeypatch.setattr(train.Trainer, "iteration", iteration_or_kill)
    with pytest.raises(SystemExit):
        train.train(c, str(crashed))
    assert Checkpointer(str(crashed / "checkpoints")).latest_step == 2
    monkeypatch.setattr(train.Trainer, "iteration", real_iteration)
    train.train(c, str(crashed))  # resumes after iteration 2 with the buffer it saved
    assert _logged(crashed) == _logged(straight)

    expected, expected_buffer = _saved(c, straight, 3)
    resumed, resumed_buffer = _saved(c, crashed, 3)
    jax.tree_util.tree_map(np.testing.assert_array_equal, expected, resumed)
    # the buffer after 3 iterations holds the third's rows alone (the first two dropped)
    assert [s.iteration for s in expected_buffer.slots] == [2]
    assert [s.iteration for s in resumed_buffer.slots] == [2]
    for a, b in zip(expected_buffer.slots, resumed_buffer.slots, strict=True):
        for x, y in zip(
            jax.tree_util.tree_leaves((a.rows, a.cond)),
            jax.tree_util.tree_leaves((b.rows, b.cond)),
            strict=True,
        ):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    assert expected_buffer.slots[0].rows.num_rows == fresh
    # the checkpoint after 2 iterations keeps the second's rows, the one it resumed with
    _, at_two = _saved(c, crashed, 2)
    assert [s.iteration for s in at_two.slots] == [1]


@pytest.mark.slow  # as above
def test_the_train_step_compiles_once_as_the_buffer_fills(tmp_path):
    from compiles import count_compiles

    c = replay_config()
    c.train.replay = 2
    trainer, state = train.setup(c, str(tmp_path))
    step_programs = trainer.train_step._cache_size()
    rows = []
    with count_compiles() as compiles:
        for iteration in range(4):  # the buffer holds 0, 1, 2, 2 iterations
            state, metrics = trainer.iteration(state, iteration)
            rows.append((metrics["train_rows"], metrics["replayed_rows"], metrics["minibatches"]))
    fresh = rows[0][0]
    assert [r[:2] for r in rows] == [(fresh * (1 + m), fresh * m) for m in (0, 1, 2, 2)]
    assert rows[2][2] > rows[0][2]  # more minibatches, one shape
    assert compiles["_rollout"] <= 1
    assert trainer.train_step._cache_size() <= step_programs + 1
