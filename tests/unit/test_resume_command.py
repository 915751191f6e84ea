"""The command a line prints to go on with a run, and a failed save's cause, written out by
hand for each case."""

import errno
import shlex

from tree_grpo_jax.cli.common import latest_checkpoint, run_command
from tree_grpo_jax.run.checkpoint import _save_failure


def test_the_workdir_goes_after_the_config_and_replaces_a_given_one():
    argv = ["--config=configs/tiny.py", "--config.tree.k=3", "--workdir", "old"]
    assert run_command("main", "runs/tiny/1", argv) == (
        "python -m tree_grpo_jax.main --config=configs/tiny.py --workdir=runs/tiny/1 "
        "--config.tree.k=3"
    )
    argv = ["--config", "my config.py", "--workdir=old", "--config.train.iterations=4"]
    line = run_command("main", "/tmp/a b", argv, train__iterations=8)
    assert shlex.split(line) == [
        "python",
        "-m",
        "tree_grpo_jax.main",
        "--config",
        "my config.py",
        "--workdir=/tmp/a b",
        "--config.train.iterations=8",
    ]


def test_simulated_devices_go_with_the_command(monkeypatch):
    argv = ["--config=configs/tiny.py"]
    flags = "--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=4"
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert run_command("main", "w", argv) == (
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 "
        "python -m tree_grpo_jax.main --config=configs/tiny.py --workdir=w"
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
    assert run_command("main", "w", argv).startswith("python -m tree_grpo_jax.main ")


def test_latest_checkpoint_counts_step_folders_only(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    for name in ("2", "10", "12.orbax-checkpoint-tmp", "3.unreadable-1700000000"):
        (tmp_path / name).mkdir()
    assert latest_checkpoint(str(tmp_path)) == 10
    assert latest_checkpoint("gs://bucket/run/checkpoints") is None


def test_a_full_disk_is_named_through_the_chain_of_causes():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as e:
            raise Exception("Failed to run 4 Handler Commit operations") from e
    except Exception as wrapped:  # noqa: BLE001
        assert _save_failure(wrapped) == "no space left on the device"
    assert (
        _save_failure(PermissionError(errno.EACCES, "denied"))
        == "PermissionError: [Errno 13] denied"
    )
