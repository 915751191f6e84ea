"""The trainer end to end on the tiny architecture with random weights: the forward-process
methods on a tree, and a run killed mid-way resuming exactly for a PPO method and for each
method that keeps an old policy or an EMA copy in its state. (Apart from test_train.py so that
the suite's workers can run the two modules side by side.)"""

import json
import os

import jax
import numpy as np
import pytest
from small_configs import small_config

from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.checkpoint import Checkpointer
from tree_grpo_jax.run.train_step import old_params


def flow_config(method: str):
    """A small run on a flow model, no guidance."""
    c = small_config(method)
    c.model.name = "random_tiny_flow"
    c.sampling.guidance_scale = 1.0
    return c


def nft_config(method: str = "diffusion_nft"):
    """A small DiffusionNFT run."""
    c = flow_config(method)
    c.diffusion_nft.old_policy_rate = 0.25  # the old policy's decay moves within the run
    return c


def awm_config(method: str = "awm"):
    """A small off-policy AWM run: the EMA copy samples, anchors the ratio and moves."""
    c = flow_config(method)
    c.awm.train_timesteps = 2  # strata of [1, int(4 * 0.9)) = [1, 3)
    c.awm.off_policy = True
    c.awm.ema_decay_rate = 0.25
    return c


def dgpo_config():
    """A small DGPO run that samples with its EMA copy from the second iteration on."""
    c = flow_config("dgpo")
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


@pytest.mark.parametrize(
    "method",
    [
        pytest.param("grpo", marks=pytest.mark.slow),  # test_train.py trains it; this resumes it
        pytest.param("diffusion_nft", marks=pytest.mark.slow),
        pytest.param("awm", marks=pytest.mark.slow),
        "dgpo",  # the fast tier's killed-and-resumed run, and its DGPO run
    ],
)
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

    def dies_at(killed_at):
        def iteration_or_kill(trainer, state, iteration):
            if iteration == killed_at:
                raise SystemExit("killed")  # like a kill: nothing is saved on the way out
            return real_iteration(trainer, state, iteration)

        return iteration_or_kill

    # killed before the first checkpoint: the rerun starts afresh, its rows once
    monkeypatch.setattr(train.Trainer, "iteration", dies_at(1))  # after step 1
    with pytest.raises(SystemExit):
        train.train(c, str(crashed))
    assert Checkpointer(str(crashed / "checkpoints")).latest_step is None
    monkeypatch.setattr(train.Trainer, "iteration", dies_at(3))
    with pytest.raises(SystemExit):
        train.train(c, str(crashed))
    assert Checkpointer(str(crashed / "checkpoints")).latest_step == 2
    monkeypatch.setattr(train.Trainer, "iteration", real_iteration)
    train.train(c, str(crashed))  # same command, same workdir: resumes after iteration 2
    assert _logged(crashed) == _logged(straight)

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


def _logged(workdir):
    """Every row of metrics.jsonl but its timings."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "/time_" not in k} for row in rows]


def _initial_params(c):
    _, state = train.setup(c, "/tmp/unused")
    return jax.device_get((state.params, old_params(state)))
