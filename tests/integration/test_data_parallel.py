"""Every device of a host works in one process: on 4 and 8 simulated CPU devices the rollout's
leaves are split over all of them, FSDP shards the weights (and LoRA's frozen base) and
Adam's moments, and two iterations give one device's parameters and evaluation rewards
within float32 reduction order."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# Slow tier: each run is a process on 4 or 8 simulated devices.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "data_parallel.py")
# devices -> the meshes (kind:data:fsdp) trained on them
RUNS = {1: ["full:1:1", "lora:1:1"], 4: ["full:4:1"], 8: ["full:2:4", "lora:2:4"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The three processes run side by side (each compiles mostly on one core)."""
    folder = tmp_path_factory.mktemp("data_parallel")
    procs = {}
    for devices, meshes in RUNS.items():
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": ROOT,
        }
        out = folder / f"{devices}.npz"
        procs[devices] = (
            out,
            subprocess.Popen(
                [sys.executable, SCRIPT, str(out), *meshes],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    reports, arrays = {}, {}
    for devices, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report["devices"] == devices
        reports.update(report)
        reports[f"refusal:{devices}"] = report["refusal"]
        with np.load(out) as data:
            arrays.update({k: data[k] for k in data.files})
    return reports, arrays


def _params(arrays, run, when):
    prefix = f"{run}/{when}/"
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


@pytest.mark.parametrize(
    "run, reference", [("full:4:1", "full:1:1"), ("full:2:4", "full:1:1"), ("lora:2:4", "lora:1:1")]
)
def test_two_iterations_match_one_device(results, run, reference):
    reports, arrays = results
    start, end = _params(arrays, reference, "before"), _params(arrays, reference, "after")
    got = _params(arrays, run, "after")
    assert set(got) == set(end)
    change = max(float(np.abs(end[k] - start[k]).max()) for k in end)
    assert change > 1e-4  # training moved the weights, so the comparison means something
    worst = max(float(np.abs(got[k] - end[k]).max()) for k in end)
    assert worst <= 1e-4 * change, (worst, change)
    for when in ("eval_before", "eval_after"):
        for metric, value in reports[reference][when].items():
            assert reports[run][when][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric


@pytest.mark.parametrize("run, devices", [("full:4:1", 4), ("full:2:4", 8), ("lora:2:4", 8)])
def test_the_rollout_is_split_over_every_device(results, run, devices):
    reports, _ = results
    assert reports[run]["leaf_devices"] == devices
    assert reports[run]["leaf_shard_prompts"] == 8 // devices  # 8 prompts, one share each


def test_fsdp_shards_weights_moments_and_the_lora_base(results):
    reports, _ = results
    assert reports["full:4:1"]["weights_fsdp_sharded"] == 0
    full, lora = reports["full:2:4"], reports["lora:2:4"]
    assert full["weights_fsdp_sharded"] > 100 and full["moments_fsdp_sharded"] > 100
    assert lora["weights_fsdp_sharded"] == full["weights_fsdp_sharded"]  # the frozen base
    assert lora["moments_fsdp_sharded"] > 0  # the factors' moments


def test_a_batch_the_devices_do_not_divide_is_one_sentence(results):
    reports, _ = results
    assert reports["refusal:1"] == ""
    assert reports["refusal:4"] == (
        "prompts.batch_size (6) must be a multiple of the 4 devices the rollout is split over "
        "(mesh data x fsdp); 4 or 8 would work."
    )
