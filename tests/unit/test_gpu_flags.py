"""The XLA flags of a GPU run: merged into the user's XLA_FLAGS without overriding them, known
to the installed XLA, and what the GPU launch scripts hand the run."""

import os
import pathlib
import subprocess
import sys

import pytest

from tree_grpo_jax import gpu_flags
from tree_grpo_jax.gpu_flags import GPU_FLAGS, with_gpu_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = [flag.split("=", 1)[0] for flag, _ in GPU_FLAGS]


def test_every_flag_has_a_value_and_one_sentence():
    assert len(set(NAMES)) == len(NAMES)
    for flag, why in GPU_FLAGS:
        assert flag.startswith("--xla_gpu_") and "=" in flag
        assert why.endswith(".") and why.count(". ") == 0, why


def test_an_empty_environment_gets_every_flag_once():
    assert with_gpu_flags("") == " ".join(flag for flag, _ in GPU_FLAGS)
    assert with_gpu_flags("   ") == with_gpu_flags("")


def test_the_users_flags_stay_first_and_keep_their_values():
    mine = f"--xla_force_host_platform_device_count=4 {NAMES[0]}=false"
    merged = with_gpu_flags(mine)
    assert merged.startswith(mine + " ")
    tokens = merged.split()
    assert f"{NAMES[0]}=true" not in tokens
    assert [t for t in tokens if t.startswith(NAMES[0])] == [f"{NAMES[0]}=false"]
    for flag, _ in GPU_FLAGS[1:]:
        assert tokens.count(flag) == 1


@pytest.mark.parametrize("spelling", ["-{}=false", "--{}", "--{}=0"])
def test_any_spelling_of_a_flag_counts_as_set(spelling):
    name = NAMES[1].lstrip("-")
    merged = with_gpu_flags(spelling.format(name))
    assert sum(t.lstrip("-").split("=")[0] == name for t in merged.split()) == 1


def test_merging_twice_changes_nothing():
    for current in ("", "--xla_dump_to=/tmp/x", f"{NAMES[1]}=false --xla_dump_to=/tmp/x"):
        once = with_gpu_flags(current)
        assert with_gpu_flags(once) == once


def test_the_module_prints_the_merged_flags(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{NAMES[0]}=false")
    assert gpu_flags.main([]) == 0
    assert capsys.readouterr().out.strip() == with_gpu_flags(f"{NAMES[0]}=false")
    assert gpu_flags.main(["--bogus"]) == 2
    assert "usage" in capsys.readouterr().err


def test_the_installed_xla_knows_every_flag():
    """XLA aborts on a flag it does not know, on any platform: a flag renamed or dropped by a
    jaxlib upgrade shows here on the CPU rather than at a GPU run's start."""
    env = {**os.environ, "XLA_FLAGS": with_gpu_flags(""), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3.0"
