"""What the commands say to a new user's slips and to hostile input: `--help` everywhere,
config and model paths that are not there, and the sentences that must name the right
setting; each through the command line (the in-process helper where no signal or pipe is
involved)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from in_process import one_error_line, run_main

ROOT = Path(__file__).resolve().parents[2]


def _command(*args, cwd=ROOT, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env=env, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("command", ["main", "plan", "evaluate", "sample", "export"])
def test_help_exits_0_with_the_commands_text(command):
    result = _command(f"tree_grpo_jax.{command}", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"tree_grpo_jax.{command}" in result.stdout  # its usage line
    assert "--workdir" in result.stdout
    assert result.stdout.startswith(f"usage: python -m tree_grpo_jax.{command} ")  # one shape
    if command in ("main", "plan", "evaluate"):  # the shared flags and the command's
        assert "--config FILE" in result.stdout and "--print_config" in result.stdout


def test_config_without_py_gets_the_file_it_meant():
    line = one_error_line(run_main("--config=configs/tiny"))
    assert line.endswith("did you mean --config=configs/tiny.py?"), line


def test_relative_config_from_another_folder_gets_the_repositorys_path(tmp_path):
    result = _command("tree_grpo_jax.main", "--config=configs/tiny.py", cwd=tmp_path)
    line = one_error_line(result)
    assert f"(from {tmp_path})" in line
    assert line.endswith(f"the repository's one is --config={ROOT / 'configs' / 'tiny.py'}."), line
    assert not list(tmp_path.iterdir())


def test_missing_local_model_path_says_the_folder_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_sd15"
    line = one_error_line(
        run_main("--config=configs/sd15.py", f"--config.model.path={missing}",
                 f"--workdir={tmp_path / 'run'}")
    )  # fmt: skip
    assert f"model path {missing} does not exist (no such folder)" in line, line
    assert "Repo id" not in line and "--config.model.path" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_plan_json_into_a_closed_pipe_exits_quietly(tmp_path):
    """`plan --json | head -c 10`: the reader is gone before the plan is printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.plan", "--config=configs/tiny.py", "--json",
         "--programs=decode"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    process.stdout.close()  # as `head` does once it has its bytes
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 0, stderr[-2000:]
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-2000:]


def _into_a_full_disk(*args) -> subprocess.CompletedProcess:
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", *args], cwd=ROOT, stdout=full, stderr=subprocess.PIPE,
            text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_print_config_into_a_full_disk_is_one_sentence():
    result = _into_a_full_disk("tree_grpo_jax.main", "--config=configs/tiny.py", "--print_config")
    line = one_error_line(result, status=1)
    assert line == "error: could not write the output to stdout: No space left on device.", line


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_plan_json_into_a_full_disk_is_one_sentence():
    """`plan --json > /dev/full`: stdout refuses the plan; one line, exit 1, no traceback."""
    result = _into_a_full_disk(
        "tree_grpo_jax.plan", "--config=configs/tiny.py", "--json", "--programs=decode"
    )
    line = one_error_line(result, status=1)
    assert line == "error: could not write the output to stdout: No space left on device.", line
    assert "Exception ignored" not in result.stderr, result.stderr[-2000:]


def test_a_20mb_prompt_is_not_echoed_whole(tmp_path):
    prompts = tmp_path / "huge.txt"
    prompts.write_text("a photo of " + "x" * 20_000_000 + "\n")
    workdir = tmp_path / "run"
    line = one_error_line(
        run_main("--config=configs/tiny.py", f"--config.prompts.source={prompts}",
                 f"--workdir={workdir}")
    )  # fmt: skip
    assert len(line) < 400, len(line)
    assert "'a photo of xxx" in line and "(20,000,011 characters)" in line, line
    assert not workdir.exists()


