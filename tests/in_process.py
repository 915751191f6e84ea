"""A command line's own flag parsing and entry point, called in the test's process (its
bad-input cases then share one start of Python and JAX)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_process(module, *args, prog: str | None = None) -> subprocess.CompletedProcess:
    """`module.main` on `args` parsed as its command line parses them, from the repository
    root; stdout, stderr and the exit status as `subprocess.run` would give them."""
    from tree_grpo_jax.cli import config_flag

    out, err = io.StringIO(), io.StringIO()
    cwd, argv = os.getcwd(), sys.argv
    code = 0
    try:
        os.chdir(ROOT)
        sys.argv = [prog or module.__name__, *args]  # a run's printed command reads them here
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main(config_flag.parse_flags(sys.argv, module.PARSER))
    except SystemExit as e:
        code = e.code
    finally:
        os.chdir(cwd)
        sys.argv = argv
        # the next test starts from the flags' defaults, as a new process would (a flag left
        # set, e.g. evaluate's --prompts, would reach a later test's config through `.value`)
        for flag in (*getattr(module.PARSER, "flags", ()), *config_flag._SHARED):
            flag.value, flag.present = flag.default, False
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_main(*args) -> subprocess.CompletedProcess:
    """`python -m tree_grpo_jax.main *args`, in this process."""
    from tree_grpo_jax.cli import main as cli

    return run_in_process(cli, *args, prog="tree_grpo_jax.main")


def one_error_line(result: subprocess.CompletedProcess, status: int = 2) -> str:
    """The single `error:` line of a command that exited with `status`, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == status, result.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]
