"""Fault injection: interrupts at awkward points, SIGTERM, divergence, damaged checkpoints,
concurrent runs, resumes under another config. Each ends in an exact resume or one sentence,
and nothing good is overwritten."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from small_configs import small_config

from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run import reporting
from tree_grpo_jax.run import trainer as trainer_module
from tree_grpo_jax.run.checkpoint import Checkpointer, CheckpointError
from tree_grpo_jax.run.workdir import WorkdirBusy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fault_config():
    c = small_config("grpo")
    c.advantage.stat_tracker = True
    c.advantage.tracker_min_count = 2
    c.train.iterations = 4
    c.checkpoint.every = 2
    c.eval.every = 2
    return c


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    workdir = tmp_path_factory.mktemp("straight")
    train.train(fault_config(), str(workdir))
    return workdir


def final_params(workdir):
    state, meta, _ = Checkpointer(str(workdir / "checkpoints"), read_only=True).restore()
    return jax.device_get(state["params"]), meta


def train_rows(workdir):
    return [m for m in reporting.read_metrics(str(workdir)) if "train/loss" in m]


def assert_same_run(a, b):
    params_a, meta_a = final_params(a)
    params_b, meta_b = final_params(b)
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), params_a, params_b
    )
    assert meta_a["prompt_iterator"] == meta_b["prompt_iterator"]
    assert meta_a["stat_tracker"] == meta_b["stat_tracker"]
    rows_a, rows_b = train_rows(a), train_rows(b)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]  # every iteration once, none repeated
    for ra, rb in zip(rows_a, rows_b):
        assert ra["train/reward_mean"] == pytest.approx(rb["train/reward_mean"], abs=1e-6)
    evals = [m["step"] for m in reporting.read_metrics(str(b)) if "eval/reward_mean" in m]
    assert evals == [0, 2, 4]


def signal_self():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def sigint_handled():
    """Python's own SIGINT handler, whatever the test run inherited: a shell starts
    background jobs with SIGINT ignored, and the trainer leaves an ignored signal alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


INTERRUPT_POINTS = ["after_prompts_drawn", "during_update", "during_save"]


@pytest.mark.slow
@pytest.mark.parametrize("point", INTERRUPT_POINTS)
def test_interrupt_inside_an_iteration_resumes_exactly(
    tmp_path, monkeypatch, straight, point, sigint_handled
):
    """SIGINT lands inside iteration 3 (index 2): the iteration finishes, is saved, the run
    stops; the same command then ends exactly where the uninterrupted run ends."""
    c = fault_config()
    fired = {"done": False}

    def fire_once(condition: bool):
        if condition and not fired["done"]:
            fired["done"] = True
            signal_self()

    if point == "after_prompts_drawn":
        real = train.Trainer.rollout

        def rollout(self, params, prompts, key, iteration=0):
            fire_once(iteration == 2)
            return real(self, params, prompts, key, iteration)

        monkeypatch.setattr(train.Trainer, "rollout", rollout)
    elif point == "during_update":
        real = train.Trainer.update

        def update(self, state, sampled, rewards, iteration, key):
            fire_once(iteration == 2)
            return real(self, state, sampled, rewards, iteration, key)

        monkeypatch.setattr(train.Trainer, "update", update)
    else:
        real = Checkpointer.save

        def save(self, step, state, meta, *host_arrays):
            fire_once(step == 2)
            return real(self, step, state, meta, *host_arrays)

        monkeypatch.setattr(Checkpointer, "save", save)

    with pytest.raises(train.Interrupted, match="SIGINT received; stopped after iteration"):
        train.train(c, str(tmp_path))
    stopped_at = Checkpointer(str(tmp_path / "checkpoints")).latest_step
    assert stopped_at == (2 if point == "during_save" else 3)
    monkeypatch.undo()
    train.train(c, str(tmp_path))
    assert_same_run(straight, tmp_path)


