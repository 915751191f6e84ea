"""The training loop around `trainer.Trainer.iteration`: signals, resume, checkpoints,
evaluation, logs and the summary.

`train(config, workdir)` runs (or resumes) a run; `setup` (from `build`) gives the trainer
and its initial state without the loop. A restart with the same workdir resumes exactly
from its last checkpoint; SIGINT / SIGTERM finish the iteration in progress and save it.
With `eval.guard` on, an evaluation that shows reward hacking (guard.py) stops the run at
a checkpoint, the best evaluation's checkpoint kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time

import jax
import ml_collections
import numpy as np

from tree_grpo_jax import config as cfg
from tree_grpo_jax import interrupts, sharding
from tree_grpo_jax.evaluation import guard
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import fingerprint as run_fingerprint
from tree_grpo_jax.run import host_state, identity, precompile, program_store, reporting
from tree_grpo_jax.run.build import build, setup
from tree_grpo_jax.run.checkpoint import (
    Checkpointer,
    CheckpointError,
    SaveError,
    check_writable,
    fingerprint_mismatch,
    missing_folders,
)
from tree_grpo_jax.run.out_of_memory import OutOfMemory, out_of_memory
from tree_grpo_jax.run.scoring import DivergenceError, RewardError
from tree_grpo_jax.run.train_step import TrainState
from tree_grpo_jax.run.trainer import Trainer
from tree_grpo_jax.run.workdir import WorkdirBusy, WorkdirLock

__all__ = [
    "BAD_INPUT",
    "DivergenceError",
    "Interrupted",
    "OutOfMemory",
    "RewardError",
    "SaveError",
    "Stopped",
    "Trainer",
    "setup",
    "train",
]

BAD_INPUT = (
    cfg.ConfigError,
    CheckpointError,
    ModelLoadError,
    WorkdirBusy,
    FileNotFoundError,
    ValueError,  # prompt files, reward names, shapes of user inputs
)


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; the iteration then running finished and was saved
    (`finished`: it was the last one, and the run is complete)."""

    def __init__(self, signal_name: str, iteration: int, workdir: str, finished: bool = False):
        self.signal_name = signal_name
        self.iteration = iteration
        self.workdir = workdir
        self.finished = finished
        if finished:
            text = (
                f"{signal_name} received as the run finished; all {iteration} iterations are "
                f"done and saved in {workdir}/checkpoints, its summary in {workdir}/summary.json."
            )
        else:
            text = (
                f"{signal_name} received; stopped after iteration {iteration}, saved in "
                f"{workdir}/checkpoints; the same command with --workdir={workdir} resumes it "
                "exactly."
            )
        super().__init__(text)


class Stopped(BaseException):
    """A signal stopped the run at once (while starting, or a second signal); nothing was
    saved beyond the last checkpoint. A BaseException, so no `except Exception` swallows it."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(signal_name)


class _Signals:
    """SIGINT and SIGTERM as the run wants them.

    `defer=True` (the training loop): the first signal only asks the loop to stop after the
    iteration in progress (a half-done iteration cannot be saved: its update has consumed the
    previous state); a second one stops at once. `defer=False` (starting up, nothing to save
    yet): stop at once. A signal the parent process ignores stays ignored.
    """

    NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}

    FIRST = (
        "\n{name}: finishing the current iteration, then saving (send it again to stop at once)."
    )

    def __init__(self, defer: bool = True):
        self.defer = defer
        self._received: str | None = None
        self._previous = {}
        self._region = None

    @property
    def received(self) -> str | None:
        return interrupts.requested() if self._region is not None else self._received

    def _handle(self, signum, frame):
        name = self.NAMES[signum]
        if not self.defer or self._received:
            raise Stopped(name)
        self._received = name
        print(self.FIRST.format(name=name), file=sys.stderr, flush=True)

    def __enter__(self) -> _Signals:
        if interrupts.installed():  # the command line's watcher: it stops at any moment
            if self.defer:
                self._region = interrupts.deferred(self.FIRST)
                self._region.__enter__()
            return self
        if threading.current_thread() is threading.main_thread():
            for signum in self.NAMES:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._region is not None:
            self._region.__exit__(*exc)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _meta(trainer: Trainer, next_iteration: int, history: dict, host: dict) -> dict:
    return {
        "next_iteration": next_iteration,
        "seed": trainer.config.seed,
        "rng_key": np.asarray(jax.random.key_data(trainer.key)).tolist(),
        "fingerprint": run_fingerprint.fingerprint(trainer.config),
        "base_weights": trainer.adapter.base_fingerprint if trainer.adapter else None,
        "identity": identity.of_run(trainer.config),  # taken once, by check_resume
        "history": history,
        **host_state.in_meta(host),
    }


def check_resume(config: ml_collections.ConfigDict, ckpt: Checkpointer) -> None:
    """Refuses to resume checkpoints of another run, before anything heavy loads: another
    config, or the same config over other prompts or frozen files (identity.py). Takes the
    identity this run's checkpoints record."""
    if ckpt.latest_step is None:
        identity.measure(config, say=_say(config))
        return
    meta = ckpt.read_meta()
    saved = meta.get("fingerprint")
    if saved is None:
        raise CheckpointError(
            f"the checkpoints in {ckpt.directory} carry no run fingerprint, so they cannot be "
            "checked against this config; use another --workdir."
        )
    differs = run_mismatch(saved, config)
    if differs:
        raise CheckpointError(
            f"{ckpt.directory} holds another run ({differs}); resume it with its own config "
            "or choose another --workdir."
        )
    changed = identity.mismatch(meta.get("identity"), identity.measure(config, say=_say(config)))
    if changed:
        raise CheckpointError(changed)


