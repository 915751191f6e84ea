"""The XLA flags of a GPU run: merged into the user's XLA_FLAGS without overriding them, known
to the installed XLA, and what the GPU launch scripts hand the run."""

import json
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
    mine = "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/hlo"
    merged = with_gpu_flags(mine)
    assert merged == " ".join([mine, *(flag for flag, _ in GPU_FLAGS)])
    for name in NAMES:
        tokens = with_gpu_flags(f"{mine} {name}=false").split()
        assert [t for t in tokens if t.startswith(name)] == [f"{name}=false"]
        assert tokens[:3] == [*mine.split(), f"{name}=false"]


@pytest.mark.parametrize("spelling", ["-{}=false", "--{}", "--{}=0"])
def test_any_spelling_of_a_flag_counts_as_set(spelling):
    for name in (n.lstrip("-") for n in NAMES):
        merged = with_gpu_flags(spelling.format(name))
        assert sum(t.lstrip("-").split("=")[0] == name for t in merged.split()) == 1


def test_merging_twice_changes_nothing():
    for current in ("", "--xla_dump_to=/tmp/x", f"{NAMES[-1]}=false --xla_dump_to=/tmp/x"):
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


FAKE_PYTHON = """#!{python}
import json, os, sys
if sys.argv[1:3] == ["-m", "tree_grpo_jax.gpu_flags"]:
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
keys = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PROCESS_ID")
print(json.dumps({{"argv": sys.argv[1:], **{{k: os.environ.get(k) for k in keys}}}}))
"""


def launch(tmp_path, script, env, *args):
    """Runs launch/<script> with PYTHON a stand-in that runs the flags module for real and,
    for the run, prints what it was started with."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    done = subprocess.run(
        ["bash", f"launch/{script}", "configs/tiny.py", "--config.seed=3"],
        cwd=ROOT,
        env={**base, "PYTHON": str(fake), "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


MULTIHOST = {"COORDINATOR": "host0:1234", "NUM_PROCESSES": "2", "PROCESS_ID": "1"}


@pytest.mark.parametrize(
    "script, env",
    [("gpu.sh", {}), ("multihost_gpu.sh", {**MULTIHOST, "WORKDIR": "/shared/a"})],
)
def test_the_gpu_scripts_start_the_run_with_the_flags(tmp_path, script, env):
    seen = launch(tmp_path, script, env)
    assert seen["XLA_FLAGS"] == with_gpu_flags("")
    assert seen["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.92"
    assert seen["argv"][:3] == ["-m", "tree_grpo_jax.main", "--config=configs/tiny.py"]
    assert seen["argv"][-1] == "--config.seed=3"
    if script == "multihost_gpu.sh":
        assert seen["JAX_PROCESS_ID"] == "1" and "--workdir=/shared/a" in seen["argv"]


@pytest.mark.parametrize("script", ["gpu.sh", "multihost_gpu.sh"])
def test_the_gpu_scripts_pass_a_sequence_size_through(tmp_path, script):
    env = {**MULTIHOST, "WORKDIR": "/shared/a"} if script == "multihost_gpu.sh" else {}
    assert not any("mesh.sequence" in a for a in launch(tmp_path, script, env)["argv"])
    seen = launch(tmp_path, script, {**env, "SEQUENCE": "4"})
    assert "--config.mesh.sequence=4" in seen["argv"]
    assert seen["argv"][-1] == "--config.seed=3"  # the command line's own flags come last


@pytest.mark.parametrize("script", ["gpu.sh", "multihost_gpu.sh"])
def test_the_gpu_scripts_keep_the_users_own_settings(tmp_path, script):
    mine = f"--xla_dump_to=/tmp/hlo {NAMES[-1]}=false"
    env = {"XLA_FLAGS": mine, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}
    if script == "multihost_gpu.sh":
        env.update(MULTIHOST, WORKDIR="/shared/a")
    seen = launch(tmp_path, script, env)
    assert seen["XLA_FLAGS"] == with_gpu_flags(mine)
    assert f"{NAMES[-1]}=false" in seen["XLA_FLAGS"].split()
    assert seen["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"


def test_the_docs_table_has_every_flag():
    text = (ROOT / "docs/devices-and-hosts.md").read_text()
    for flag, _ in GPU_FLAGS:
        assert f"| `{flag}` |" in text, flag
