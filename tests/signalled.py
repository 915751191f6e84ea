"""A signal that arrives in the middle of something: a short script run in a fresh Python on
the CPU (its own signal handling is not the test process's), with `signalled(call)` at hand,
which sends this process SIGTERM before calling through."""

from __future__ import annotations

import os
import subprocess
import sys

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