@pytest.mark.slow
def test_hard_kill_resumes_from_last_checkpoint_without_duplicate_rows(
    tmp_path, monkeypatch, straight
):
    """kill -9 inside iteration 4 (nothing saved on the way out): the rows the dead process
    wrote for iteration 3 are dropped on resume, and the result is the uninterrupted one."""
    c = fault_config()
    real = train.Trainer.iteration

    def dies(self, state, iteration):
        if iteration == 3:
            raise SystemExit("killed")
        return real(self, state, iteration)

    monkeypatch.setattr(train.Trainer, "iteration", dies)
    with pytest.raises(SystemExit):
        train.train(c, str(tmp_path))
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2, 3]
    monkeypatch.undo()
    train.train(c, str(tmp_path))
    assert_same_run(straight, tmp_path)


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, straight, capsys):
    c = fault_config()
    c.checkpoint.every = 1
    c.checkpoint.keep = 5
    c.train.iterations = 3
    train.train(c, str(tmp_path))
    # Damage checkpoint 3: its meta document is gone and a state file is cut short.
    step_dir = tmp_path / "checkpoints" / "3"
    shutil.rmtree(step_dir / "meta")
    files = sorted(p for p in (step_dir / "state").rglob("*") if p.is_file())
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:10])
    c.train.iterations = 4
    train.train(c, str(tmp_path))  # resumes from checkpoint 2, the newest readable one
    assert "checkpoint 3" in capsys.readouterr().err
    assert any(p.name.startswith("3.unreadable-") for p in (tmp_path / "checkpoints").iterdir())
    assert_same_run(straight, tmp_path)


@pytest.mark.slow
def test_divergence_stops_and_keeps_checkpoints_finite(tmp_path, monkeypatch):
    """Two good iterations are checkpointed; then the step size explodes: the run stops with
    one sentence at the first non-finite number and the good checkpoints stay as they were."""
    c = small_config("treegrpo")
    c.train.iterations = 2
    c.checkpoint.every = 1
    c.checkpoint.keep = 10
    train.train(c, str(tmp_path))
    before, _ = final_params(tmp_path)
    real_lr = trainer_module.learning_rate
    monkeypatch.setattr(
        trainer_module, "learning_rate", lambda t, i: 1e30 if i >= 2 else real_lr(t, i)
    )
    c.train.iterations = 6
    with pytest.raises(train.DivergenceError, match="not finite: training diverged") as info:
        train.train(c, str(tmp_path))
    assert "\n" not in str(info.value)
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
    for step in ckpt.all_steps():
        state, _, _ = ckpt.restore(step=step)
        for leaf in jax.tree_util.tree_leaves(state):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    after, _ = final_params(tmp_path) if ckpt.latest_step == 2 else (None, None)
    if after is not None:  # stopped inside iteration 3: checkpoint 2 untouched
        jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)
    assert ckpt.latest_step < 6


def test_resume_under_another_config_is_refused_and_the_record_kept(tmp_path):
    c = small_config("treegrpo")
    c.train.iterations = 1
    train.train(c, str(tmp_path))
    record = (tmp_path / "config.json").read_text()
    other = small_config("grpo")
    other.train.iterations = 2
    with pytest.raises(CheckpointError, match="tree.method was 'treegrpo', now 'grpo'"):
        train.train(other, str(tmp_path))
    assert (tmp_path / "config.json").read_text() == record
    c.train.iterations = 2  # a harmless override: allowed
    c.eval.every = 0
    summary = train.train(c, str(tmp_path))
    assert not summary.get("already_finished")
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 2


def test_finished_run_is_not_run_again(tmp_path):
    c = small_config("treegrpo")
    c.train.iterations = 2
    c.eval.every = 0
    train.train(c, str(tmp_path))
    rows = reporting.read_metrics(str(tmp_path))
    record = (tmp_path / "config.json").read_text()
    summary = train.train(c, str(tmp_path))
    assert summary["already_finished"] and summary["iterations"] == 2
    assert reporting.read_metrics(str(tmp_path)) == rows
    # Asked for fewer iterations than it holds: it says what it holds, keeps its record.
    c.train.iterations = 1
    summary = train.train(c, str(tmp_path))
    assert summary["already_finished"] and summary["iterations"] == 2
    assert (tmp_path / "config.json").read_text() == record
    assert reporting.read_metrics(str(tmp_path)) == rows