def run_mismatch(saved: dict, config) -> str | None:
    """What makes `config` another run than the one whose fingerprint `saved` is (None: the
    same run). Both at the schema's defaults: a field the saved run predates, or a
    registered section the config leaves out, is run at its default."""
    return fingerprint_mismatch(
        run_fingerprint.with_added_defaults(saved),
        run_fingerprint.with_added_defaults(run_fingerprint.fingerprint(config)),
    )


def check_base_weights(trainer: Trainer, meta: dict, directory: str) -> None:
    """LoRA checkpoints (`meta` of one) fit only the base weights they were trained on."""
    saved_base = meta.get("base_weights")
    if trainer.adapter is not None and saved_base != trainer.adapter.base_fingerprint:
        raise CheckpointError(
            f"the LoRA checkpoints in {directory} were trained on other base weights "
            f"than {trainer.config.model.name} {trainer.config.model.path!r} holds now "
            "(their checksums differ); resume with the base weights they were trained on."
        )


def resume(trainer: Trainer, state: TrainState, ckpt: Checkpointer):
    """Restores the newest readable checkpoint in the workdir; a fresh start if none."""
    if ckpt.latest_step is None:
        return state, 0, {"eval": [], "wall_time": 0.0}
    check_base_weights(trainer, ckpt.read_meta(), ckpt.directory)
    state, meta, step = ckpt.restore(state)
    trainer.host_state.restore(meta, step, ckpt)
    return state, int(meta["next_iteration"]), meta["history"]


def save_eval(trainer: Trainer, iteration: int, params, history: dict, writer) -> dict:
    """Evaluates (every process takes part); the primary process writes the grid."""
    metrics, images, rewards, prompts = trainer.evaluator.evaluate_samples(params)
    path = os.path.join(trainer.workdir, f"eval_{iteration:05d}.png")
    columns = min(10, len(images))
    captions = [f"{p}\n{r:.4g}" for p, r in zip(prompts, rewards)]
    with interrupts.critical():  # a signal waits for the grid and the rows to be whole
        if sharding.is_primary():
            reporting.save_grid(path, images, columns=columns)
        writer.write(iteration, metrics, prefix="eval/")
        writer.write_image(iteration, "eval/samples", images, captions, columns)
    # a video's per-frame rewards stay in metrics.jsonl and TensorBoard: the run's record
    # (and the line below) keeps to one figure a metric
    kept = {k: v for k, v in metrics.items() if not reporting.is_frame_reward(k)}
    history["eval"].append({"iteration": iteration, **kept})
    if trainer.config.log.progress and sharding.is_primary():
        shown = " ".join(f"{k}={v:.4g}" for k, v in kept.items())
        print(f"eval after {iteration} iterations: {shown} -> {path}", flush=True)
    return metrics


