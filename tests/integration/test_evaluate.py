"""`python -m tree_grpo_jax.evaluate` on a short run that the guard stops: its table agrees
with the run's own evaluations, it continues from saved chunks, and bad input is one
sentence with exit status 2 and nothing written."""

import json
import os
import shutil

import numpy as np
import pytest
from in_process import run_in_process

# test_train.py's small_config("treegrpo") (its programs come from the session's compile
# cache), with a held-out metric and the guard on
RUN = [
    "--config=tests/defaults_config.py",
    "--config.model.name=random_tiny",
    "--config.prompts.batch_size=2",
    "--config.prompts.eval_count=4",
    "--config.eval.samples_per_prompt=2",
    "--config.sampling.num_steps=4",
    "--config.sampling.guidance_scale=2.0",
    "--config.tree.group_size=4",
    "--config.tree.window=2",
    "--config.tree.split_steps=(0, 2)",
    "--config.train.iterations=3",
    "--config.train.learning_rate=1e-3",
    "--config.train.clip_range=0.2",
    "--config.train.rows_per_minibatch=8",
    "--config.rewards=jpeg_compressibility",
    "--config.eval.extra_rewards=('digit_accuracy',)",
    "--config.eval.every=1",
    "--config.checkpoint.every=1",
    "--config.eval.guard.min_diversity_fraction=0.99",
    "--config.log.progress=False",
    "--config.log.tensorboard=False",
    "--config.compile_cache.enabled=False",
]


def _main():
    from tree_grpo_jax.cli import main

    return main


def _evaluate():
    from tree_grpo_jax.cli import evaluate

    return evaluate


def _read(*path, parse=json.load):
    with open(os.path.join(*path)) as f:
        return parse(f)


def _evals(workdir):
    rows = _read(workdir, "metrics.jsonl", parse=lambda f: [json.loads(line) for line in f])
    return {r["step"]: r for r in rows if "eval/reward_mean" in r}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("guarded") / "run")
    result = run_in_process(_main(), *RUN, f"--workdir={workdir}")
    return workdir, result


def test_the_guard_stops_the_run_with_one_line_and_status_0(stopped_run):
    workdir, result = stopped_run
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "stopped by the guard" in line]
    assert len(lines) == 1 and "done:" not in result.stdout
    evals = _evals(workdir)
    assert sorted(evals) == [0, 1]  # stopped at the first evaluation that fell below 0.99
    ratio = evals[1]["eval/diversity"] / evals[0]["eval/diversity"]
    assert ratio < 0.99
    best = max(evals, key=lambda s: (evals[s]["eval/reward_mean"], -s))
    assert lines[0].startswith(
        f"stopped by the guard after 1 iterations: diversity fell to {ratio:.2f} of its first"
    )
    assert f"the best checkpoint is step {best} " in lines[0]
    assert str(best) in os.listdir(os.path.join(workdir, "checkpoints"))
    assert evals[0]["eval/kl"] == 0.0 and evals[1]["eval/kl"] > 0  # the initial model's KL
    again = run_in_process(_main(), *RUN, f"--workdir={workdir}")
    assert again.returncode == 0 and "stopped earlier" in again.stdout
    assert sorted(_evals(workdir)) == [0, 1]


