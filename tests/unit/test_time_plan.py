"""The time plan's arithmetic on made-up program costs: which bound applies, how often each
program runs, the sliding window's trip counts averaged over the run."""

import pytest
from small_configs import small_config

from tree_grpo_jax.plan import accelerators, time_plan, time_table
from tree_grpo_jax.plan.program_cost import Loop, ProgramCost

H100 = accelerators.ACCELERATORS["h100"]


def _cost(flops, bytes_accessed, loops=()):
    return ProgramCost(flops, 0.0, bytes_accessed, flops, loops)


def test_the_longer_of_compute_and_memory_bounds_a_target_compile():
    config = small_config("treegrpo")
    costs = {
        "rollout": _cost(989e12, 1e9),  # 1 s of compute, 0.3 ms of memory
        "decode": _cost(1e9, 3.35e12),  # 1 s of memory
        "train_step": _cost(2 * 989e12, 0),
    }
    plan = time_plan.plan_time(config, costs, 1, H100, efficiency=0.5, bytes_counted=True)
    by_name = {p.name: p for p in plan.programs}
    assert by_name["rollout"].bound == "compute" and by_name["decode"].bound == "memory"
    assert by_name["rollout"].estimate_s == pytest.approx(2.0)
    assert by_name["decode"].estimate_s == pytest.approx(2.0)
    # the CPU's bytes: the decode is timed by its FLOPs alone
    cpu = time_plan.plan_time(config, costs, 1, H100, efficiency=0.5, bytes_counted=False)
    assert {p.name: p for p in cpu.programs}["decode"].estimate_s == pytest.approx(2e9 / 989e12)
    assert any("memory traffic" in line for line in cpu.not_counted)
    assert any("evaluate (not compiled)" in line for line in plan.not_counted)


def test_updates_and_evaluations_per_iteration():
    config = small_config("grpo")  # 4 chains of 4 steps: 16 rows per prompt, 2 prompts
    config.train.rows_per_minibatch = 6
    config.train.inner_epochs = 2
    config.train.updates_per_iteration = 2
    config.eval.every = 4
    calls = time_plan.calls_per_iteration(config)
    assert calls["train_step"] == calls["accumulate"] == 2 * 6  # ceil(32 / 6) per epoch
    assert calls["apply"] == 2
    assert calls["evaluate"] == 0.25
    config.eval.every = 0
    assert time_plan.calls_per_iteration(config)["evaluate"] == 0


def test_a_sliding_window_averages_the_moving_loops():
    config = small_config("treegrpo")
    config.sampling.num_steps = 5  # a window of 2: positions 0..3
    config.tree.window_slide_every = 1
    config.train.iterations = 8  # every position twice
    per_trip = (10.0, 0.0, 1.0)
    loops = (Loop("before", None, 1, per_trip), Loop("after", None, 1, per_trip))
    cost = time_plan.rollout_cost(config, _cost(100.0, 0.0, loops))
    # the ODE steps before the window run 0, 1, 2, 3 times; after it 3, 2, 1, 0 times: a mean
    # of 1.5 each, counted once already
    assert cost.flops == pytest.approx(100.0 + 2 * (1.5 - 1) * 10.0)


def test_accelerator_figures_and_bad_names():
    assert accelerators.accelerator("tpu-v5p").peak_flops == 459e12
    assert accelerators.accelerator("H100") == H100
    custom = accelerators.accelerator("custom", 100.0, 2.0)
    assert (custom.peak_flops, custom.bandwidth) == (100e12, 2e12)
    assert accelerators.accelerator("h100", peak_tflops=500.0).bandwidth == H100.bandwidth
    with pytest.raises(ValueError, match="unknown accelerator 'v100'"):
        accelerators.accelerator("v100")


def test_node_rewards_add_decodes_and_reward_calls_priced_like_denoiser_rows():
    """The small tree [B2 B2 O O] with guidance, 2 prompts: per prompt 4 leaves and, at the
    branch points, 1 + 2 node estimates; the rollout runs 2 + 4 + 8 + 8 = 22 denoiser rows
    per prompt (guidance doubles each node's). Every decode is a reward call."""
    config = small_config("treegrpo")
    costs = {"rollout": _cost(989e12, 0.0), "decode": _cost(1e9, 0.0)}
    plain = time_plan.plan_time(config, costs, 1, H100, efficiency=0.5)
    assert plain.reward_calls == 8 and plain.node_reward_calls == 0
    assert time_plan.calls_per_iteration(config)["decode"] == 1.0
    config.advantage.node_rewards = "branch_points"
    assert time_plan.calls_per_iteration(config)["decode"] == pytest.approx(1 + 6 / 8)
    plan = time_plan.plan_time(config, costs, 1, H100, efficiency=0.5)
    assert (plan.reward_calls, plan.node_reward_calls, plan.rollout_rows) == (14, 6, 44)
    # the rollout's 2 s over its 44 rows, 14 times
    assert plan.reward_calls_as_rows_s == pytest.approx(14 * 2.0 / 44)
    assert plan.reward_calls_per_leaf == pytest.approx(14 / 8)
    assert "14 per iteration (8 leaves, 6 node estimates)" in time_table.table(plan)
