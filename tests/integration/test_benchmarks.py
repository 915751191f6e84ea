"""The benchmark suite's smoke paths: they run, write their files, and the counts they derive
from the tree specs equal the counts measured while the trainer runs. No timing is checked."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks import accelerator, costs, random_models, run
from benchmarks.common import PRESETS
from benchmarks.presets import Settings, make_config, minibatches_per_iteration
from tree_grpo_jax.plan import accelerators

SUITE_FILES = (
    "costs.json",
    "costs.png",
    "time_per_iteration.json",
    "time_per_iteration.png",
    "reward_vs_time.json",
    "reward_vs_time.png",
    "reward_vs_images.png",
    "engine_vs_node_loop.json",
    "engine_vs_node_loop.png",
    "suite.json",
    "tables.md",
)


def _load(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    info = run.main(["--smoke", "--out", str(out)])
    return str(out), info


@pytest.mark.slow
def test_smoke_suite_writes_every_file(smoke):
    out, info = smoke
    for name in SUITE_FILES:
        path = os.path.join(out, name)
        assert os.path.getsize(path) > 0, name
    with open(os.path.join(out, "tables.md")) as f:
        tables = f.read()
    for heading in ("Cost per leaf", "Time per iteration", "Reward vs wall-clock", "node-at-a"):
        assert heading in tables
    assert info["mode"] == "smoke"
    assert set(info["presets"]) == set(PRESETS)


@pytest.mark.slow
def test_derived_counts_equal_measured_counts(smoke):
    out, info = smoke
    results = _load(out, "costs.json")["presets"]
    assert set(results) == set(PRESETS)
    for name, r in results.items():
        assert r["all_match"], (name, r["expected"], r["measured"])
        assert r["expected"] == {k: r["measured"][k] for k in r["expected"]}
        d = r["derived_per_prompt"]
        assert d["leaves"] == 16
        # The rollout runs one denoiser call per step (each level one batch).
        assert r["measured"]["rollout_denoiser_calls"] == 10
    assert info["all_counts_match"]
    # Pruning trains fewer edges on the same rollout; the spec's unpruned count is the upper
    # bound.
    full = results["branchgrpo"]["measured"]
    for pruned in ("branchgrpo_depth", "branchgrpo_width"):
        m = results[pruned]["measured"]
        assert m["rollout_rows"] == full["rollout_rows"]
        assert m["trained_edges"] < full["trained_edges"]
        assert m["train_rows"] < full["train_rows"]


def test_cost_counts_by_hand():
    """A few counts worked out by hand (10 steps, 16 leaves, one prompt, no guidance)."""
    settings = Settings(model="standin")
    count = lambda preset: costs.derived_counts(make_config(preset, settings))
    assert count("grpo")["rollout_rows"] == 160 and count("grpo")["train_rows"] == 160
    tree = count("treegrpo")  # 1+2+4+8 branch parents, 16 ODE nodes for 6 steps
    assert (tree["rollout_rows"], tree["trained_edges"], tree["train_rows"]) == (111, 30, 15)
    branch = count("branchgrpo")  # levels 1,2,2,4,4,8,8,16,16,16
    assert (branch["rollout_rows"], branch["trained_edges"], branch["train_rows"]) == (77, 92, 77)
    depth = count("branchgrpo_depth")  # steps 7 and 8 (16 edges, 16 rows each) dropped
    assert (depth["trained_edges"], depth["train_rows"]) == (60, 45)
    width = count("branchgrpo_width")  # half of the 16 chains after step 6, for 3 steps
    assert (width["trained_edges"], width["train_rows"]) == (68, 53)
    mix = count("branchgrpo_mix")  # branch 0,2,4,6 and SDE 1,3
    assert (mix["trained_edges"], mix["train_rows"]) == (36, 21)
    nft = count("diffusion_nft")  # 16 ODE chains; each leaf at 9 sigmas, old + trained policy
    assert (nft["rollout_rows"], nft["train_rows"], nft["train_forward_rows"]) == (160, 144, 288)
    nft_tree = count("diffusion_nft_tree")  # treegrpo's rollout, the same rows
    assert (nft_tree["rollout_rows"], nft_tree["train_rows"]) == (111, 144)
    # forward-row equivalents: a row the gradient flows through costs 3, the old copy's 1
    assert costs.row_equivalents(count("grpo")) == 160 + 3 * 160
    assert costs.row_equivalents(tree, inner_epochs=2) == 111 + 2 * 3 * 15
    assert costs.row_equivalents(nft) == 160 + 288 + 2 * 144


def test_one_update_per_iteration():
    settings = Settings(model="standin")
    config = make_config("grpo", settings)  # 4 prompts x 160 rows in minibatches of 30
    assert minibatches_per_iteration(config) == 22
    assert config.train.grad_accumulation == 22


@pytest.mark.slow
def test_time_and_reward_results(smoke):
    out, _ = smoke
    times = _load(out, "time_per_iteration.json")["presets"]
    for r in times.values():
        assert r["time_iteration"]["n"] == run.MODES["smoke"]["iterations"]
    reward = _load(out, "reward_vs_time.json")
    budget = reward["budget_s"]
    for name, runs in reward["curves"].items():
        assert len(runs) == len(run.MODES["smoke"]["seeds"]), name
        for r in runs:
            clock = [p["time"] for p in r["curve"]]
            assert clock[0] == 0 and clock[-1] >= budget
            assert clock == sorted(clock)
            assert r["curve"][-1]["images"] == r["iterations"] * 64
    assert set(reward["time_to_reward"]["presets"]) == set(PRESETS)


@pytest.mark.slow
def test_engine_and_node_loop_agree(smoke):
    out, info = smoke
    trees = _load(out, "engine_vs_node_loop.json")["trees"]
    r = trees["treegrpo"]
    assert r["same_leaves"]
    assert r["loop_denoiser_calls"] == 111 * 4  # every node of 4 prompts' trees, one by one
    assert r["engine_denoiser_calls"] == 10  # one batched call per level
    assert info["same_leaves"]


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def accelerator_smoke(tmp_path_factory):
    """The accelerator benchmark's dry run: a tiny version of every model of its table."""
    out = tmp_path_factory.mktemp("accelerator")
    # No time limit that a loaded machine could reach: the test checks every section runs.
    args = ["--smoke", "--out", str(out), "--peak-tflops", "1", "--time-limit", "7200"]
    results = accelerator.main(args)
    with open(os.path.join(out, "accelerator.md")) as f:
        table = f.read()
    return results, _load(out, "accelerator.json"), table


