"""`mesh.sequence`: each sample's tokens split over devices in the DiT families (Ulysses).
The Wan, FLUX.1, SD3, FLUX.2 (klein), Qwen-Image and Z-Image tiny denoisers on simulated CPU
devices equal one device's, output and gradient, with all-to-alls in their programs and a
share of the FLOPs on each device; a Wan iteration through the command line with sequence 2
ends where one device's does. (Heads the axis does not divide:
tests/integration/test_ring_attention.py.)"""

import json
import os

import pytest

from tests import simulated_devices
from tests.integration.test_wan import shrunk
from tree_grpo_jax import sharding
from tree_grpo_jax.models import registry

SCRIPT = os.path.join(simulated_devices.ROOT, "tests", "scripts", "sequence_parallel.py")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from launch import tiny_folders

    return tiny_folders.write_folder("wan", tmp_path_factory.mktemp("tiny") / "wan")


def test_a_mesh_without_sequence_keeps_its_batch_axes():
    mesh = sharding.make_mesh(1, 1)
    assert mesh.axis_names == ("data", "fsdp", "sequence")
    assert sharding.sequence_size(mesh) == 1 and sharding.num_batch_shards(mesh) == 1
    assert sharding.mesh_sizes(mesh) == {"data": 1, "fsdp": 1}  # as a run reports it


