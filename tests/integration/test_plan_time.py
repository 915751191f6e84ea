"""`plan`'s time figures: how often each program runs in an iteration, counted by hand from
the tree; the roofline's seconds against the accelerator's figures; `--compare`'s rows per
leaf, counted by hand for a tree and for flat chains."""

import math
import re

import pytest
from test_plan import TINY, plan_json, run_plan

# TINY's tree: 4 steps, a window of 2 BRANCH(2) steps at the start, ODE after: 1 + 2 parent
# rows trained per prompt; 1 + 2 + 4 + 4 denoiser rows rolled out per prompt, for 4 leaves.
TRAIN_ROWS_PER_PROMPT = 3
ROLLOUT_ROWS_PER_PROMPT = 11
LEAVES = 4
PROMPTS, ROWS_PER_MINIBATCH = 2, 4


@pytest.fixture(scope="module")
def tiny_plan():
    return plan_json(*TINY, "--accelerator=h100,tpu-v5p")


def test_each_program_runs_as_often_as_the_iteration_calls_it(tiny_plan):
    h100, v5p = tiny_plan["time"]
    assert [h100["accelerator"]["name"], v5p["accelerator"]["name"]] == ["h100", "tpu-v5p"]
    calls = {name: p["calls_per_iteration"] for name, p in h100["programs"].items()}
    minibatches = math.ceil(TRAIN_ROWS_PER_PROMPT * PROMPTS / ROWS_PER_MINIBATCH)
    eval_every = 5  # configs/tiny.py
    assert calls == {
        "rollout": 1,
        "train_step": minibatches,
        "evaluate": 1 / eval_every,
        "decode": 1,
    }
    for name, program in h100["programs"].items():
        cost = tiny_plan["programs"][name]
        assert cost["flops"] >= cost["xla_flops"] > 0
        if name == "rollout":  # the ODE steps after the window: a loop of unknown trips
            assert None in cost["loops"] and program["flops"] > cost["flops"]
        else:
            assert program["flops"] == cost["flops"]
    # the evaluation's sampler is a scan over its 4 steps: XLA alone counts one of them
    evaluate = tiny_plan["programs"]["evaluate"]
    assert evaluate["flops"] == pytest.approx(4 * evaluate["xla_flops"], rel=0.01)


def test_seconds_are_the_roofline_over_the_efficiency(tiny_plan):
    for plan in tiny_plan["time"]:
        a = plan["accelerator"]
        total = 0.0
        for p in plan["programs"].values():
            # planned on a CPU: its bytes are not the target's, and only the FLOPs bound
            assert p["bytes_counted"] is False and p["bound"] == "flops"
            assert p["memory_seconds"] == pytest.approx(p["bytes_accessed"] / a["bandwidth"])
            bound = p["flops"] / a["peak_flops"]
            assert p["estimate_seconds"] == pytest.approx(bound / plan["efficiency"])
            total += p["calls_per_iteration"] * p["estimate_seconds"]
        assert plan["seconds_per_iteration"] == pytest.approx(total)
        assert plan["hours"] == pytest.approx(total * plan["iterations"] / 3600)
        assert plan["measured"] is False
    h100 = tiny_plan["time"][0]
    assert (h100["accelerator"]["peak_flops"], h100["accelerator"]["bandwidth"]) == (
        989e12,
        3.35e12,
    )


def test_the_flags_change_the_figures_they_name():
    plan = plan_json(
        *TINY,
        "--programs=evaluate",
        "--accelerator=custom",
        "--peak_tflops=1",
        "--bandwidth=1000",
        "--efficiency=0.5",
    )
    (time,) = plan["time"]
    evaluate = time["programs"]["evaluate"]
    assert evaluate["estimate_seconds"] == pytest.approx(evaluate["flops"] / 1e12 / 0.5)
    assert evaluate["memory_seconds"] == pytest.approx(evaluate["bytes_accessed"] / 1e15)
    assert "rollout, decode, train_step (not compiled)" in time["not_counted"][0]


def test_compare_counts_rows_per_leaf_and_ratios():
    result = run_plan(*TINY, "--compare=treegrpo,grpo", "--programs=rollout,train_step")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("runs compared on 1 device, each at the setting named below it")
    # a method name swaps the method alone; the config file that holds its own setting is named
    assert "grpo: configs/tiny.py with tree.method=grpo, its other settings kept." in lines
    assert (
        "grpo has a config of its own beside configs/tiny.py: configs/tiny_grpo.py "
        "(--compare=configs/tiny.py,configs/tiny_grpo.py compares the two files' own settings)."
    ) in lines
    tree = re.split(r"\s{2,}", next(line for line in lines if line.startswith("treegrpo ")))
    flat = re.split(r"\s{2,}", next(line for line in lines if line.startswith("grpo ")))
    # treegrpo: 11 rollout rows and 3 trained parent rows for 4 leaves
    assert tree[1:4] == [
        str(LEAVES),
        f"{ROLLOUT_ROWS_PER_PROMPT / LEAVES:.2f}",
        f"{TRAIN_ROWS_PER_PROMPT / LEAVES:.2f}",
    ]
    assert tree[4] == "1.00" and tree[7] == tree[9] == "1.00"  # one reward call per leaf
    # grpo (configs/tiny.py's group of 16 chains): every chain rolls and trains all 4 steps
    assert flat[1:4] == ["16", "4.00", "4.00"]
    assert float(flat[7]) > 1  # more rows per iteration than the tree's


def test_compare_of_config_files_keeps_each_files_settings():
    result = run_plan(
        *TINY, "--compare=configs/tiny.py,configs/tiny_grpo.py", "--programs=rollout", "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    out = json.loads(result.stdout)
    names = [row["run"] for row in out["compared"][0]]
    overrides = ", with this command line's --config.* overrides"  # TINY's
    assert out["settings"] == {n: f"configs/{n}.py's own settings{overrides}" for n in names}
    # tiny_grpo's own group of chains (configs/tiny_grpo.py), not tiny.py's tree
    assert [row["leaves"] for row in out["compared"][0]] == [LEAVES, 16]