def train(
    config: ml_collections.ConfigDict, workdir: str, reward_weights: dict | None = None
) -> dict:
    """Runs (or resumes) the configured training; returns the final summary. The config is
    validated here unless the caller did (the command line), which passes the reward weights
    `cfg.validate` returned."""
    session_start = time.time()
    if reward_weights is None:
        reward_weights = cfg.validate(config, known_rewards=reward_registry.available_rewards())
    if "://" in workdir:
        raise cfg.ConfigError(
            f"--workdir {workdir} is not a local folder; keep the workdir (logs, pictures) "
            f"local and put the checkpoints there with --config.checkpoint.dir={workdir}."
        )
    # Every process joins before anything is written: the primary one alone holds the
    # workdir's lock and writes its logs; all of them write the checkpoints together.
    sharding.maybe_initialize_distributed()
    _check_same_config(config)
    primary = sharding.is_primary()
    created = missing_folders(workdir)
    lock = WorkdirLock(workdir) if primary else None

    def stopped() -> None:  # a signal ends the process: the lock, and a new empty run, go
        if lock is not None:
            lock.release()
        if primary and created:
            _remove_new_run(workdir, created, checkpoint_dir(config, workdir))

    try:
        with interrupts.on_stop(stopped):
            _on_primary(lambda: (check_writable(workdir), lock.acquire()), "take the workdir")
            return _train_in(config, workdir, reward_weights, lock, session_start)
    except (*BAD_INPUT, OutOfMemory):
        # a new run that could not start, or ran out of memory before its first checkpoint,
        # leaves nothing behind: a start from scratch would write it all again
        if primary and created:
            _remove_new_run(workdir, created, checkpoint_dir(config, workdir))
        raise


def _remove_new_run(workdir: str, created: list[str], checkpoints: str) -> None:
    """Removes what a run that failed before its first checkpoint wrote in the folders it
    created; a checkpoint saved meanwhile keeps everything."""
    if os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)):
        return
    shutil.rmtree(workdir, ignore_errors=True)
    for folder in created[1:]:
        with contextlib.suppress(OSError):  # not empty: another run's, keep it
            os.rmdir(folder)


