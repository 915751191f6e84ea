"""What every command shares: exit statuses, the one `error:` line, argparse that fails in
one line, and reading a training run's folder (its config, its checkpoints) read-only.

Everything heavy is imported inside the functions, so that `--help` and bad flags answer
before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import sys

from tree_grpo_jax import interrupts
from tree_grpo_jax.errors import OneLineErrors, UserError, reason, redact, shorten

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


_QUIET_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "--helpxml", "--print_config")


def starting(command: str, torch_free: bool = True) -> None:
    """What every command does first, before its slow imports: a line on stderr saying it
    started (not for help or --print_config), Ctrl-C and SIGTERM taken over (`interrupts`: one line,
    exit 130 / 143, at any moment), and, `torch_free`, torch kept out of the process: the
    commands never use it, and diffusers' Flax modules would import it (seconds) when it is
    installed."""
    args = sys.argv[1:]
    if interrupts.installed():  # already said (an entry point that starts before importing)
        return
    interrupts.install()
    interrupts.set_stop_line(
        lambda name: (
            f"{name} stopped python -m tree_grpo_jax.{command} while it was starting; "
            "nothing was written."
        )
    )
    if torch_free and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, as when not installed
        # transformers 5 then advises, on import, that it found no torch: here that is meant
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not any(a.split("=")[0] in _QUIET_FLAGS for a in args):
        # on stderr, with the progress: stdout may be read by a program (`plan --json`)
        print(
            f"tree_grpo_jax.{command}: starting (loading JAX and the models' code)...",
            file=sys.stderr,
            flush=True,
        )


def quiet_orbax() -> None:
    """orbax logs every file it writes at INFO, through absl's logger: warnings only."""
    logging.getLogger("absl").setLevel(logging.WARNING)


def fail(message: str, status: int) -> None:
    """The `error:` line, user input in it shortened (`errors.shorten`) and a URL's password
    hidden (`errors.redact`), and the exit."""
    print(f"error: {shorten(redact(message))}", file=sys.stderr, flush=True)
    interrupts.finish(status)


def run_command(command: str, workdir: str | None, argv=None, **fields) -> str:
    """The command line that runs `workdir` again: `python -m tree_grpo_jax.<command>` with
    this process's arguments (`argv`, default sys.argv[1:]), `--workdir=<workdir>` after the
    config (none when `workdir` is None), and `--config.<field>=<value>` for each of
    `fields` (`train__iterations=60`), replacing the same override if given; quoted for a
    POSIX shell."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--workdir":
            skip = True
        elif not arg.startswith("--workdir="):
            kept.append(arg)
    for field, value in fields.items():
        flag = "--config." + field.replace("__", ".")
        kept = [a for a in kept if not (a == flag or a.startswith(flag + "="))]
        kept.append(f"{flag}={value}")
    at = next((i + 1 for i, a in enumerate(kept) if a.startswith("--config=")), 0)
    if at == 0 and "--config" in kept:  # `--config FILE`
        at = kept.index("--config") + 2
    if workdir is not None:
        kept.insert(at, f"--workdir={workdir}")
    line = " ".join(["python", "-m", f"tree_grpo_jax.{command}", *map(shlex.quote, kept)])
    # Simulated CPU devices decide the run's mesh: the run goes on only on as many.
    forced = re.search(
        r"--xla_force_host_platform_device_count=\S+", os.environ.get("XLA_FLAGS", "")
    )
    return f"XLA_FLAGS={shlex.quote(forced.group())} {line}" if forced else line


def latest_checkpoint(directory: str) -> int | None:
    """The newest step folder in a local checkpoint folder (None: none, or not local)."""
    if "://" in directory or not os.path.isdir(directory):
        return None
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    return max(steps, default=None)


def print_out(text: str) -> None:
    """`print(text)` to stdout. A reader that closed the pipe (`| head`) already has what it
    wanted: no BrokenPipeError traceback, now or when Python flushes stdout at exit. Any
    other failure to write (`> /dev/full`: no space left) is one `error:` line, exit 1."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _drop_stdout()
    except OSError as e:
        _drop_stdout()  # or the flush at exit fails again, with a traceback
        fail(f"could not write the output to stdout: {e.strerror or e}.", EXIT_FAILED)


