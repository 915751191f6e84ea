"""One train step on 8 simulated CPU devices equals the step on one device; the run's decode
splits its rows over the devices and gives what one device gives."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tree_grpo_jax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_step.py")
DECODE_SCRIPT = os.path.join(ROOT, "tests", "scripts", "device_decode.py")


def test_fsdp_rule_shards_largest_divisible_dimension():
    assert sharding.fsdp_spec((64, 128), 4) == sharding.P(None, "fsdp")
    assert sharding.fsdp_spec((128, 6), 4) == sharding.P("fsdp", None)
    assert sharding.fsdp_spec((3, 5), 4) == sharding.P()
    assert sharding.fsdp_spec((64,), 1) == sharding.P()
    # with a sequence axis the weights split over 'fsdp' and 'sequence' together ...
    both = ("fsdp", "sequence")
    assert sharding.fsdp_spec((64, 128), 4, 2) == sharding.P(None, both)
    assert sharding.fsdp_spec((6, 128), 1, 2) == sharding.P(None, both)
    # ... over 'fsdp' alone where their product divides no dimension, else replicated
    assert sharding.fsdp_spec((12, 6), 4, 2) == sharding.P("fsdp", None)
    assert sharding.fsdp_spec((3, 5), 4, 2) == sharding.P()


def test_mesh_shape_resolves_and_rejects():
    assert sharding.mesh_shape(-1, 4, num_devices=8) == (2, 4)
    assert sharding.mesh_shape(2, -1, num_devices=8) == (2, 4)
    with pytest.raises(ValueError, match="does not cover the 8 available device"):
        sharding.mesh_shape(3, 1, num_devices=8)
    # -1 beside an axis that does not divide the devices: that axis is named, not a 0
    with pytest.raises(ValueError, match=r"^mesh.fsdp=3 does not divide the 8 available"):
        sharding.mesh_shape(-1, 3, num_devices=8)
    with pytest.raises(ValueError, match=r"^mesh.data=3 does not divide the 8 available"):
        sharding.mesh_shape(3, -1, num_devices=8)
    # 'sequence' takes its devices first; data and fsdp share what it leaves
    assert sharding.mesh_shape(-1, 2, num_devices=8, sequence=2) == (2, 2)
    assert sharding.mesh_shape(1, -1, num_devices=8, sequence=4) == (1, 2)
    with pytest.raises(ValueError, match=r"^mesh.sequence=3 does not divide the 8 available"):
        sharding.mesh_shape(-1, 1, num_devices=8, sequence=3)
    with pytest.raises(ValueError, match=r"^mesh.fsdp=3 does not divide the 4 device\(s\) mesh"):
        sharding.mesh_shape(-1, 3, num_devices=8, sequence=2)
    with pytest.raises(ValueError, match=r"data=2 x fsdp=2 x sequence=4 does not cover the 8"):
        sharding.mesh_shape(2, 2, num_devices=8, sequence=4)


@pytest.mark.slow
def test_train_step_on_8_devices_matches_one_device():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,  # this checkout's package
    }
    out = subprocess.run(
        [sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(result["loss_8"], result["loss_1"], rtol=1e-5, atol=1e-6)
    assert result["param_change"] > 1e-4  # the step really moved the parameters
    assert result["max_param_diff"] < 1e-5
    # [64, 64] kernel: split 4 ways over 'fsdp' along one dimension, spread over 8 devices.
    assert "fsdp" in result["kernel_spec"] and "fsdp" in result["adam_mu_spec"]
    assert sorted(result["kernel_shard_shape"]) == [16, 64]
    assert result["devices"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("sequence", [1, 2])
def test_each_device_decodes_its_own_rows(sd3_folder, sequence):
    """The trainer's decode (`Trainer.device_decode`) of a loaded SD3 VAE on 4 simulated
    devices: each device holds and decodes a quarter of the rows, at a quarter of one device's
    FLOPs, with the same images, also where a 'sequence' axis of 2 gives two devices the same
    rows of a batch; the model's `decode` jitted on the batch's split rows computes every row
    on every device (its loop over rows gathers them)."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
    }
    out = subprocess.run(
        [sys.executable, DECODE_SCRIPT, str(sd3_folder), str(sequence)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["shard_rows"] == [result["rows"] // 4]
    assert result["max_diff"] < 1e-5
    one = result["one_device_flops"]
    assert result["flops_trainer"] == pytest.approx(one / 4, rel=0.01)
    assert result["flops_model_jit"] == pytest.approx(one, rel=0.01)
