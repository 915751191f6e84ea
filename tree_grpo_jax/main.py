"""Command line: `python -m tree_grpo_jax.main --config=configs/tiny.py [--config.a.b=value]`.

A restart with the same `--workdir` resumes exactly from its last checkpoint. Exit status:
0 done (or already finished, or stopped by `eval.guard`, with one line saying why);
2 bad input (one `error:` sentence on stderr, nothing written); 1 training failed
(non-finite rewards, divergence; the last good checkpoint is kept);
130 / 143 after Ctrl-C / SIGTERM (the current iteration finishes and is checkpointed first;
a second signal stops at once, and the run resumes from its last checkpoint).
"""

from __future__ import annotations

import datetime
import difflib
import importlib.util
import os
import re
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics, pictures and checkpoints go (default runs/<name>/<time>)."
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def default_workdir(name: str) -> str:
    """runs/<name>/<time>; with several processes, the time of the primary one, so that
    every process names the same folder."""
    from tree_grpo_jax import sharding

    sharding.maybe_initialize_distributed()
    stamp = sharding.primary_text(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return os.path.join("runs", name, stamp)


# ---------------------------------------------------------------------------------------------
# Flags: every problem with the config file or an override is one sentence.


def _config_path(argv) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _fields(config, prefix="") -> list[str]:
    out = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        out.append(path)
        if hasattr(value, "items"):
            out += _fields(value, f"{path}.")
    return out


def _config_fields(path: str | None) -> list[str]:
    """Every field of the config file's `get_config()` ([] when it cannot be loaded)."""
    try:
        spec = importlib.util.spec_from_file_location("tree_grpo_jax_config_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return _fields(module.get_config())
    except Exception:  # noqa: BLE001 - fall back to a sentence without a suggestion
        return []


def _unknown_field(argv) -> str:
    """The sentence for an override naming a field the config does not have."""
    known = _config_fields(_config_path(argv))
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and match.group(1) not in known:
            field = match.group(1)
            flag = arg.split("=")[0]
            from tree_grpo_jax import config as cfg  # only now: it starts JAX

            moved = cfg.moved_fields().get(field)
            if moved:
                return f"the config has no field {field!r} (from {flag}): it moved to {moved}."
            close = difflib.get_close_matches(field, known, n=1)
            hint = f"; did you mean --config.{close[0]}?" if close else "."
            return f"the config has no field {field!r} (from {flag}){hint}"
    return "an override names a field the config does not have."


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with the config file loaded and its overrides applied here, so
    that a missing or broken file, an unknown field or a wrong type is one sentence."""
    try:
        rest = flags.FLAGS(argv)
        if _config_path(argv) is not None:
            # A file that failed to load yields a stand-in that raises when first read.
            CONFIG.value.keys()
    except flags.Error as e:
        message = first_line(e)
        message = re.sub(r"^(FATAL )?Flags parsing error: ", "", message)
        if "could not convert" in message or "invalid literal" in message:
            flag = message.split(":", 1)[0].replace("flag ", "")
            message = f"{flag} has the wrong type for that field ({message.split(': ')[-1]})"
        fail(message.rstrip(".") + ".", EXIT_BAD_INPUT)
    except (AttributeError, KeyError) as e:
        del e
        fail(_unknown_field(argv), EXIT_BAD_INPUT)
    except Exception as e:  # noqa: BLE001 - the config file itself failed
        path = _config_path(argv)
        if isinstance(e, OSError) and path and not os.path.isfile(path):
            fail(f"there is no config file {path!r} (from {os.getcwd()}).", EXIT_BAD_INPUT)
        reason = e.msg if isinstance(e, SyntaxError) else first_line(e)
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        fail(
            f"the config file {path!r} could not be loaded{where}: {type(e).__name__}: {reason}.",
            EXIT_BAD_INPUT,
        )
    return rest


# ---------------------------------------------------------------------------------------------
# The run.


def remove_if_empty(workdir: str) -> None:
    """A start that failed before writing anything leaves no folder behind."""
    if not os.path.isdir(workdir):
        return
    for _, _, files in os.walk(workdir):
        if files:
            return
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
    # Imported here so that `--help` and flag errors answer before JAX starts.
    from tree_grpo_jax import train

    config = CONFIG.value
    if config is None:
        fail("give a config file, e.g. --config=configs/tiny.py.", EXIT_BAD_INPUT)
    workdir = WORKDIR.value or default_workdir(config.get("name", "run"))
    existed = os.path.exists(workdir)
    cache = config.get("compile_cache")
    if cache is not None and cache.enabled:
        from tree_grpo_jax import compile_cache

        try:
            compile_cache.enable(cache.dir or None)
        except OSError as e:  # a cold start, not a failure
            print(f"warning: no compilation cache ({first_line(e)}).", file=sys.stderr)
    try:
        summary = train.train(config, workdir)
    except train.BAD_INPUT as e:
        if not existed:
            remove_if_empty(workdir)
        fail(first_line(e), EXIT_BAD_INPUT)
    except train.Interrupted as e:
        fail(str(e), EXIT_SIGNAL.get(e.signal_name, 130))
    except train.Stopped as e:
        if not existed:
            remove_if_empty(workdir)
        fail(
            f"{e.signal_name} stopped the run at once (while starting, or a second signal); the "
            f"same command resumes exactly from the last checkpoint in {workdir}/checkpoints, "
            "if any.",
            EXIT_SIGNAL.get(e.signal_name, 130),
        )
    except (train.RewardError, train.DivergenceError) as e:
        fail(str(e), EXIT_FAILED)

    from tree_grpo_jax import sharding

    if not sharding.is_primary():  # the primary process reports for all
        return
    if summary.get("guard_stop"):  # the loop printed why, and which checkpoint is best
        return
    if summary.get("already_finished"):
        print(
            f"already finished: {workdir} holds all {summary['iterations']} iterations "
            f"(eval reward {summary['last_eval_reward']:.4f}); raise --config.train.iterations "
            "to train further.",
            flush=True,
        )
        return
    print(
        f"done: eval reward {summary['first_eval_reward']:.4f} -> "
        f"{summary['last_eval_reward']:.4f}; this process ran {summary['session_s']:.0f}s "
        f"(model loading and compilation included), {summary['wall_time_s']:.0f}s of training "
        f"and evaluation in all; {summary['rollout_denoiser_calls_per_leaf']:.2f} denoiser "
        f"calls per leaf\n"
        f"  samples before: {summary['first_grid']}\n"
        f"  samples after:  {summary['last_grid']}\n"
        f"  reward curve:   {summary['reward_curve']}\n"
        f"  metrics:        {os.path.join(workdir, 'metrics.jsonl')}",
        flush=True,
    )


def run() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