def _measured() -> list[str]:
    return [a.name for a in random_models.ARCHITECTURES if a.build]


@pytest.mark.slow
def test_accelerator_smoke_runs_every_section_of_every_model(accelerator_smoke):
    results, saved, _ = accelerator_smoke
    assert saved["models"].keys() == results["models"].keys()
    assert {"sd15", "sd35m"} <= set(_measured())
    for name in _measured():
        sections = saved["models"][name]["sections"]
        assert _positive(sections["flops"]["denoiser_flops_per_row"]), name
        for method in accelerator.METHODS:
            r = sections["rollout"][method]
            assert r["leaves"] == accelerator.SMOKE_LEAVES * saved["prompts"], (name, method)
            fields = ("seconds_per_tree", "denoiser_rows_per_s", "images_per_s", "mfu")
            for field in (*fields, "predicted_s", "measured_over_predicted"):
                assert _positive(r[field]), (name, method, field, r.get(field))
            assert "memory_after" in r  # None on a CPU
        assert _positive(sections["rollout"]["treegrpo"]["time_vs_grpo"]), name
        for method in accelerator.TRAINED:
            r = sections["train"][method]
            for field in ("seconds_per_row", "train_step_flops", "mfu", "edges_per_s"):
                assert _positive(r[field]), (name, method, field, r.get(field))
            # the prediction is the same FLOPs at the peak's default share: 1 TFLOP/s here
            predicted = r["train_step_flops"] / (1e12 * accelerators.DEFAULT_EFFICIENCY)
            assert r["predicted_s"] == pytest.approx(predicted)
            assert _positive(r["program_memory"]["peak_bytes"]), name
        loop = sections["node_loop"]
        assert loop["same_leaves"] and _positive(loop["speedup_of_medians"]), name
    r = saved["sections"]["rewards"][accelerator.SMOKE_TOWER]
    assert _positive(r["images_per_s"]) and _positive(r["prompts_per_s"])


@pytest.mark.slow
def test_accelerator_smoke_markdown_has_every_model(accelerator_smoke):
    _, saved, table = accelerator_smoke
    assert "error" not in table and accelerator.SMOKE_TOWER in table
    for arch in random_models.ARCHITECTURES:
        row = next(line for line in table.splitlines() if line.startswith(f"| {arch.title} |"))
        if arch.build is None:  # an architecture the library does not have yet
            assert "owed" in row and saved["models"][arch.name]["owed"] in row, row
            continue
        cells = row.split(" | ")  # seconds per tree (treegrpo / grpo), their ratio, train
        assert all(_positive(float(v)) for v in cells[3].split(" / ")), row
        assert _positive(float(cells[4])), row
        assert _positive(float(cells[5].split(" / ")[0])), row