def test_evaluate_agrees_with_the_runs_evaluations_and_continues(stopped_run, tmp_path):
    workdir, _ = stopped_run
    out = str(tmp_path / "eval")
    args = (f"--workdir={workdir}", f"--out={out}", "--samples_per_prompt=2")
    result = run_in_process(_evaluate(), *args, "--prompts_per_chunk=3")
    assert result.returncode == 0, result.stderr[-2000:]
    table = _read(out, "evaluation.json")
    assert [r["label"] for r in table["rows"]] == ["base", "step 1"]
    assert table["metrics"] == ["jpeg_compressibility", "digit_accuracy"]
    evals = _evals(workdir)
    # the run's eval prompts and noises, split into chunks of 3 prompts (the last topped up)
    for row, step in zip(table["rows"], (0, 1)):
        e = evals[step]
        np.testing.assert_allclose(row["jpeg_compressibility"]["mean"], e["eval/reward_mean"])
        np.testing.assert_allclose(row["jpeg_compressibility"]["std"], e["eval/reward_std"])
        np.testing.assert_allclose(row["digit_accuracy"]["mean"], e["eval/digit_accuracy"])
        np.testing.assert_allclose(row["diversity"]["mean"], e["eval/diversity"], rtol=1e-5)
    np.testing.assert_allclose(table["rows"][1]["kl"]["mean"], evals[1]["eval/kl"], rtol=1e-4)
    md = _read(out, "evaluation.md", parse=lambda f: f.read())
    diff = table["rows"][1]["diversity"]["mean"] - table["rows"][0]["diversity"]["mean"]
    assert "| step 1 − base |" in md and f"{diff:+.4g}" in md
    from PIL import Image

    grid = Image.open(os.path.join(out, "grid_step_1.png"))
    assert grid.width > grid.height  # 4 prompts across, 2 noises down

    os.remove(os.path.join(out, "partial", "step_1-00001.npz"))
    again = run_in_process(_evaluate(), *args, "--prompts_per_chunk=3")
    assert again.returncode == 0, again.stderr[-2000:]
    progress = [line for line in again.stdout.splitlines() if "chunks) in" in line]
    assert len(progress) == 1 and progress[0].startswith("step 1: prompts 4-4 of 4")
    assert _read(out, "evaluation.json")["rows"][1:] == [{**table["rows"][1]}]


