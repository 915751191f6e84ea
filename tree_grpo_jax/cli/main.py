"""Command line: `python -m tree_grpo_jax.main --config=configs/tiny.py [--config.a.b=value]`.

Every field of the config can be overridden with `--config.<section>.<field>=<value>` (a tuple
as a Python literal: `--config.tree.split_steps='(0,3)'`); `--print_config` prints every
field of the config with its value, overrides applied, and exits (the schema,
tree_grpo_jax/config/schema.py, documents them).

A restart with the same `--workdir` resumes exactly from its last checkpoint. Exit status:
0 done (or already finished, or stopped by `eval.guard`, with one line saying why);
2 bad input (one `error:` sentence on stderr, nothing written); 1 training failed
(non-finite rewards, divergence, the device out of memory; the last good checkpoint is
kept);
130 / 143 after Ctrl-C / SIGTERM (inside the training loop the current iteration finishes
and is checkpointed first; while starting or compiling, or on a second signal, the run stops
at once). Every line that tells how to go on prints the command, with `--workdir=` the run's
folder.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import shlex
import sys

from tree_grpo_jax import interrupts
from tree_grpo_jax.cli.common import (  # noqa: F401 - the commands' shared names, re-exported
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_SIGNAL,
    fail,
    latest_checkpoint,
    quiet_orbax,
    remove_if_empty,
    run_command,
    starting,
)
from tree_grpo_jax.cli.config_flag import (  # noqa: F401 - re-exported
    CONFIG,
    PRINT_CONFIG,
    WORKDIR,
    config_parser,
    parse_flags,
)
from tree_grpo_jax.errors import first_line

PARSER = config_parser("main", __doc__)


def default_workdir(name: str) -> str:
    """runs/<name>/<time>; with several processes, the time of the primary one, so that
    every process names the same folder."""
    from tree_grpo_jax import sharding

    sharding.maybe_initialize_distributed()
    stamp = sharding.primary_text(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return os.path.join("runs", name, stamp)


# ---------------------------------------------------------------------------------------------
# The run.


def _checked_config():
    """The config of the command line, validated (once: the run takes the reward weights
    found) before the compilation cache's folder, or the workdir, is made; and its reward
    weights."""
    from tree_grpo_jax import config as cfg
    from tree_grpo_jax.rewards import families as reward_families
    from tree_grpo_jax.rewards import registry as reward_registry
    from tree_grpo_jax.run import loop as train

    config = CONFIG.value
    if config is None:
        fail("give a config file, e.g. --config=configs/tiny.py.", EXIT_BAD_INPUT)
    try:
        rewards = cfg.validate(config, known_rewards=reward_registry.available_rewards())
    except train.BAD_INPUT as e:
        fail(first_line(e), EXIT_BAD_INPUT)
    # a served reward's server answers before anything is written
    sentence = reward_families.unreachable(
        [*rewards, *config.eval.extra_rewards], config.reward_options
    )
    if sentence:
        fail(sentence, EXIT_BAD_INPUT)
    return config, rewards


def _kept(checkpoints: str, command: str) -> str:
    """Where the run stands now, and the command that goes on from there."""
    step = latest_checkpoint(checkpoints)
    if "://" in checkpoints:
        return f"resume it from its last checkpoint in {checkpoints} with: {command}"
    if step is None:
        return f"nothing was trained yet; start it again with: {command}"
    return f"its checkpoint after iteration {step} is kept; resume it with: {command}"


def _out_of_memory(e, checkpoints: str, workdir: str) -> str:
    """The out-of-memory sentence, `plan`'s command for this config, and what the run holds:
    its checkpoint and the command that resumes it (with the first of the settings named
    that a resume accepts), or that nothing was saved (and a new workdir is gone)."""
    plan = run_command("plan", None)
    line = f"{e}; `{plan}` shows each program's memory per device before a run"
    step = latest_checkpoint(checkpoints)
    if step is None and "://" not in checkpoints:
        if os.path.exists(workdir):
            return f"{line}; no checkpoint was saved in {checkpoints}."
        return f"{line}; nothing was saved, so the new folder {workdir} is removed."
    where = f"after iteration {step}" if step is not None else f"in {checkpoints}"
    kept = f"its checkpoint {where} is kept"
    if not e.resumable:  # a resume must keep them all
        return (
            f"{line}; {kept}, but a resume may not change these settings: start a new run "
            f"with them and another --workdir, or resume it where more memory is free with: "
            f"{run_command('main', workdir)}"
        )
    field, value = next(iter(e.resumable.items()))
    resume = run_command("main", workdir, **{field.replace(".", "__"): value})
    return f"{line}; {kept}; resume it with {field}={value}: {resume}"


def _start_loading_programs(config) -> None:
    """A run of a config stored before starts loading its programs now, beside its checks
    and imports (`program_store.start_early`): only when its compilation cache folder, and
    the program store's in it, are already there (nothing is made before the checks)."""
    cache = None if config is None else config.get("compile_cache")
    if cache is None or not cache.enabled:
        return
    from tree_grpo_jax.run import compile_cache, program_store

    folder = pathlib.Path(cache.dir).expanduser() if cache.dir else compile_cache.default_dir()
    if not (folder / program_store.FOLDER).is_dir():
        return
    try:
        compile_cache.enable(folder)
    except (OSError, RuntimeError):  # the run's own enabling says why, after the checks
        return
    program_store.start_early(config)