@pytest.mark.slow
def test_replot_rebuilds_the_same_tables(smoke):
    out, _ = smoke
    with open(os.path.join(out, "tables.md")) as f:
        before = f.read()
    os.remove(os.path.join(out, "reward_vs_time.png"))
    run.main(["--replot", out])
    with open(os.path.join(out, "tables.md")) as f:
        assert f.read() == before
    assert os.path.getsize(os.path.join(out, "reward_vs_time.png")) > 0


def test_lora_counts_at_real_sizes():
    """LoRA's default targets at SD1.5's and SD3.5-Medium's real sizes (shapes only): every
    attention projection of SD1.5's 16 transformer blocks (2 attentions x 4), and SD3.5's 24
    joint blocks x 8 projections less the last block's missing context output."""
    from benchmarks import lora as lora_bench

    sd15 = lora_bench.counts("sd", lora_bench.sd15_shapes())
    sd35 = lora_bench.counts("sd3", lora_bench.sd35m_shapes())
    assert sd15["adapted_kernels"] == 16 * 2 * 4
    assert sd35["adapted_kernels"] == 24 * 8 - 1
    assert 850e6 < sd15["base_params"] < 870e6  # SD1.5's UNet: 860M
    for row in (sd15, sd35):
        assert row["rank_32"]["trainable_params"] == 8 * row["rank_4"]["trainable_params"]
        assert row["rank_4"]["optimizer_state_bytes"] == 8 * row["rank_4"]["trainable_params"]


def test_every_study_setting_is_a_valid_config_with_its_overrides():
    """The sample-efficiency study's groups name only its settings, and each setting's config
    passes the trainer's validation and carries its overrides (no training: that is the
    study's own --smoke run)."""
    from benchmarks import tree_study
    from tree_grpo_jax import config as config_lib
    from tree_grpo_jax.rewards import registry

    for group, names in tree_study.GROUPS.items():
        assert set(names) <= set(tree_study.SETTINGS), group
    settings = Settings()
    for name, setting in tree_study.SETTINGS.items():
        c = tree_study.config_of(name, settings)
        config_lib.validate(c, known_rewards=registry.available_rewards())
        assert c.tree.method == setting.preset
        for path, value in setting.overrides:
            section, field = path.split(".")
            assert c[section][field] == value, (name, path)
    lr = tree_study.config_of("treegrpo_lr2e-4", settings)
    assert lr.train.learning_rate == 2 * settings.learning_rate
    assert lr.train.inner_epochs == 1


@pytest.mark.slow
def test_reward_overlap_smoke_writes_both_ways_of_scoring(tmp_path):
    """`benchmarks.reward_overlap --smoke`: a VAE decode and a served reward with a latency,
    timed after decoding and overlapped, both figures positive and the parts as asked."""
    import json

    from benchmarks import reward_overlap

    assert reward_overlap.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "reward_overlap.json").read_text())
    (row,) = record["rows"]
    assert row["parts"] == 2 and row["requests"] == 1
    for name in ("decode_s", "score_s", "after_decoding_s", "overlapped_s"):
        assert row[name] > 0, name
    assert row["score_s"] >= row["latency_s"]  # the server's sleep is inside every request


def _study_run(seed: int, start: float, gain: float) -> dict:
    """One made-up run of the tree study: 4 evaluations, 64 images and 1000 rows apart."""
    curve = [
        {"reward": start + gain * k / 3, "accuracy": 1.0, "images": 64 * k, "time": 2.0 * k}
        | {"rows": 1000.0 * k, "decodes": 64 * k}
        for k in range(4)
    ]
    return {
        "seed": seed,
        "curve": curve,
        "iterations": 3,
        "iteration_times": [2.0] * 3,
        "clip_fractions": [0.0] * 3,
    }