def test_second_run_on_a_workdir_is_refused_and_a_stale_lock_taken_over(tmp_path):
    c = small_config("treegrpo")
    c.train.iterations = 1
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # written by the owner once it runs, as a real lock is
        lock = {
            "pid": holder.pid,
            "host": os.uname().nodename,
            "since": time.time(),
            "start_ticks": _ticks(holder.pid),
        }
        (tmp_path / "run.lock").write_text(json.dumps(lock))
        with pytest.raises(WorkdirBusy, match=f"another run \\(pid {holder.pid}\\)"):
            train.train(c, str(tmp_path))
        assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")
    finally:
        holder.kill()
        holder.wait()
    train.train(c, str(tmp_path))  # the owner is dead now: its lock is taken over
    assert not (tmp_path / "run.lock").exists()
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step == 1


@pytest.mark.slow
def test_a_signal_after_the_last_iteration_says_the_run_is_complete(
    tmp_path, monkeypatch, straight, sigint_handled
):
    """SIGINT during the final evaluation: nothing is left to stop, but the run does not end
    as if nothing happened: Interrupted, marked finished, with everything saved."""
    c = fault_config()
    real = train.save_eval

    def save_eval(trainer, iteration, params, history, writer):
        if iteration == c.train.iterations:
            signal_self()
        return real(trainer, iteration, params, history, writer)

    monkeypatch.setattr(train, "save_eval", save_eval)
    with pytest.raises(train.Interrupted, match="received as the run finished; all 4") as e:
        train.train(c, str(tmp_path))
    assert e.value.finished
    assert (tmp_path / "summary.json").exists()
    monkeypatch.undo()
    assert_same_run(straight, tmp_path)


def _ticks(pid: int) -> int:
    """Process `pid`'s start, in clock ticks since boot, read from /proc here."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_lock_naming_a_live_unrelated_pid_is_taken_over(tmp_path):
    """The owner died and its pid now belongs to another process: not a run to wait for."""
    from tree_grpo_jax.run.workdir import WorkdirBusy, WorkdirLock

    host = socket.gethostname()
    sleeper = subprocess.Popen(["sleep", "60"])  # alive, but no Python
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # the dead owner: a process that started at another tick (this one, long before)
    dead_owner = _ticks(os.getpid())
    assert _ticks(later.pid) != dead_owner
    try:
        for pid in (sleeper.pid, later.pid):
            lock = {"pid": pid, "host": host, "since": time.time(), "start_ticks": dead_owner}
            (tmp_path / "run.lock").write_text(json.dumps(lock))
            with WorkdirLock(str(tmp_path)):
                assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
            assert not (tmp_path / "run.lock").exists()
        # the same pid at the tick it started: the owner itself, waited for
        lock = {"pid": later.pid, "host": host, "since": 0.0, "start_ticks": _ticks(later.pid)}
        (tmp_path / "run.lock").write_text(json.dumps(lock))
        with pytest.raises(WorkdirBusy, match=f"another run \\(pid {later.pid}\\)"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        for process in (sleeper, later):
            process.kill()
            process.wait()


def test_a_lock_without_start_ticks_is_judged_by_its_time(tmp_path, monkeypatch):
    """Locks written before the ticks were recorded: a process that started well after the
    lock's time is not its owner; one that started before it may be."""
    from tree_grpo_jax.run import workdir

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(workdir, "_start_ticks", lambda pid: None)
    monkeypatch.setattr(workdir, "_started_at", lambda pid: 1000.0)
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname()}
        (tmp_path / "run.lock").write_text(json.dumps({**lock, "since": 1001.0}))
        with pytest.raises(workdir.WorkdirBusy):
            workdir.WorkdirLock(str(tmp_path)).acquire()
        (tmp_path / "run.lock").write_text(json.dumps({**lock, "since": 900.0}))
        with workdir.WorkdirLock(str(tmp_path)):
            assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()


OOM_CONFIG = """
from small_configs import small_config


def get_config():
    c = small_config("grpo")
    c.train.iterations = 3
    c.eval.every = 0
    return c
"""
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.80GiB."


def _named_settings(line: str) -> dict:
    """`field=value` of every setting the out-of-memory line names before `plan`'s command."""
    settings = line.split("memory: ", 1)[1].split("; `python -m tree_grpo_jax.plan")[0]
    return dict(re.findall(r"(?:^|, )([a-z_]+\.[a-z_.]+)=([^ ,;]+)", settings))


def _schema_fields() -> set:
    from tree_grpo_jax.config import base_config, flatten

    return set(flatten(base_config(), leaves_only=True))