def _start_and_loop(config, workdir: str, reward_weights, primary: bool, ckpt) -> dict:
    check_resume(config, ckpt)
    program_store.start_early(config)  # stored programs load while the run builds
    trainer, state = build(config, workdir, reward_weights)
    state, start, history = resume(trainer, state, ckpt)
    if start < config.train.iterations:  # refused here if it cannot fit
        precompile.precompile(trainer, state, _say(config))
    # Written only once the resume checks have passed: it describes the checkpoints.
    # A finished run asked for fewer iterations than it holds keeps its own.
    written = os.path.join(workdir, "config.json")
    if primary and (start < config.train.iterations or not os.path.exists(written)):
        with interrupts.critical(), open(written, "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    return _loop(trainer, state, start, history, ckpt)


def _train_in(config, workdir: str, reward_weights, lock, session_start: float) -> dict:
    primary = lock is not None
    with _Signals(defer=False), contextlib.ExitStack() as held:
        if lock is not None:
            held.callback(lock.release)
        ckpt = Checkpointer(checkpoint_dir(config, workdir), keep=config.checkpoint.keep)
        try:
            summary = _start_and_loop(config, workdir, reward_weights, primary, ckpt)
        except jax.errors.JaxRuntimeError as e:  # building, compiling or training
            oom = out_of_memory(e, config)
            if oom is None:
                raise
            raise oom from None
        finally:
            ckpt.close()
    summary["session_s"] = time.time() - session_start
    return summary


def _say(config):
    """Prints a progress line on the primary process when the config asks for progress."""
    if config.log.progress and sharding.is_primary():
        return lambda line: print(line, flush=True)
    return lambda line: None


def _on_primary(action, what: str) -> None:
    """Runs `action` on the primary process alone; when it fails there, every process stops
    (the primary with its own sentence, the others naming it) instead of waiting for it."""
    error = None
    if sharding.is_primary():
        try:
            action()
        except BAD_INPUT as e:
            error = e
    if sharding.agree(float(error is not None)) > 0:
        raise error or WorkdirBusy(f"process 0 could not {what}; its error says why.")


def _check_same_config(config) -> None:
    """Processes of one job must compute the same thing: one sentence, on every process,
    when their configs differ in anything a resume would refuse (or in the mesh)."""
    if not sharding.multi_process():
        return
    text = json.dumps([run_fingerprint.fingerprint(config), config.mesh.to_dict()], sort_keys=True)
    digest = np.uint32(int(hashlib.sha256(text.encode()).hexdigest()[:8], 16))
    digests = sharding.gather(np.asarray([digest]))
    differ = np.flatnonzero(digests != digests[0])
    if differ.size:
        raise cfg.ConfigError(
            f"the {digests.size} processes of this job were started with different configs "
            f"(process {differ[0]} differs from process 0); give every process the same "
            "config file and overrides."
        )


def checkpoint_dir(config, workdir: str) -> str:
    """`checkpoint.dir` (a local folder or a gs:// URL) or `<workdir>/checkpoints`."""
    return config.checkpoint.dir or os.path.join(workdir, "checkpoints")


def _loop(trainer: Trainer, state, start: int, history: dict, ckpt: Checkpointer) -> dict:
    c, workdir = trainer.config, trainer.workdir
    total = c.train.iterations
    spec = trainer.spec().at(trainer.window_start(0))
    if start >= total and any(e["iteration"] == start for e in history["eval"]):
        # `iterations`: what the run holds, which may be more than train.iterations asks
        summary = summarize(trainer, spec, history, workdir)
        return {**summary, "iterations": start, "already_finished": True}
    stopped = _stopped_before(c, history, start, ckpt.directory)
    if stopped:
        return _guard_stop(trainer, spec, history, stopped)

    writer, progress = _reporting(trainer, state, spec, start)
    wall_start = time.time() - history.get("wall_time", 0.0)
    run = _Run(trainer, ckpt, history, writer, state, trainer.host_state.snapshot(), wall_start)
    if run.guarding and history.get("best_step") is not None:
        ckpt.protect(history["best_step"])
    try:
        with _Signals() as signals:
            stopped = run.train(start, progress, signals)
            if stopped:
                return _guard_stop(trainer, spec, history, stopped)
            summary = summarize(trainer, spec, history, workdir)
            if signals.received:  # it came too late to stop anything: say what is kept
                raise Interrupted(signals.received, total, workdir, finished=True)
    finally:
        writer.close()
    return summary


def _reporting(trainer: Trainer, state, spec, start: int):
    """(the metrics writer, the progress line) of a run starting after `start` iterations,
    and on the primary process, with progress on, the startup's lines."""
    c = trainer.config
    primary = sharding.is_primary()
    if primary:
        writer = reporting.MetricsWriter(
            trainer.workdir,
            c.log.tensorboard,
            c.log.wandb_project,
            resume_step=start if start else -1,  # afresh: a killed attempt's rows go
        )
    else:
        writer = reporting.NullWriter()
    progress = reporting.Progress(c.train.iterations, start, c.log.progress and primary)
    if c.log.progress and primary:
        print(
            f"{spec.describe()} | {c.prompts.batch_size} prompts x {spec.leaves} leaves | "
            f"model {trainer.model.name} | mesh {sharding.mesh_sizes(trainer.mesh)} | "
            f"workdir {trainer.workdir}",
            flush=True,
        )
        print(_training_line(trainer, state), flush=True)
        if start:
            print(f"resumed from the checkpoint after iteration {start}", flush=True)
    return writer, progress


class _Run:
    """The loop's state between iterations: the train state, the host's prompt and tracker
    state that goes with it (`HostState.snapshot`) and the history; and how they are saved and
    evaluated."""

    def __init__(self, trainer, ckpt, history, writer, state, host, wall_start):
        self.trainer, self.ckpt, self.history, self.writer = trainer, ckpt, history, writer
        self.state, self.host, self.wall_start = state, host, wall_start
        self.guarding = cfg.guard_on(trainer.config)
        self.primary = sharding.is_primary()

    def save(self, done: int) -> None:
        self.history["wall_time"] = time.time() - self.wall_start
        meta = _meta(self.trainer, done, self.history, self.host)
        replay = self.host[host_state.REPLAY]
        self.ckpt.save(done, self.state, meta, None if replay is None else replay.arrays())

    def evaluated(self, done: int) -> str | None:
        """Evaluates after `done` iterations; with the guard on, checkpoints a new best
        evaluation and returns the line to stop with when the guard says stop."""
        c, history = self.trainer.config, self.history
        save_eval(self.trainer, done, self.state.params, history, self.writer)
        if not self.guarding:
            return None
        if guard.best(history["eval"])["iteration"] == done:
            history["best_step"] = done
            self.ckpt.protect(done)
            self.save(done)
        reason = guard.check(c, history["eval"])
        if reason is None:
            return None
        if c.eval.guard.action == "warn":
            if self.primary:
                print(f"warning: guard: {reason}; training goes on.", file=sys.stderr, flush=True)
            return None
        self.save(done)
        return guard.stop_line(reason, done, guard.best(history["eval"]), self.ckpt.directory)

    def train(self, start: int, progress, signals) -> str | None:
        """Iterations `start` .. train.iterations, evaluated and checkpointed as the config
        asks, then the last evaluation and checkpoint: the guard's line to stop with, or
        None. A signal stops every process after the same iteration (`Interrupted`)."""
        c = self.trainer.config
        total = c.train.iterations
        if start == 0 and not self.history["eval"]:
            stopped = self.evaluated(0)
            if stopped:
                return stopped
        for iteration in range(start, total):
            done = self._iteration(iteration, start, progress)
            if done == total:
                break
            if c.eval.every and done % c.eval.every == 0:
                stopped = self.evaluated(done)
                if stopped:
                    return stopped
            stop = sharding.agree(float(signals.received is not None)) > 0
            if stop or (c.checkpoint.every and done % c.checkpoint.every == 0):
                self.save(done)
                # one that came during the save stops at this checkpoint
                stop = sharding.agree(float(signals.received is not None)) > 0
            if stop:
                raise Interrupted(signals.received or "SIGTERM", done, self.trainer.workdir)
        stopped = self.evaluated(total)
        self.save(total)
        return stopped

    def _iteration(self, iteration: int, start: int, progress) -> int:
        """One training iteration, its metrics written and shown: the iterations done."""
        try:
            self.state, metrics = self.trainer.iteration(self.state, iteration)
        except RewardError:
            # The update had not started: `state` still holds `iteration` finished
            # iterations, and `host` the prompt/tracker state that goes with them.
            if iteration > start:
                self.save(iteration)
            raise
        done = iteration + 1
        self.host = self.trainer.host_state.snapshot()
        with interrupts.critical():
            self.writer.write(done, metrics, prefix="train/")
        shown = ("reward_mean", "loss", "approx_kl", "clip_fraction")
        shown += self.trainer.method.objective.reported_metrics
        # in the metrics only with train.replay, and with node pruning
        shown += ("replayed_rows", "node_pruned")
        progress.update(
            iteration, metrics["time_iteration"], {k: metrics[k] for k in shown if k in metrics}
        )
        return done


def _training_line(trainer: Trainer, state) -> str:
    """What is trained, on what, for how long: the startup's second line."""
    c = trainer.config
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    if trainer.adapter is None:
        trained = f"full fine-tuning ({count:,} parameters)"
    else:
        trained = f"LoRA rank {trainer.adapter.rank} ({count:,} trainable parameters)"
    schedule = "" if c.train.lr_schedule == "constant" else f" {c.train.lr_schedule}"
    return (
        f"reward {c.rewards} | learning rate {c.train.learning_rate:g}{schedule} | "
        f"{c.train.iterations} iterations | {trained}"
    )


def _guard_stop(trainer: Trainer, spec, history: dict, line: str) -> dict:
    if sharding.is_primary():
        print(line, flush=True)
    return {**summarize(trainer, spec, history, trainer.workdir), "guard_stop": line}


def _stopped_before(config, history: dict, start: int, directory: str) -> str | None:
    """The guard's line when it stopped this run at its checkpoint `start` and, with the
    config as it is now, would stop it again."""
    evals = history["eval"]
    if not (cfg.guard_on(config) and config.eval.guard.action == "stop"):
        return None
    if not evals or evals[-1]["iteration"] != start:
        return None
    reason = guard.check(config, evals)
    if reason is None:
        return None
    line = guard.stop_line(reason, start, guard.best(evals), directory)
    return f"{line} (stopped earlier; change eval.guard to go on)"


def summarize(trainer: Trainer, spec, history: dict, workdir: str) -> dict:
    evals = history["eval"]
    steps = [e["iteration"] for e in evals]
    rewards = [e["reward_mean"] for e in evals]
    curve = os.path.join(workdir, "eval_reward.png")
    if sharding.is_primary():
        with interrupts.critical():
            reporting.save_curve(curve, steps, rewards, "eval reward", trainer.config.name)
    summary = {
        "iterations": trainer.config.train.iterations,
        "first_eval_reward": rewards[0],
        "last_eval_reward": rewards[-1],
        "wall_time_s": history["wall_time"],
        "rollout_denoiser_calls_per_leaf": spec.rollout_denoiser_calls(trainer.guidance)
        / spec.leaves,
        "first_grid": os.path.join(workdir, f"eval_{steps[0]:05d}.png"),
        "last_grid": os.path.join(workdir, f"eval_{steps[-1]:05d}.png"),
        "reward_curve": curve,
        "best_step": history.get("best_step"),
        "evals": evals,
    }
    if sharding.is_primary():
        with interrupts.critical(), open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary
