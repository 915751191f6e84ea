"""Ctrl-C and SIGTERM through the command line, as a user or a cluster sends them: one
`error:` line, exit 130 / 143, within seconds at any moment (compiling included), nothing
half-written, and the command the line prints really resumes. One process per scenario,
sharing one run's folder."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

# Slow tier: a process per scenario, signalled at chosen moments.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = [
    "--config=configs/tiny.py",
    "--config.model.name=random_tiny",
    "--config.sampling.num_steps=4",
    "--config.tree.window=2",
    "--config.prompts.eval_count=4",
    "--config.train.iterations=8",
    "--config.checkpoint.every=0",
    "--config.eval.every=0",
    "--config.log.tensorboard=False",
]
STOP_WITHIN_S = 20  # generous on a loaded 2-core machine; the stop itself is immediate


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell starts background jobs with SIGINT ignored, which the command respects
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _signal_at(proc, prefix: str, signum, then=None) -> tuple[list[str], float]:
    """Sends `signum` when a line starting with `prefix` appears (and `then`'s signal at its
    line); every line, and the seconds from the (last) signal to the exit."""
    lines, sent = [], None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if sent is None and line.startswith(prefix):
            proc.send_signal(signum)
            sent = time.time()
        elif then is not None and sent is not None and then[0] in line:
            proc.send_signal(then[1])
            sent, then = time.time(), None
    proc.wait(timeout=300)
    return lines, time.time() - sent


def _error_line(lines: list[str]) -> str:
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines[-30:]
    assert not any("Traceback" in line for line in lines), lines[-30:]
    return errors[0]


def _printed_command(line: str, marker: str) -> list[str]:
    command = shlex.split(line.split(marker, 1)[1])
    assert command[:3] == ["python", "-m", "tree_grpo_jax.main"], line
    return [sys.executable, *command[1:]]


def test_signals_stop_the_run_at_any_moment_and_the_printed_command_resumes(tmp_path):
    workdir = tmp_path / "run"
    first = [sys.executable, "-m", "tree_grpo_jax.main", *ARGS, f"--workdir={workdir}"]

    # 1. Ctrl-C while XLA compiles: the main thread is in C code, yet it stops at once.
    proc = _start(first)
    lines, seconds = _signal_at(proc, "compiling", signal.SIGINT)
    assert proc.returncode == 130, lines[-30:]
    assert seconds < STOP_WITHIN_S
    line = _error_line(lines)
    assert "SIGINT stopped the run at once; nothing was trained yet" in line, line
    assert not workdir.exists()  # a new run stopped before its first checkpoint leaves nothing
    command = _printed_command(line, "start it again with: ")
    assert f"--workdir={workdir}" in command and "--config.train.iterations=8" in command

    # 2. SIGTERM in the loop: the iteration finishes and is saved; the line names the command.
    proc = _start(command)
    lines, seconds = _signal_at(proc, "[   2/", signal.SIGTERM)
    assert proc.returncode == 143, lines[-30:]
    line = _error_line(lines)
    assert "SIGTERM received; stopped after iteration" in line, line
    stopped = int(line.split("stopped after iteration ")[1].split(",")[0])
    assert 2 <= stopped < 8
    assert sorted(os.listdir(workdir / "checkpoints")) == [str(stopped)]

    # 3. A second signal stops at once; the checkpoint kept is said, with the command.
    resume = _printed_command(line, "resume it exactly with: ")
    assert resume == command
    proc = _start(resume)
    lines, seconds = _signal_at(
        proc, f"[   {stopped + 1}/", signal.SIGTERM, then=("finishing", signal.SIGTERM)
    )
    assert proc.returncode == 143, lines[-30:]
    assert seconds < STOP_WITHIN_S
    assert f"resumed from the checkpoint after iteration {stopped}" in "\n".join(lines)
    line = _error_line(lines)
    assert "SIGTERM stopped the run at once; its checkpoint after iteration" in line, line
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(workdir / "checkpoints"))

    # 4. evaluate on that run: stopped between chunks, it keeps the finished ones, names the
    # command that continues, and leaves no half-written chunk.
    out = tmp_path / "evaluation"
    evaluate = [
        sys.executable,
        "-m",
        "tree_grpo_jax.evaluate",
        f"--workdir={workdir}",
        f"--out={out}",
        "--prompts_per_chunk=1",
        "--samples_per_prompt=1",
    ]
    proc = _start(evaluate)
    lines, seconds = _signal_at(proc, "base: prompts 1-1", signal.SIGTERM)
    assert proc.returncode == 143, lines[-30:]
    assert seconds < STOP_WITHIN_S
    line = _error_line(lines)
    assert "SIGTERM stopped the evaluation;" in line and "continues from them: " in line, line
    assert shlex.split(line.split("continues from them: ")[1])[3:] == evaluate[3:]
    kept = os.listdir(out / "partial")
    assert "base-00000.npz" in kept and not any(".tmp." in n for n in kept), kept


def test_other_commands_stop_with_one_line_and_exit_130(tmp_path):
    """plan while it loads, sample while it imports, the converter blocked reading a pipe
    that nobody writes (a read in C, where Python's own handler would never run)."""
    fifo = tmp_path / "release.pt"
    os.mkfifo(fifo)
    commands = {
        "plan": ["tree_grpo_jax.plan", "--config=configs/tiny.py"],
        "sample": ["tree_grpo_jax.sample", f"--workdir={tmp_path}", "--prompts=a digit"],
        "convert": ["tree_grpo_jax.rewards.convert", "hpsv2", f"--checkpoint={fifo}"]
        + [f"--out={tmp_path / 'out'}"],
    }
    # the converter's read of the release: its `reading` line comes just before it
    prefixes = {"convert": "reading "}
    for name, args in commands.items():
        proc = _start([sys.executable, "-m", *args])
        lines, _ = _signal_at(proc, prefixes.get(name, "tree_grpo_jax."), signal.SIGINT)
        assert proc.returncode == 130, (name, lines[-10:])
        assert "stopped" in _error_line(lines), (name, lines)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_converter_stops_while_jax_imports(tmp_path, signum, status):
    """`python -m tree_grpo_jax.rewards.convert` imports the rewards package, JAX with it,
    before its own `__main__` runs: a signal then is the converter's one line and status,
    not a KeyboardInterrupt swallowed by JAX's import (the run going on, exit 0) or a silent
    death by SIGTERM."""
    out = tmp_path / "out"
    args = ["aesthetic", f"--checkpoint={tmp_path / 'x.pth'}", f"--clip={tmp_path}", f"--out={out}"]
    proc = _start([sys.executable, "-m", "tree_grpo_jax.rewards.convert", *args])
    lines, seconds = _signal_at(proc, "tree_grpo_jax.rewards.convert: starting", signum)
    assert proc.returncode == status, lines[-10:]
    line = _error_line(lines)
    assert line.startswith(f"error: {signal.Signals(signum).name} stopped the conversion;"), line
    assert seconds < STOP_WITHIN_S and not out.exists()
