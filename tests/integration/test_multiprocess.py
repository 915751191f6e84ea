"""Several processes on one machine, joined by jax.distributed over CPU collectives, train
what one process trains on the same global batch, also after all of them are killed and
started again.

Each process owns one CPU device and half (a quarter) of the prompts; the reference is one
process drawing the whole global batch. Adam's epsilon is set large so that an update is
proportional to the gradient (at its default the first update is nearly the gradient's
sign, which hides differences): the parameters' change then shows the gradient itself.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from tree_grpo_jax.run.checkpoint import Checkpointer

# Slow tier: several processes joined by jax.distributed.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GLOBAL_PROMPTS = 4
COMMON = (
    "--config=configs/tiny.py",
    "--config.model.name=random_tiny",  # random weights: compiles and loads the quickest
    "--config.sampling.num_steps=4",
    "--config.tree.window=2",  # [B2 B2 O O]: 3 rows, 6 edges per prompt
    "--config.train.iterations=3",
    "--config.checkpoint.every=1",
    "--config.checkpoint.keep=5",
    "--config.eval.every=0",
    "--config.prompts.eval_count=5",  # odd: the last process's share is topped up
    "--config.train.rows_per_minibatch=16",  # 12 rows: one minibatch, whatever the split
    "--config.train.learning_rate=0.01",
    "--config.train.adam_eps=1.0",
    "--config.train.inner_epochs=1",  # one update per iteration: the gradient, compared
    "--config.log.tensorboard=False",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(workdir: Path, processes: int, *extra: str) -> list[subprocess.Popen]:
    """`processes` CLI processes (one CPU device each) training into one workdir."""
    port = _free_port()
    given = {e.split("=")[0] for e in extra}  # a field is given once: `extra` replaces COMMON's
    common = [a for a in COMMON if a.split("=")[0] not in given]
    procs = []
    for index in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(index),
            )
        log = open(workdir.parent / f"{workdir.name}.{index}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tree_grpo_jax.main",
                    *common,
                    f"--config.prompts.batch_size={GLOBAL_PROMPTS // processes}",
                    f"--workdir={workdir}",
                    *extra,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def _wait(procs, workdir: Path, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    for index, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"process {index} of {workdir.name} did not finish in {timeout} s")
        log = (workdir.parent / f"{workdir.name}.{index}.log").read_text()
        assert p.returncode == 0, f"process {index} of {workdir.name} failed:\n{log[-3000:]}"


def _train(workdir: Path, processes: int, *extra: str) -> None:
    _wait(_start(workdir, processes, *extra), workdir)


def _params(workdir: Path, step: int) -> dict:
    ckpt = Checkpointer(str(workdir / "checkpoints"), read_only=True)
    try:
        params = ckpt.restore_params(step)
    finally:
        ckpt.close()
    return {k: np.asarray(v, np.float64) for k, v in flatten_dict(jax.device_get(params)).items()}


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _train_row(workdir: Path, step: int) -> dict:
    (row,) = [m for m in _metrics(workdir) if m["step"] == step and "train/loss" in m]
    return row


def _eval_rows(workdir: Path) -> list[dict]:
    return [m for m in _metrics(workdir) if "eval/reward_mean" in m]


def _kill_after_checkpoint(procs, workdir: Path, step: int, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not (workdir / "checkpoints" / str(step)).is_dir():
        assert all(p.poll() is None for p in procs), "a process ended before it was killed"
        assert time.time() < deadline, f"no checkpoint {step} in {timeout} s"
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference (one process) and two processes side by side; the two are killed
    (kill -9) once their second checkpoint is written and started again with the same
    commands."""
    root = tmp_path_factory.mktemp("multiprocess")
    one, two = root / "one", root / "two"
    procs_one, procs_two = _start(one, 1), _start(two, 2)
    _kill_after_checkpoint(procs_two, two, 2)
    _train(two, 2)
    _wait(procs_one, one)
    return {"root": root, 1: one, 2: two}


def _initial_params(workdir: Path) -> dict:
    from tree_grpo_jax.models import load_model
    from tree_grpo_jax.models.base import cast_floats

    config = json.loads((workdir / "config.json").read_text())  # as the run saw it
    model = load_model(ml_collections.ConfigDict(config["model"]), seed=config["seed"])
    params = cast_floats(model.params, np.float32)
    return {k: np.asarray(v, np.float64) for k, v in flatten_dict(params).items()}


