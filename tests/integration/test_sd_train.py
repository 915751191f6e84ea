"""The SD1.5 path end to end on a tiny random SD folder in the real on-disk format: the main
command trains one iteration with guidance, and the run exports to PyTorch diffusers."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from tree_grpo_jax.cli import export
from tree_grpo_jax.models.sd15.load import load_sd
from tree_grpo_jax.run.checkpoint import Checkpointer

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sd15_config_trains_one_iteration_and_exports(sd_folder, tmp_path):
    folder = sd_folder
    workdir = tmp_path / "run"
    overrides = [
        f"--config.model.path={folder}",
        "--config.model.compute_dtype=float32",
        "--config.prompts.batch_size=1",
        "--config.prompts.eval_count=2",
        "--config.sampling.num_steps=4",
        "--config.tree.window=2",
        "--config.train.iterations=1",
        "--config.train.rows_per_minibatch=4",
        "--config.train.grad_accumulation=1",
        "--config.train.learning_rate=1e-3",
        "--config.train.clip_range=0.2",
        "--config.log.tensorboard=False",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tree_grpo_jax.main",
            "--config=configs/sd15.py",
            f"--workdir={workdir}",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: eval reward" in result.stdout
    assert (workdir / "eval_00001.png").exists()

    trained = Checkpointer(str(workdir / "checkpoints")).restore_params()
    base = load_sd(str(folder)).params
    changed = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(base))
    ]
    assert max(changed) > 0  # the iteration updated the UNet

    out = tmp_path / "exported"
    assert export.main([f"--workdir={workdir}", f"--out={out}"]) == 0
    reloaded = load_sd(str(out))
    flat = flatten_dict(jax.device_get(trained))
    for key, value in flatten_dict(reloaded.params).items():
        np.testing.assert_allclose(value, flat[key], rtol=0, atol=0)