def _enable_compile_cache(config) -> None:
    cache = config.compile_cache
    if not cache.enabled:
        return
    from tree_grpo_jax.run import compile_cache

    try:
        compile_cache.enable(cache.dir or None)
    except (OSError, RuntimeError) as e:  # a cold start, not a failure (RuntimeError: `~x`)
        print(f"warning: no compilation cache ({first_line(e)}).", file=sys.stderr)


def _train(config, workdir: str, rewards: dict) -> dict:
    """`train.train`, every way it can stop told in one line with the command that goes on."""
    from tree_grpo_jax.run import loop as train

    existed = os.path.exists(workdir)
    command = run_command("main", workdir)
    checkpoints = train.checkpoint_dir(config, workdir)
    interrupts.set_stop_line(
        lambda name: f"{name} stopped the run at once; {_kept(checkpoints, command)}"
    )
    _enable_compile_cache(config)
    try:
        return train.train(config, workdir, reward_weights=rewards)
    except train.BAD_INPUT as e:  # what the run created is gone already
        fail(first_line(e), EXIT_BAD_INPUT)
    except train.Interrupted as e:
        line = (
            str(e)
            if e.finished
            else (
                f"{e.signal_name} received; stopped after iteration {e.iteration}, saved in "
                f"{checkpoints}; resume it exactly with: {command}"
            )
        )
        fail(line, EXIT_SIGNAL.get(e.signal_name, 130))
    except train.Stopped as e:
        if not existed:
            remove_if_empty(workdir)
        fail(
            f"{e.signal_name} stopped the run at once; {_kept(checkpoints, command)}",
            EXIT_SIGNAL.get(e.signal_name, 130),
        )
    except train.OutOfMemory as e:
        fail(_out_of_memory(e, checkpoints, workdir), EXIT_FAILED)
    except (train.RewardError, train.DivergenceError, train.SaveError) as e:
        step = latest_checkpoint(checkpoints)
        after = ""
        if step is not None:
            after = f" To resume from the checkpoint after iteration {step}: {command}"
        fail(f"{e}{after}", EXIT_FAILED)


def _report(summary: dict, workdir: str, config) -> None:
    """The last lines: the run's outcome, where its files are, and the command that trains
    it further."""
    from tree_grpo_jax.run import loop as train

    if summary.get("guard_stop"):  # the loop printed why, and which checkpoint is best
        return
    further = run_command("main", workdir, train__iterations=2 * summary["iterations"])
    if summary.get("already_finished"):
        print(
            f"already finished: {workdir} holds all {summary['iterations']} iterations "
            f"(eval reward {summary['last_eval_reward']:.4g}); to train further, raise "
            f"--config.train.iterations: {further}",
            flush=True,
        )
        return
    metrics = os.path.join(workdir, "metrics.jsonl")
    if config.log.tensorboard:
        board = shlex.quote(os.path.join(workdir, "tensorboard"))
        metrics += f" (TensorBoard: tensorboard --logdir {board})"
    print(
        f"done: eval reward {summary['first_eval_reward']:.4g} -> "
        f"{summary['last_eval_reward']:.4g}; this process ran {summary['session_s']:.0f}s "
        f"(model loading and compilation included), {summary['wall_time_s']:.0f}s of training "
        f"and evaluation in all; {summary['rollout_denoiser_calls_per_leaf']:.2f} denoiser "
        f"calls per leaf\n"
        f"  samples before: {summary['first_grid']}\n"
        f"  samples after:  {summary['last_grid']}\n"
        f"  reward curve:   {summary['reward_curve']}\n"
        f"  metrics:        {metrics}\n"
        f"  checkpoints:    {train.checkpoint_dir(config, workdir)}\n"
        f"  train further:  {further}",
        flush=True,
    )


def main(argv=None) -> None:
    del argv
    quiet_orbax()
    # Imported here so that `--help` and flag errors answer before JAX starts.
    from tree_grpo_jax.run import reporting

    reporting.survive_closed_streams()  # a closed `| tee` must not lose an iteration
    with contextlib.suppress(Exception):  # a config the checks below refuse: they say why
        _start_loading_programs(CONFIG.value)
    config, rewards = _checked_config()
    workdir = WORKDIR.value or default_workdir(config.name)
    summary = _train(config, workdir, rewards)
    interrupts.set_stop_line(  # the run has ended and saved all it did: nothing to stop
        lambda name: f"{name} arrived after the run had ended; nothing was lost ({workdir})."
    )

    from tree_grpo_jax import sharding

    if sharding.is_primary():  # the primary process reports for all
        _report(summary, workdir, config)


def run() -> None:
    starting("main")
    main(parse_flags(sys.argv, PARSER))
    interrupts.finish(0)


if __name__ == "__main__":
    run()