def _assert_same_update(got: dict, want: dict, initial: dict) -> None:
    """The parameters' changes agree to float32 rounding of the reduction order."""
    assert got.keys() == want.keys() == initial.keys()
    scale = max(np.max(np.abs(want[k] - initial[k])) for k in want)
    assert scale > 1e-6  # the step changed something
    worst = max(np.max(np.abs((got[k] - initial[k]) - (want[k] - initial[k]))) for k in want)
    assert worst <= 1e-3 * scale, (worst, scale)


def test_two_processes_train_what_one_process_trains(runs):
    one, two = runs[1], runs[2]
    initial = _initial_params(one)
    _assert_same_update(_params(two, 1), _params(one, 1), initial)
    row_one, row_two = _train_row(one, 1), _train_row(two, 1)
    np.testing.assert_allclose(row_two["train/grad_norm"], row_one["train/grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(row_two["train/loss"], row_one["train/loss"], atol=1e-6)
    np.testing.assert_allclose(
        row_two["train/reward_mean"], row_one["train/reward_mean"], rtol=1e-5
    )
    # every process's rows were trained: the summed counts equal the single process's
    assert row_two["train/trained_edges"] == row_one["train/trained_edges"]
    assert row_two["train/train_rows"] == row_one["train/train_rows"] == 12
    # evaluation split over the processes and gathered: the same 5 images are scored
    eval_one, eval_two = _eval_rows(one), _eval_rows(two)
    assert [m["step"] for m in eval_two] == [m["step"] for m in eval_one] == [0, 3]
    np.testing.assert_allclose(
        eval_two[0]["eval/reward_mean"], eval_one[0]["eval/reward_mean"], rtol=1e-6
    )
    # one process wrote the logs and pictures
    assert (two / "eval_00003.png").is_file() and (two / "summary.json").is_file()
    assert not (two / "run.lock").exists()


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4,
    reason="4 processes need 4 cores (on 2 they take minutes); the 2-process tests run",
)
def test_four_processes_train_what_one_process_trains(runs):
    four = runs["root"] / "four"
    _train(four, 4, "--config.train.iterations=1")
    _assert_same_update(_params(four, 1), _params(runs[1], 1), _initial_params(runs[1]))
    np.testing.assert_allclose(
        _train_row(four, 1)["train/grad_norm"], _train_row(runs[1], 1)["train/grad_norm"], rtol=1e-4
    )


def test_killed_processes_resume_where_they_stopped(runs):
    """After the kill -9 and the restart, the two processes end where one uninterrupted
    process ends, and every iteration is logged once."""
    one, two = runs[1], runs[2]
    _assert_same_update(_params(two, 3), _params(one, 3), _initial_params(one))
    assert [m["step"] for m in _metrics(two) if "train/loss" in m] == [1, 2, 3]
    np.testing.assert_allclose(
        _eval_rows(two)[-1]["eval/reward_mean"], _eval_rows(one)[-1]["eval/reward_mean"], rtol=1e-4
    )


def test_processes_started_with_different_configs_are_refused(tmp_path):
    """Every process says so in one sentence and exits 2, before anything is written."""
    workdir = tmp_path / "mixed"
    port = _free_port()
    procs = []
    for index, seed in enumerate((0, 1)):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(index),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tree_grpo_jax.main",
                    "--config=configs/tiny.py",
                    f"--config.seed={seed}",
                    f"--workdir={workdir}",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert p.returncode == 2, err[-2000:]
        assert len(errors) == 1 and "started with different configs" in errors[0], err[-2000:]
    assert not workdir.exists()


def test_replay_in_two_killed_processes_trains_what_one_process_trains(tmp_path):
    """`train.replay=1`: each process holds its own rows and saves them beside every
    checkpoint; killed after the second and restarted, the two end where one uninterrupted
    process ends (one update per iteration over the fresh and the replayed rows)."""
    extra = ("--config.train.replay=1", "--config.train.rows_per_minibatch=48")
    one, two = tmp_path / "one", tmp_path / "two"
    procs_one, procs_two = _start(one, 1, *extra), _start(two, 2, *extra)
    _kill_after_checkpoint(procs_two, two, 2)
    _train(two, 2, *extra)
    _wait(procs_one, one)
    _assert_same_update(_params(two, 3), _params(one, 3), _initial_params(one))
    for run in (one, two):
        rows = [
            (m["train/train_rows"], m["train/replayed_rows"])
            for m in _metrics(run)
            if "train/loss" in m
        ]
        assert rows == [(12, 0), (24, 12), (24, 12)]
    held = sorted(p.name for p in (two / "checkpoints" / "host_state").iterdir())
    assert {"3.process0.npz", "3.process1.npz"} <= set(held)
