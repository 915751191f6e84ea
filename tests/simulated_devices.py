"""Runs a command in a fresh Python on simulated CPU devices (XLA's host platform split into
N), this checkout's package and configs first on its path: the multi-device checks' one way
of starting their scripts and runs."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args: list[str], devices: int, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python *args` on `devices` simulated CPU devices; asserts it exits 0 (its stderr's
    end in the message otherwise)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
    }
    out = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def json_lines(args: list[str], devices: int) -> list[dict]:
    """The JSON objects a script prints, one a line, run as `run` runs it."""
    out = run(args, devices)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