def test_evaluate_prints_the_run_folder_as_given(stopped_run, tmp_path):
    """A --workdir relative to the current folder is printed as given, as the other commands
    print their folders; evaluation.json keeps the run's absolute path."""
    from in_process import ROOT

    workdir = os.path.relpath(stopped_run[0], ROOT)  # the commands run from ROOT
    out = os.path.relpath(tmp_path / "eval", ROOT)
    result = run_in_process(
        _evaluate(), f"--workdir={workdir}", f"--out={out}", "--samples_per_prompt=1"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    said = f"evaluation of {workdir} -> {os.path.join(out, 'evaluation.md')}"
    assert said in result.stdout.splitlines()
    assert f" {stopped_run[0]}" not in result.stdout  # the relative path ends with it
    assert _read(tmp_path, "eval", "evaluation.json")["source"] == stopped_run[0]


@pytest.fixture
def no_checkpoint_run(stopped_run, tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    shutil.copy(os.path.join(stopped_run[0], "config.json"), run / "config.json")
    (run / "checkpoints").mkdir()
    return str(run)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "there is no run folder"),
        ("no_checkpoint", "there is no checkpoint in"),
        ("step", "there is no checkpoint 7 in"),
        ("metric", "unknown metric 'no_such_metric' in --metrics"),
        ("prompts", "has no prompts"),
        ("out", "cannot write to the output folder"),
        ("long prompt", "--prompts: prompt 'a b c d e f g h' has 8"),
        ("other config", "--config is not the config of the run in"),
        # the flags typed, not the config fields they set
        ("samples", "samples) needs about"),
        ("prompts name", "prompt"),  # a name longer than a file system's 255 bytes
    ],
)
def test_bad_input_is_one_sentence_and_writes_nothing(
    stopped_run, no_checkpoint_run, tmp_path, case, message
):
    workdir = stopped_run[0]
    out = tmp_path / "out"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    in_the_way = tmp_path / "file"
    in_the_way.write_text("x")
    long = tmp_path / "long.txt"
    long.write_text("a handwritten digit one\na b c d e f g h\n")
    two = tmp_path / "two.txt"
    two.write_text("a handwritten digit one\na handwritten digit two\n")
    # the run's config with another guidance scale: another run's config
    other = [a.replace("guidance_scale=2.0", "guidance_scale=3.0") for a in RUN]
    args = {
        "missing": [f"--workdir={tmp_path / 'nope'}"],
        "no_checkpoint": [f"--workdir={no_checkpoint_run}"],
        "step": [f"--workdir={workdir}", "--step=7"],
        "metric": [f"--workdir={workdir}", "--metrics=digit_accuracy,no_such_metric"],
        "prompts": [f"--workdir={workdir}", f"--prompts={empty}"],
        "out": [f"--workdir={workdir}", f"--out={in_the_way / 'eval'}"],
        "long prompt": [f"--workdir={workdir}", f"--prompts={long}"],
        "other config": [*other, f"--workdir={workdir}"],
        "samples": [f"--workdir={workdir}", f"--prompts={two}", f"--samples_per_prompt={10**10}"],
        "prompts name": [f"--workdir={workdir}", f"--prompts={tmp_path / ('x' * 300)}.txt"],
    }[case]
    if case != "out":
        args.append(f"--out={out}")
    result = run_in_process(_evaluate(), *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert message in errors[0] and "Traceback" not in result.stderr
    assert not out.exists() and not (in_the_way.parent / "eval").exists()
    if case == "samples":  # sampled a chunk at a time: --prompts_per_chunk's 2 prompts' worth
        assert errors[0].startswith("error: --prompts_per_chunk=2 (20,000,000,000 samples)")
        assert errors[0].endswith("lower --prompts_per_chunk or --samples_per_prompt."), errors[0]
    assert not any(f in errors[0] for f in ("eval.", "prompts.eval_count", "prompts.source"))


def test_a_damaged_newest_checkpoint_is_passed_over_as_training_does(stopped_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(stopped_run[0], copy, ignore=shutil.ignore_patterns("evaluation"))
    checkpoints = copy / "checkpoints"
    steps = sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())
    newest = steps[-1] + 1
    shutil.copytree(checkpoints / str(steps[-1]), checkpoints / str(newest))
    for path in (checkpoints / str(newest)).rglob("*"):  # every file cut to half its length
        if path.is_file():
            os.truncate(path, path.stat().st_size // 2)
    out = tmp_path / "out"
    result = run_in_process(
        _evaluate(), f"--workdir={copy}", f"--out={out}", "--samples_per_prompt=1"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings and warnings[0].startswith(f"warning: checkpoint {newest} ")
    rows = _read(out, "evaluation.json")["rows"]
    assert [r["label"] for r in rows] == ["base", f"step {steps[-1]}"]
    assert "move the folder away" not in result.stderr


# Two categories of the tiny model's prompts, as a DrawBench-like table.
CATEGORIES_CSV = (
    "Prompts,Category\n"
    "a handwritten digit zero,round\n"
    "a handwritten digit one,straight\n"
    "a handwritten digit eight,round\n"
    "a handwritten digit seven,straight\n"
)


def test_evaluate_per_category_and_normalised(stopped_run, tmp_path, monkeypatch):
    from tree_grpo_jax.evaluation import normalised

    # jpeg_compressibility (minus kilobytes) gets a ceiling for the test: 0 is above any base
    monkeypatch.setitem(normalised.R_MAX, "jpeg_compressibility", 0.0)
    prompts = tmp_path / "drawbench.csv"
    prompts.write_text(CATEGORIES_CSV)
    out = tmp_path / "eval"
    result = run_in_process(
        _evaluate(),
        f"--workdir={stopped_run[0]}",
        f"--out={out}",
        f"--prompts={prompts}",
        "--samples_per_prompt=2",
        "--prompts_per_chunk=3",
        "--normalised",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = _read(out, "evaluation.json")
    assert table["categories"] == {"round": 2, "straight": 2}
    names = ["jpeg_compressibility", "digit_accuracy"]
    for row in table["rows"]:
        label = row["label"].replace(" ", "_")
        # the saved chunks by hand: chunk 0 holds prompts 0-2, chunk 1 prompt 3, each
        # sample-major (noise 0 of every prompt, then noise 1)
        chunk0 = np.load(out / "partial" / f"{label}-00000.npz")
        chunk1 = np.load(out / "partial" / f"{label}-00001.npz")
        for name in names:
            a, b = chunk0[name], chunk1[name]
            by_prompt = {0: [a[0], a[3]], 1: [a[1], a[4]], 2: [a[2], a[5]], 3: [b[0], b[1]]}
            round_, straight = by_prompt[0] + by_prompt[2], by_prompt[1] + by_prompt[3]
            got = row["by_category"]
            np.testing.assert_allclose(got["round"][name]["mean"], np.mean(round_))
            np.testing.assert_allclose(got["round"][name]["std"], np.std(round_))
            np.testing.assert_allclose(got["straight"][name]["mean"], np.mean(straight))
            np.testing.assert_allclose(
                row[name]["mean"], np.mean([got[c][name]["mean"] for c in got])
            )
    base, trained = table["rows"]
    r0, r1 = base["jpeg_compressibility"]["mean"], trained["jpeg_compressibility"]["mean"]
    expected = (r1 - r0) / (0.0 - r0)
    scores = table["normalised"]
    assert scores["r_max"] == {"jpeg_compressibility": 0.0, "digit_accuracy": None}
    np.testing.assert_allclose(scores["rows"]["step 1"]["jpeg_compressibility"], expected)
    assert scores["rows"]["step 1"]["digit_accuracy"] is None
    md = _read(out, "evaluation.md", parse=lambda f: f.read())
    assert "jpeg_compressibility per category:" in md and "| round | 2 |" in md
    assert "| r_max | 0 | — |" in md and f"| step 1 | {expected:.4g} | — |" in md
    assert md in result.stdout  # printed as written


def test_normalised_without_a_checkpoint_is_one_sentence(tmp_path):
    out = tmp_path / "out"
    result = run_in_process(_evaluate(), "--config=configs/tiny.py", f"--out={out}", "--normalised")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "--normalised compares a checkpoint with the base model" in errors[0]
    assert not out.exists()


def test_out_of_memory_names_the_chunk_flags(stopped_run, tmp_path, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED while sampling a chunk: one line naming the flags that size
    a chunk, with their values, exit 1, and no output folder left."""
    import jax

    from tree_grpo_jax.run import eval_metrics

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3.1GiB.")

    monkeypatch.setattr(eval_metrics, "measure", exhausted)
    out = tmp_path / "out"
    args = (f"--workdir={stopped_run[0]}", f"--out={out}", "--prompts_per_chunk=3")
    result = run_in_process(_evaluate(), *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == [
        "error: the device ran out of memory (3.1GiB) evaluating the base model, 3 prompt(s) "
        "x 4 sample(s) at once; lower --prompts_per_chunk (now 3) or --samples_per_prompt "
        "(now 4)."
    ]
    assert not out.exists()


def test_prompts_of_its_own_need_no_prompt_file_of_the_run(stopped_run, tmp_path):
    """--prompts: the run's own prompt file (moved since, or on another machine) is not
    read; before, a missing one refused the evaluation."""
    copy = tmp_path / "run"
    shutil.copytree(stopped_run[0], copy, ignore=shutil.ignore_patterns("evaluation"))
    saved = json.loads((copy / "config.json").read_text())
    saved["prompts"]["source"] = str(tmp_path / "moved_away.txt")
    (copy / "config.json").write_text(json.dumps(saved))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a handwritten digit one\na handwritten digit two\n")
    out = tmp_path / "out"
    args = (f"--workdir={copy}", f"--prompts={prompts}", f"--out={out}", "--samples_per_prompt=1")
    result = run_in_process(_evaluate(), *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _read(out, "evaluation.json")["prompts"] == 2