def test_the_plan_reads_wans_attention_arrays_off_its_denoiser(folder):
    """The time plan's all-to-all bytes of one Wan row (`plan.sequence_traffic`), against the
    tiny transformer's config by hand."""
    from configs import wan_branchgrpo
    from tree_grpo_jax.plan import sequence_traffic

    config = wan_branchgrpo.get_config()
    config.model.path = str(folder)
    config.model.wan.resolution = (16, 32)
    config.model.wan.num_frames = 9
    config.model.wan.t5_max_length = 8
    model = registry.abstract_model(config.model)
    frames, height, width, _ = model.sample_shape
    assert (frames, height, width) == (3, 4, 8)
    tokens = frames * (height // 2) * (width // 2)  # patches of 1 x 2 x 2: 24
    text, wide, layers, item = 8, 2 * 8, 2, 2  # T5 tokens, heads x head_dim, blocks, bfloat16
    # each block: self-attention's q, k, v over the tokens, cross-attention's q over the tokens
    # and its k, v over the text; an output over the tokens from each
    to_heads = layers * (4 * tokens + 2 * text) * wide * item
    to_tokens = layers * 2 * tokens * wide * item
    ex = sequence_traffic.exchange(model, 2, 1)
    assert (ex.to_heads, ex.to_tokens, ex.attention_calls) == (to_heads, to_tokens, 4)


# family -> (its tiny folder's kind, the (data, fsdp, sequence) meshes each case compares)
SPLIT = [(1, 1, 2), (1, 2, 2)]
FAMILIES = {
    "wan": (
        "wan",
        {"wan_tiny_folder": [*SPLIT, (2, 1, 2)], "wan_four_heads": [(1, 1, 4), (1, 2, 2)]},
    ),
    "flux": ("flux", {"flux_tiny_folder": SPLIT}),
    "sd3": ("sd35", {"sd3_tiny_folder": SPLIT}),
    "flux2": ("flux2-klein", {"flux2_tiny_folder": SPLIT}),
    "qwenimage": ("qwenimage", {"qwenimage_tiny_folder": SPLIT}),
    "zimage": ("zimage", {"zimage_tiny_folder": SPLIT}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dit_denoisers_with_tokens_split_equal_one_device(family, tmp_path):
    from launch import tiny_folders

    kind, cases = FAMILIES[family]
    folder = tiny_folders.write_folder(kind, tmp_path / kind)
    results = simulated_devices.json_lines([SCRIPT, family, str(folder)], devices=4)
    for r in results:
        print(json.dumps(r))  # the measured differences, for the record (pytest -s)
    meshes = {(r["case"], tuple(r["mesh"])) for r in results}
    assert meshes == {(case, mesh) for case, listed in cases.items() for mesh in listed}
    for r in results:
        assert r["rows_differ"]  # the rows are not copies of one another
        # float32 reordering, nothing more (measured: outputs to 5e-6, gradients to 2.3e-5
        # of their largest, FLUX.2's 1.5e-3 of 64); a wrong layout would differ by the
        # gradients' own size
        assert r["out_diff"] < 1e-5 * r["out_scale"], r
        assert r["grad_diff"] < 5e-5 * r["grad_scale"], r
        # the compiler moved tokens to heads and back (forward, and gradient)
        assert min(r["all_to_alls"]) > 0, r
        # each device computes its share, not every token (replicated parts aside)
        devices = r["mesh"][0] * r["mesh"][1] * r["mesh"][2]
        assert r["flops_share"] < 1.4 / devices, r


# test_wan's shrunk run, one iteration and a smooth reward (a JPEG size would flip on rounding)
RUN = (
    "--config.rewards=digit_probability",
    "--config.train.iterations=1",
    "--config.compile_cache.enabled=False",
)


def _train(folder, workdir, devices: int, *overrides):
    args = [*shrunk(*RUN, *overrides), f"--config.model.path={folder}", f"--workdir={workdir}"]
    out = simulated_devices.run(["-m", "tree_grpo_jax.main", *args], devices)
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = next(m for m in metrics if "train/loss" in m)
    return out.stdout + out.stderr, train


# name -> (the split run's mesh, flags both runs share)
ITERATIONS = {
    "sequence 2": ({"data": 1, "fsdp": 1, "sequence": 2}, []),
    # 12 tokens a video and 2 heads: sequence 4 attends by the ring, beside fsdp 2
    "fsdp 2 x sequence 4": (
        {"data": 1, "fsdp": 2, "sequence": 4},
        ["--config.model.wan.resolution=(32,32)", "--config.prompts.batch_size=2"],
    ),
    "LoRA, data 2 x sequence 2": (
        {"data": 2, "fsdp": 1, "sequence": 2},
        ["--config.lora.rank=2", "--config.prompts.batch_size=2"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ITERATIONS))
def test_a_wan_iteration_with_tokens_split_ends_where_one_device_does(case, folder, tmp_path):
    """The whole run (rollout, decode, rewards, train step, checkpoint) on a mesh with a
    'sequence' axis: the same rewards and loss, and the same weights up to Adam's reading of
    float32 noise in gradients near zero, as one device."""
    import jax
    import numpy as np

    from tree_grpo_jax.run.checkpoint import Checkpointer

    mesh, shared = ITERATIONS[case]
    devices = mesh["data"] * mesh["fsdp"] * mesh["sequence"]
    split_flags = [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]
    _, one = _train(folder, tmp_path / "one", 1, *shared)
    said, split = _train(folder, tmp_path / "split", devices, *shared, *split_flags)
    assert f"mesh {mesh}" in said
    # the rollout's rewards, the loss and the gradient's norm: float32 rounding apart
    for key, rel in (("train/reward_mean", 1e-5), ("train/loss", 1e-3), ("train/grad_norm", 1e-5)):
        assert split[key] == pytest.approx(one[key], rel=rel), key
    params = [
        Checkpointer(str(tmp_path / run / "checkpoints"), read_only=True).restore_params()
        for run in ("one", "split")
    ]
    diffs = np.concatenate(
        [np.ravel(a - b) for a, b in zip(*(jax.tree_util.tree_leaves(p) for p in params))]
    )
    # Adam's first step is about lr * sign(gradient): a gradient near zero, where float32
    # noise decides its size, moves its weight anywhere up to lr = 1e-3. Measured: 1 weight
    # in 10048 differs by more than 1e-5 (6.8e-5), the mean difference is 1.3e-8.
    assert np.max(np.abs(diffs)) < 2e-3
    assert np.mean(np.abs(diffs) > 1e-5) < 1e-3
