"""The command line: bad input gets one sentence on stderr and exit status 2."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_main(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tree_grpo_jax.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def run_in_process(*args) -> subprocess.CompletedProcess:
    """`tree_grpo_jax.main` in this process (the many bad-input cases then share one start
    of Python and JAX); same result fields as `run_main`."""
    from in_process import run_in_process as run

    from tree_grpo_jax.cli import main as cli

    return run(cli, *args, prog="tree_grpo_jax.main")


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


@pytest.fixture
def empty_prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n   \n")
    return str(path)


@pytest.fixture
def file_in_the_way(tmp_path):
    path = tmp_path / "not_a_folder"
    path.write_text("x")
    return str(path / "run")


BAD_INPUTS = [
    (["--config.tree.method=bogus"], "unknown tree.method 'bogus'"),
    (["--config.rewards=digit_alignment:1,no_such_reward:0.5"], "unknown reward 'no_such_reward'"),
    (["--config.rewards=digit_alignment:x"], "reward weight"),
    (["--config.model.name=sd"], "needs model.path"),
    (["--config.model.name=sd", "--config.model.path=/nonexistent/sd15"], "/nonexistent/sd15"),
    (["--config.model.name=sd3", "--config.model.path=/nonexistent/sd35"], "/nonexistent/sd35"),
    (["--config.train.learning_rate=-1.0"], "train.learning_rate must be positive, got -1.0."),
    (["--config.tree.window=12"], "a sliding window of 12 steps does not fit in 10 steps"),
    (["--config.tree.window_start=8"], "runs past the last step"),
    (["--config.tree.split_log_prob=scaled"], "tree.split_log_prob must be one of"),
    (["--config.advantage.std_ddof=2"], "advantage.std_ddof must be 0 or 1"),
    (["--config.sampling.log_prob_reduce=max"], "log_prob_reduce"),
    (["--config.tree.method=grpo", "--config.tree.group_size=1"], "need at least 2"),
    (["--config.sampling.eta=1.5"], "sampling.eta must be in (0, 1]"),
    (["--config.train.iteratons=3"], "did you mean --config.train.iterations?"),
    (["--config.tree.kk=3"], "the config has no field 'tree.kk'"),
    (["--config.train.learning_rate=abc"], "has the wrong type"),
    (["--config.rewards=hpsv2"], "--config.reward_models.hpsv2=/path"),
    (["--config.eval.extra_rewards=('pickscore',)"], "reward 'pickscore' needs a PickScore_v1"),
    (
        ["--config.rewards=aesthetic", "--config.reward_models.aesthetic=/nonexistent/aes"],
        "/nonexistent/aes",
    ),
    (["--config.reward_options.dtype=float16"], "reward_options.dtype must be"),
    (["--config.lora.rank=-1"], "lora.rank must be >= 0"),
    (["--config.lora.rank=4", "--config.lora.targets=('to_qq',)"], "matching the LoRA targets"),
    (["--config.train.iterations=2.5"], "has the wrong type"),
    (["--confg.train.iterations=2"], "Unknown command line flag"),
    (["--config.log.wandb_project=demo"], "wandb is not installed"),
    (["--config.tree.k=1000", "--config.tree.window=8"], "one rollout stores about"),
    (["--config.prompts.eval_count=100000000000"], "lower prompts.eval_count"),
    (["--config.model.use_t5=False"], "it moved to model.sd3.use_t5"),
    (
        ["--config.reward_options.pickscore_divisor=26"],
        "it moved to reward_options.pickscore.divisor",
    ),
    (
        ["--config.model.name=sd3", "--config.model.path=/x", "--config.model.sd3.t5_max_length=0"],
        "model.sd3.t5_max_length must be at least 1",
    ),
    (["--config.model.name=sd4"], "unknown model.name 'sd4'; choose one of"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_config_exits_2_with_one_sentence(tmp_path, overrides, message):
    result = run_in_process("--config=configs/tiny.py", f"--workdir={tmp_path}", *overrides)
    assert result.returncode == 2
    assert message in _one_error_line(result)


def test_empty_prompt_file(tmp_path, empty_prompt_file):
    result = run_main(
        "--config=configs/tiny.py",
        f"--workdir={tmp_path}",
        f"--config.prompts.source={empty_prompt_file}",
    )
    assert result.returncode == 2
    assert empty_prompt_file in _one_error_line(result)


def test_unwritable_workdir(file_in_the_way):
    result = run_main("--config=configs/tiny.py", f"--workdir={file_in_the_way}")
    assert result.returncode == 2
    assert "cannot write" in _one_error_line(result)


def test_unwritable_checkpoint_dir(tmp_path, file_in_the_way):
    result = run_main(
        "--config=configs/tiny.py",
        f"--workdir={tmp_path}",
        f"--config.checkpoint.dir={file_in_the_way}",
    )
    assert result.returncode == 2
    assert f"cannot write checkpoints to {file_in_the_way}" in _one_error_line(result)


def test_a_url_workdir_points_to_checkpoint_dir():
    result = run_main("--config=configs/tiny.py", "--workdir=gs://bucket/run")
    assert result.returncode == 2
    assert "--config.checkpoint.dir=gs://bucket/run" in _one_error_line(result)


def test_missing_config_flag():
    result = run_main()
    assert result.returncode == 2
    assert "give a config file" in _one_error_line(result)


@pytest.fixture
def broken_configs(tmp_path):
    raising = tmp_path / "raising.py"
    raising.write_text("def get_config():\n    raise RuntimeError('no such experiment')\n")
    not_python = tmp_path / "notes.py"
    not_python.write_text("def get_config(:\n")
    return {"raising": str(raising), "not_python": str(not_python)}


@pytest.mark.parametrize(
    "which, message",
    [
        ("missing", "there is no config file 'configs/does_not_exist.py'"),
        ("raising", "RuntimeError: no such experiment"),
        ("not_python", "could not be loaded (line 1): SyntaxError"),
    ],
)
def test_broken_config_file_is_one_sentence(tmp_path, broken_configs, which, message):
    path = broken_configs.get(which, "configs/does_not_exist.py")
    result = run_main(f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert message in _one_error_line(result)
    assert not (tmp_path / "run").exists()  # a failed start leaves no folder behind


@pytest.mark.slow
def test_configs_load_from_any_working_directory(tmp_path):
    """An absolute --config path from another folder, a user's own config file outside the
    repository that starts from the package's schema, and, run from the repository's root,
    one that starts from one of the repository's configs (`configs.tiny`), load (the run
    then stops on a bad value)."""
    own = tmp_path / "my_config.py"
    own.write_text(
        "from tree_grpo_jax.config import base_config\n\n\ndef get_config():\n"
        "    c = base_config()\n    c.tree.method = 'bogus_from_my_config'\n    return c\n"
    )
    derived = tmp_path / "my_derived_config.py"
    derived.write_text(
        "from configs import tiny\n\n\ndef get_config():\n"
        "    c = tiny.get_config()\n    c.tree.method = 'bogus_from_tiny'\n    return c\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for config, cwd, message in (
        (os.path.join(ROOT, "configs", "tiny.py"), tmp_path, "unknown tree.method 'bogus'"),
        (str(own), tmp_path, "unknown tree.method 'bogus_from_my_config'"),
        (str(derived), ROOT, "unknown tree.method 'bogus_from_tiny'"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "tree_grpo_jax.main", f"--config={config}",
             f"--workdir={tmp_path / 'run'}", "--config.tree.method=bogus"
             if config.endswith("tiny.py") else "--config.log.progress=False"],
            cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in _one_error_line(result)


def test_a_keyboard_interrupt_inside_get_config_is_one_line_exit_130(tmp_path):
    config = tmp_path / "interrupted.py"
    config.write_text("def get_config():\n    raise KeyboardInterrupt\n")
    result = run_in_process(f"--config={config}", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 130, result.stderr[-2000:]
    line = _one_error_line(result)
    assert "interrupted (KeyboardInterrupt) while loading" in line, line
    assert not (tmp_path / "run").exists()