def _oom_run(tmp_path, monkeypatch, fault):
    """The CLI on OOM_CONFIG with `fault` injected: (its one error line, the workdir)."""
    from in_process import one_error_line, run_main

    config = tmp_path / "oom_config.py"
    config.write_text(OOM_CONFIG)
    workdir = tmp_path / "runs" / "oom"
    with monkeypatch.context() as patched:
        fault(patched)
        result = run_main(f"--config={config}", f"--workdir={workdir}")
    return one_error_line(result, status=1), config, workdir


def test_out_of_memory_in_the_first_iteration_names_the_rollouts_settings_and_leaves_nothing(
    tmp_path, monkeypatch
):
    """XLA's RESOURCE_EXHAUSTED in the first iteration's rollout (after the evaluation at step
    0 wrote its grid and metrics): one line that names the rollout, settings of the schema
    that shrink it (none of the train step's), `plan`'s command for the same config, no
    checkpoint (none was saved), and the new workdir is gone."""
    from tree_grpo_jax.core import rollout as core_rollout

    real = core_rollout.rollout

    def rollout(*args, lower=False, export=False, **kwargs):
        if not (lower or export):  # the run's own rollout, not its ahead-of-time compile
            raise jax.errors.JaxRuntimeError(OUT_OF_MEMORY)
        return real(*args, lower=lower, export=export, **kwargs)

    line, config, workdir = _oom_run(
        tmp_path, monkeypatch, lambda p: p.setattr(core_rollout, "rollout", rollout)
    )
    assert line.startswith(
        "error: the device ran out of memory (28.80GiB) in the rollout of iteration 1; "
    ), line
    named = _named_settings(line)
    assert "prompts.batch_size" in named and set(named) <= _schema_fields(), line
    assert int(named["prompts.batch_size"]) < small_config("grpo").prompts.batch_size
    assert not {"train.rows_per_minibatch", "model.remat"} & set(named), line  # train step's
    assert f"`python -m tree_grpo_jax.plan --config={config}` shows" in line, line
    assert "checkpoint" not in line and "resume" not in line, line
    assert line.endswith(f"nothing was saved, so the new folder {workdir} is removed."), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # two runs, the second compiling a rematerialised train step
def test_out_of_memory_after_a_checkpoint_names_the_train_step_and_the_resume_works(
    tmp_path, monkeypatch
):
    """RESOURCE_EXHAUSTED in the train step of iteration 2, after checkpoint 1: the line
    names the train step's settings, the checkpoint kept, and a resume with a setting a
    resume accepts; that command ends the run where an uninterrupted one ends."""
    from in_process import run_main

    from tree_grpo_jax import sharding

    real_update, real_shard = train.Trainer.update, sharding.shard_batch
    now = {}

    def update(self, state, sampled, rewards, iteration, key):
        now["iteration"] = iteration
        return real_update(self, state, sampled, rewards, iteration, key)

    def shard_batch(mesh, batch):  # a minibatch of the update's train step
        if now["iteration"] == 1:
            raise jax.errors.JaxRuntimeError(OUT_OF_MEMORY)
        return real_shard(mesh, batch)

    def fault(patched):
        patched.setattr(train.Trainer, "update", update)
        patched.setattr(sharding, "shard_batch", shard_batch)

    line, config, workdir = _oom_run(tmp_path, monkeypatch, fault)
    assert line.startswith(
        "error: the device ran out of memory (28.80GiB) in the train step of iteration 2; "
    ), line
    named = _named_settings(line)
    assert {"train.rows_per_minibatch", "model.remat"} <= set(named) <= _schema_fields(), line
    assert "prompts.batch_size" not in named, line  # the rollout's, not the train step's
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
    kept = "its checkpoint after iteration 1 is kept; resume it with model.remat=True: "
    assert kept in line, line
    command = shlex.split(line.split(kept, 1)[1])
    assert command[:3] == ["python", "-m", "tree_grpo_jax.main"], command
    assert f"--workdir={workdir}" in command and "--config.model.remat=True" in command
    result = run_main(*command[3:])
    assert result.returncode == 0, result.stderr[-2000:]
    assert Checkpointer(str(workdir / "checkpoints")).latest_step == 3
    assert [r["step"] for r in train_rows(workdir)] == [1, 2, 3]  # none repeated, none lost
