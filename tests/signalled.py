"""A signal that arrives in the middle of something: a short script run in a fresh Python on
the CPU (its own signal handling is not the test process's), with `signalled(call)` at hand,
which sends this process SIGTERM before calling through; or a command run so that a signal
reaches it after its work is done, as it exits (`run_ending`)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELUDE = """
import os, signal

def signalled(call):
    def on_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.5)  # time for the watcher thread to take it
        return call(*args, **kwargs)

    return on_signal
"""


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -c PRELUDE + script args`, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


ENDING = """
import atexit, os, runpy, signal, sys

module, where, signum = sys.argv[1], sys.argv[2], signal.Signals[sys.argv[3]]


def send(write=os.write, kill=os.kill, pid=os.getpid(), wait=signal.sigtimedwait):
    write(1, f"sending {signum.name} {where}\\n".encode())
    kill(pid, signum)
    wait([], 1.0)  # time for the watcher thread to take it


class Teardown:
    def __del__(self):  # Python's teardown, after the exit handlers: the modules are freed
        send()


if where == "in the teardown":
    teardown = Teardown()
else:  # the first exit handler to run once the command has ended
    from tree_grpo_jax import interrupts

    finish = interrupts.finish

    def finishing(status):
        atexit.register(send)
        finish(status)

    interrupts.finish = finishing
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_ending(module: str, where: str, signum, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` with `signum` sent to it after it has ended, while it exits:
    `where` is "in an exit handler" (Python's own, JAX's) or "in the teardown" (the modules
    freed, which takes a second or more after JAX or torch)."""
    return subprocess.run(
        [sys.executable, "-c", ENDING, module, where, signum.name, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