def test_any_error_line_is_cut_at_its_limit():
    from tree_grpo_jax.errors import LINE_LIMIT, first_line

    line = first_line(ValueError("y " * 25_000 + "\nsecond line"))
    assert line.startswith("y " * (LINE_LIMIT // 2) + "... ") and len(line) < LINE_LIMIT + 60
    assert line.endswith("(a line of 50,000 characters, cut)")
    # a word that long is user input: its start and its length
    line = first_line(ValueError("bad value '" + "y" * 50_000 + "'.\nsecond line"))
    assert line == f"bad value '{'y' * 59}...' (50,001 characters).", line


def test_a_symlink_loop_workdir_is_named_as_such(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for workdir in (loop, loop / "sub"):
        line = one_error_line(run_main("--config=configs/tiny.py", f"--workdir={workdir}"))
        assert f"{loop} is a symbolic link that leads nowhere (a loop" in line, line
        assert "File exists" not in line
    assert [p.name for p in tmp_path.iterdir()] == ["loop"]


# ---------------------------------------------------------------------------------------------
# export


@pytest.fixture(scope="module")
def sd15_base(tmp_path_factory):
    """A tiny SD1.5 folder (written without torch) and its UNet params as a msgpack file."""
    import jax.numpy as jnp
    from flax import serialization

    from launch import tiny_folders as tiny
    from tree_grpo_jax.models.sd15.load import load_unet

    root = tmp_path_factory.mktemp("sd15_base")
    base = tiny.write_folder("sd15", root / "sd15")
    params = root / "unet.msgpack"
    params.write_bytes(serialization.to_bytes(load_unet(base / "unet", jnp.float32)[1]))
    return base, params


def _export(capsys, *args) -> tuple[int, str]:
    from tree_grpo_jax.cli import export

    code = export.main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip()


def test_export_config_values_of_the_wrong_type_are_one_sentence(sd15_base, tmp_path, capsys):
    import json
    import shutil

    base, params = sd15_base
    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    config = json.loads((bad / "unet/config.json").read_text())
    config["layers_per_block"] = "two"
    (bad / "unet/config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code, err = _export(capsys, f"--params={params}", f"--model_path={bad}", f"--out={out}")
    assert code == 2 and err == (
        f"error: {bad}/unet/config.json sets layers_per_block='two', but it must be a whole "
        "number (or a list of them)."
    )
    assert not out.exists()


def test_export_names_its_own_model_path_flag(sd15_base, tmp_path, capsys):
    _, params = sd15_base
    missing = tmp_path / "no_base"
    code, err = _export(capsys, f"--params={params}", f"--model_path={missing}",
                        f"--out={tmp_path / 'out'}")  # fmt: skip
    assert code == 2 and err.startswith(f"error: model folder {missing} does not exist")
    assert "--model_path" in err and "--config.model.path" not in err and "Repo id" not in err


def test_export_out_that_cannot_be_made_is_said_before_the_model_is_read(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # no params and no base at all: the destination is checked first
    code, err = _export(
        capsys,
        f"--params={tmp_path / 'none.msgpack'}",
        f"--model_path={tmp_path / 'none'}",
        f"--out={blocker / 'out'}",
    )
    assert code == 2
    assert (
        err == f"error: --out {blocker / 'out'} cannot be made: {blocker} is a file, not a folder."
    )


def test_export_full_disk_is_not_blamed_on_the_source(sd15_base, tmp_path, capsys, monkeypatch):
    import errno

    from tree_grpo_jax.cli import export

    base, params = sd15_base
    source = base / "vae" / "diffusion_pytorch_model.safetensors"

    def full(*args, **kwargs):  # shutil.copy's ENOSPC names the file it read
        raise OSError(errno.ENOSPC, "No space left on device", str(source))

    monkeypatch.setattr(export.pipeline_export, "export_pipeline", full)
    out = tmp_path / "out"
    code, err = _export(capsys, f"--params={params}", f"--model_path={base}", f"--out={out}")
    assert code == 2 and str(source) not in err
    assert err == (
        f"error: no space left for the export in {tmp_path} (disk full or over quota); "
        "nothing was kept there."
    )


def test_an_eval_set_too_large_for_the_host_is_refused_before_it_is_drawn(tmp_path):
    workdir = tmp_path / "run"
    line = one_error_line(
        run_main("--config=configs/tiny.py", "--config.prompts.eval_count=1000000000",
                 f"--workdir={workdir}")
    )  # fmt: skip
    assert line.startswith("error: prompts.eval_count=1000000000 (1,000,000,000 samples) needs")
    assert line.endswith("lower prompts.eval_count or eval.samples_per_prompt."), line
    assert not workdir.exists()


# ---------------------------------------------------------------------------------------------
# Paths the system refuses to look at, values too long to quote, flags given twice


@pytest.mark.parametrize(
    "field, name", [("prompts.source", "p" * 300), ("prompts.eval_source", "p" * 300 + ".jsonl")]
)
def test_a_prompt_source_too_long_for_a_file_name_is_one_sentence(tmp_path, field, name):
    """A name over 255 bytes makes stat() fail (ENAMETOOLONG) instead of answering "no such
    file": one sentence, and the new workdir gone."""
    workdir = tmp_path / "run"
    line = one_error_line(
        run_main("--config=configs/tiny.py", f"--config.{field}={name}", f"--workdir={workdir}")
    )
    assert line.startswith(f"error: prompt source '{name[:60]}"), line
    assert f"({len(name)} characters) cannot be looked up as a file (" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_source_in_an_unknown_users_home_is_one_sentence(tmp_path):
    """`~nobody/x`: pathlib's expanduser raises RuntimeError; the file is simply not there."""
    workdir = tmp_path / "run"
    source = "~no_such_user_of_tree_grpo_jax/prompts.txt"
    line = one_error_line(
        run_main("--config=configs/tiny.py", f"--config.prompts.source={source}",
                 f"--workdir={workdir}")
    )  # fmt: skip
    assert line.startswith(f"error: prompt source '{source}' is neither a built-in set"), line
    assert list(tmp_path.iterdir()) == []


def test_model_and_checkpoint_paths_too_long_for_a_file_name_are_one_sentence(tmp_path):
    long = tmp_path / ("m" * 300)
    line = one_error_line(
        run_main("--config=configs/sd15.py", f"--config.model.path={long}",
                 f"--workdir={tmp_path / 'run'}")
    )  # fmt: skip
    assert line.startswith(f"error: model path {str(long)[:60]}..."), line
    assert "cannot be looked up (" in line and "--config.model.path" in line
    checkpoints = tmp_path / "elsewhere" / ("c" * 300)
    line = one_error_line(
        run_main("--config=configs/tiny.py", f"--config.checkpoint.dir={checkpoints}",
                 f"--workdir={tmp_path / 'run'}")
    )  # fmt: skip
    assert line.startswith(f"error: cannot write checkpoints to {str(checkpoints)[:60]}..."), line
    assert list(tmp_path.iterdir()) == []  # neither the workdir nor the checkpoints' parent
    line = one_error_line(
        run_main("--config=configs/tiny.py", "--config.eval.extra_rewards=hpsv2",
                 f"--config.reward_models.hpsv2={long}", f"--workdir={tmp_path / 'run'}")
    )  # fmt: skip
    assert line.startswith(f"error: reward model path {str(long)[:60]}..."), line
    assert "cannot be looked up (" in line and "--config.reward_models.hpsv2" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("train.iterations", "1" * 100_000),  # the override's own sentence (its type)
        ("name", "n" * 100_000 + "/"),  # a config check's sentence
        ("rewards", "r" * 100_000),
    ],
)
def test_a_huge_override_value_is_quoted_shortened(tmp_path, field, value):
    workdir = tmp_path / "run"
    line = one_error_line(
        run_main("--config=configs/tiny.py", f"--config.{field}={value}", f"--workdir={workdir}")
    )
    # (the list of known rewards after the quoted name grows with the registry)
    assert len(line.split("; known rewards:")[0]) < 300, len(line)
    assert value[:30] in line, line
    quoted = {"train.iterations": f"--config.{field}={value}"}.get(field, f"'{value}")
    assert f"({len(quoted):,} characters)" in line, line
    assert not workdir.exists()


@pytest.mark.parametrize(
    "args, said",
    [
        (["--config=configs/tiny.py", "--config=configs/sd15.py"],
         "--config is given twice (--config=configs/tiny.py and --config=configs/sd15.py)"),
        (["--config", "configs/tiny.py", "--config", "configs/sd15.py"],
         "--config is given twice (--config configs/tiny.py and --config configs/sd15.py)"),
        (["--config=configs/tiny.py", "--workdir=WORK/a", "--workdir", "WORK/b"],
         "--workdir is given twice (--workdir=WORK/a and --workdir WORK/b)"),
    ],
)  # fmt: skip
def test_a_flag_given_twice_is_one_sentence(tmp_path, args, said):
    """argparse keeps the last without a word; each flag, as each field, is given once."""
    args = [a.replace("WORK", str(tmp_path)) for a in args]
    line = one_error_line(run_main(*args))
    assert line == f"error: {said.replace('WORK', str(tmp_path))}; give each flag once.", line
    assert list(tmp_path.iterdir()) == []