def test_study_report_uses_the_seeds_every_setting_has_finished(tmp_path):
    """A study still running (grpo on seeds 0 and 1, the tree on seed 0 only) reports seed
    0 alone; a reward that some setting has not started is left out, not failed on."""
    from benchmarks import tree_study

    payload = {
        "mode": {"budget": 100.0, "iterations": 3},
        "rewards": {
            "r": {
                "curves": {
                    "grpo": [_study_run(0, 0.0, 1.0), _study_run(1, 5.0, 9.0)],
                    "treegrpo": [_study_run(0, 0.0, 2.0)],
                }
            },
            "unstarted": {"curves": {"grpo": [_study_run(0, 0.0, 1.0)], "treegrpo": []}},
        },
    }
    text = tree_study.report(payload, str(tmp_path), "t")
    assert "### r" in text and "unstarted" not in text
    summary = payload["rewards"]["r"]["summary"]
    assert summary["start_reward"] == 0.0  # seed 1's start (5.0) is not in the median
    assert summary["settings"]["grpo"]["final_reward"]["median"] == 1.0
    # halfway from the start to the best final reward (2.0): grpo at the end, the tree at
    # half of it, in images and in forward rows
    to = {n: s["to"]["gap50"] for n, s in summary["settings"].items()}
    assert (to["grpo"]["images"], to["treegrpo"]["images"]) == (192, 96)
    assert (to["grpo"]["rows"], to["treegrpo"]["rows"]) == (3000, 1500)
    assert (tmp_path / "tree_study_t.md").read_text().startswith("### r")
    # the cost table: grpo's images over the tree's, seed by seed, to 50% (80%: 2.4 of a
    # gain of 2.0 is reached by the tree alone)
    lines = tree_study.cost_table(summary, {}, ("grpo", "absent")).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == 2 + 2 * 5 + 1
    tree = next(line for line in lines if line.startswith("| treegrpo"))
    cells = [c.strip() for c in tree.strip("|").split("|")]
    # rows + calls: each of the 96 decodes priced like a forward row
    assert cells[2:7] == ["96 (1/1)", "1500", "96", "1596", "2.00"]
    assert cells[7] == "154 (1/1)" and cells[11] == "-"  # grpo never reaches 80%
    # the verdict: fewer images than every reference that gets there (grpo never reaches
    # 80%, so the tree alone does), half of grpo's rows to 50%, one decode per image
    verdict = tree_study.verdict({"r": summary}, ("grpo",))
    assert verdict["treegrpo"]["fewer_images"] == {"gap50": ["r"], "gap80": ["r"]}
    assert verdict["treegrpo"]["rows"]["gap50"] == {"r": 2.0}
    assert verdict["treegrpo"]["decodes_per_image"] == 1.0


def test_a_resumed_study_keeps_the_runs_of_seeds_it_does_not_rerun():
    """`--resume --seeds 2` on a file with seeds 0 and 1: both stay, seed 2 is to do for
    every setting but the one that has it; a setting the file lacks is to do."""
    from benchmarks import tree_study

    old = {
        "grpo": [{"seed": 0}, {"seed": 1}],
        "treegrpo": [{"seed": 1}, {"seed": 2}, {"seed": 0}],
        "dropped": [{"seed": 0}],  # a setting no longer in the group
    }
    curves, todo = tree_study.resumed(old, ("grpo", "treegrpo", "new"), (2,))
    assert [r["seed"] for r in curves["grpo"]] == [0, 1]
    assert sorted(r["seed"] for r in curves["treegrpo"]) == [0, 1, 2]
    assert curves["new"] == [] and "dropped" not in curves
    assert todo == [(2, "grpo"), (2, "new")]


def test_reuse_takes_only_runs_of_the_same_settings_and_mode(tmp_path):
    """`--reuse`: runs of a setting defined alike in another study's file join this one's
    (seeds it already has are kept as they are); a setting defined otherwise, or a file of
    another mode, gives none; an unreadable file is one sentence."""
    import json

    from benchmarks import tree_study

    mode = {"model": "tiny_flow", "iterations": 16, "rewards": ["r"]}
    payload = {"mode": mode, "settings": {"a": {"preset": "grpo"}, "b": {"preset": "treegrpo"}}}
    other = {
        "mode": {**mode, "budget": 3000.0, "rewards": ["r", "s"]},
        "settings": {"a": {"preset": "grpo"}, "b": {"preset": "mixgrpo"}},
        "rewards": {
            "r": {"curves": {"a": [{"seed": 0}, {"seed": 1}], "b": [{"seed": 0}]}},
            "s": {"curves": {"a": [{"seed": 0}]}},  # a reward this study does not run
        },
    }
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    done = {"r": {"curves": {"a": [{"seed": 1, "mine": True}]}}}
    got = tree_study.reused_runs(str(path), payload, done)
    assert got["r"]["curves"]["a"] == [{"seed": 1, "mine": True}, {"seed": 0}]
    assert "b" not in got["r"]["curves"] and "s" not in got
    path.write_text(json.dumps({**other, "mode": {**mode, "iterations": 8}}))
    with pytest.raises(SystemExit, match="its mode differs in iterations"):
        tree_study.reused_runs(str(path), payload, {})
    path.write_text("{trunc")
    with pytest.raises(SystemExit, match="cannot read it as a study's JSON"):
        tree_study.reused_runs(str(path), payload, {})