def _drop_stdout() -> None:
    """What is still buffered for stdout goes nowhere."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def typed_flags(sentence: str, flags: dict[str, str]) -> str:
    """A sentence of the config's checks or of a model's loader, which name a setting by its
    config field (`eval.num_steps`) or by training's flag for it (`--config.model.path`),
    with the flag of this command that set it instead (`flags`: field -> flag, e.g.
    {"eval.num_steps": "--num_steps"}): the one the user typed."""
    for field, flag in flags.items():
        sentence = re.sub(rf"(?<![\w.-])(?:--config\.)?{re.escape(field)}(?!\w)", flag, sentence)
    return sentence


def remove_if_empty(workdir: str) -> None:
    """A start that failed before writing anything leaves no folder behind."""
    if not os.path.isdir(workdir):
        return
    for _, _, files in os.walk(workdir):
        if files:
            return
    shutil.rmtree(workdir, ignore_errors=True)


def command_parser(command: str, description: str, epilog: str) -> OneLineErrors:
    """The parser of `python -m tree_grpo_jax.<command>`: its help text laid out as written,
    and no abbreviated flags."""
    return OneLineErrors(
        prog=f"python -m tree_grpo_jax.{command}",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


class BadInput(UserError):
    """One sentence for the user; exit status 2."""


def run_config(workdir: str):
    """The config a training run in `workdir` was started with (its config.json, fields
    added since taking their defaults); BadInput with one sentence when there is none."""
    if not os.path.isdir(workdir):
        raise BadInput(f"there is no run folder {workdir}.")
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise BadInput(f"{workdir} holds no config.json, so it is not a training run's workdir.")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"could not read {path} ({type(e).__name__}: {e}).") from None
    if not isinstance(saved, dict):
        raise BadInput(f"{path} does not hold a run's config.")
    from tree_grpo_jax import config as cfg

    check_sections(saved, path)
    try:
        return cfg.saved_config(saved)
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # a field of another type
        raise BadInput(
            f"{path} is not a run's config as training writes it ({reason(e)})."
        ) from None


def shown_json(value, limit: int = 40) -> str:
    """A value read from a JSON file, as JSON, cut after `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def check_sections(saved: dict, path) -> None:
    """A run's config.json edited by hand: BadInput (one sentence) for a section of the
    schema that holds a value instead of fields."""
    from tree_grpo_jax import config as cfg

    schema = cfg.base_config()
    for section, value in saved.items():
        if hasattr(schema.get(section), "items") and not isinstance(value, dict):
            raise BadInput(
                f"{path} is not a run's config as training writes it: its {section!r} is "
                f"{shown_json(value)}, not a section of fields."
            )


def check_out(out: str) -> None:
    """An output folder that can be made and written, checked before anything is written."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise BadInput(f"cannot write to the output folder {out}: {path} is not a writable folder.")


def skipped_checkpoints(reasons: dict[int, str], steps: list[int], restored: int) -> str:
    """'' when `restored` is the newest of `steps`; otherwise the clause saying which newer
    checkpoints could not be read and why (`reasons`: `Checkpointer.unreadable`)."""
    newer = [s for s in steps if s > restored][::-1]

    def why(step: int) -> str:
        return f" ({reasons[step]})" if step in reasons else ""

    if not newer:
        return ""
    if len(newer) == 1:
        return f"instead of the newest, checkpoint {newer[0]}, which cannot be read{why(newer[0])}"
    said = ", ".join(f"{s}{why(s)}" for s in newer)
    return f"instead of the newer checkpoints {said}, which cannot be read"


def restore_run_state(directory: str, step: int | None = None, target=None):
    """(state, meta, step, skipped) of a run's checkpoint folder, opened read-only: the newest
    readable checkpoint (or `step`), as `Checkpointer.restore` returns it, with `skipped`
    the clause of `skipped_checkpoints`. Bad input raises ValueError or CheckpointError
    (one sentence); nothing is written."""
    from tree_grpo_jax.run.checkpoint import Checkpointer, CheckpointError

    ckpt = Checkpointer(directory, read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(f"there is no checkpoint in {ckpt.directory}.")
        if step is not None and step not in steps:
            raise ValueError(
                f"there is no checkpoint {step} in {ckpt.directory}; it holds "
                f"{', '.join(map(str, steps))}."
            )
        try:
            state, meta, restored = ckpt.restore(target, step)
        except CheckpointError:
            # Damage alone (every step tried has its warning line): say which, and why.
            tried = [step] if step is not None else steps[::-1]
            reasons = ckpt.unreadable
            if not all(s in reasons for s in tried):
                raise
            if step is not None:
                others = [s for s in steps if s != step]
                hint = f"; choose another --step ({', '.join(map(str, others))})" if others else ""
                raise CheckpointError(
                    f"checkpoint {step} in {ckpt.directory} cannot be read ({reasons[step]}){hint}."
                ) from None
            older = {1: "", 2: ", nor the older one"}.get(
                len(steps), f", nor the {len(steps) - 1} older ones"
            )
            raise CheckpointError(
                f"no checkpoint in {ckpt.directory} can be read: checkpoint {steps[-1]} "
                f"({reasons[steps[-1]]}){older}."
            ) from None
    finally:
        ckpt.close()
    return state, meta, restored, skipped_checkpoints(ckpt.unreadable, steps, restored)
