"""Wan2.1 through the command line on the weights-free tiny folder that
launch/tiny_folders.py writes, torch blocked throughout: one BranchGRPO iteration of
configs/wan_branchgrpo.py and one DiffusionNFT iteration of configs/wan_nft.py (shrunk by
overrides), a killed-and-rerun run that ends where the straight run ends, and the export;
bad options and folders, videos too long or too large for the transformer or the memory,
and an export onto another family's folder are one sentence with exit status 2 and nothing
written.
(tests/parity/test_wan_pipeline.py checks the numbers against diffusers.)"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from in_process import one_error_line, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHRINK = [
    "--config.model.compute_dtype=float32",
    "--config.model.remat=False",
    "--config.model.wan.resolution=(16,32)",  # the tiny VAE: 4 px per latent
    "--config.model.wan.num_frames=9",  # 3 latent frames
    "--config.model.wan.t5_max_length=8",
    "--config.rewards=jpeg_compressibility",
    "--config.prompts.source=digits",
    "--config.prompts.batch_size=1",
    "--config.prompts.eval_count=1",
    "--config.sampling.num_steps=3",
    "--config.train.rows_per_minibatch=4",
    "--config.train.grad_accumulation=1",
    "--config.train.learning_rate=1e-3",
    "--config.eval.every=0",
    "--config.checkpoint.every=1",
    "--config.log.tensorboard=False",
]
BRANCH = ["--config=configs/wan_branchgrpo.py", "--config.tree.split_steps=(0,1)"]


def shrunk(*overrides) -> list[str]:
    """The shrunk BranchGRPO run's flags with `overrides` in place of SHRINK's own."""
    replaced = {o.split("=")[0] for o in overrides}
    return [*BRANCH, *(a for a in SHRINK if a.split("=")[0] not in replaced), *overrides]


NFT = ["--config=configs/wan_nft.py", "--config.tree.group_size=2", "--config.lora.rank=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny folder written and the runs made in one Python with torch blocked: a
    2-iteration BranchGRPO run, rerun after its last checkpoint is removed (as a kill before
    it was written leaves it), an NFT iteration, and the BranchGRPO run's export."""
    tmp = tmp_path_factory.mktemp("wan")
    folder = tmp / "tiny" / "wan"
    code = textwrap.dedent(
        f"""
        import json, runpy, shutil, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.path.insert(1, "tests")
        sys.argv = ["tiny_folders.py", "--out={tmp / "tiny"}", "--kinds=wan"]
        runpy.run_path("launch/tiny_folders.py", run_name="__main__")
        from in_process import run_main
        from tree_grpo_jax.cli import export
        shrink = {SHRINK!r} + ["--config.model.path={folder}"]
        status = {{}}

        def run(name, workdir, *args):
            result = run_main(*args, *shrink, "--workdir={tmp}/" + workdir)
            said = result.stdout + result.stderr
            status[name] = [result.returncode, result.stdout[-1500:], result.stderr[-3000:]]
            status[name + "_released"] = "prompts encoded ahead; T5 released" in said
            status[name + "_resumed"] = "resumed from the checkpoint after iteration 1" in said

        run("straight", "straight", *{BRANCH!r}, "--config.train.iterations=2")
        # Killed after iteration 1's checkpoint: iteration 2's never written; then rerun.
        shutil.copytree("{tmp}/straight/checkpoints", "{tmp}/expected")
        shutil.rmtree("{tmp}/straight/checkpoints/2")
        run("rerun", "straight", *{BRANCH!r}, "--config.train.iterations=2")
        run("nft", "nft", *{NFT!r}, "--config.train.iterations=1")
        status["export"] = export.main(["--workdir={tmp}/straight", "--out={tmp}/exported"])
        print("STATUS" + json.dumps(status))
        assert sys.modules["torch"] is None
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1500,
        env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("STATUS"))
    return tmp, folder, json.loads(line[len("STATUS") :])


def _final_params(checkpoints):
    from tree_grpo_jax.run.checkpoint import Checkpointer

    return Checkpointer(str(checkpoints), read_only=True).restore_params()


def test_branchgrpo_and_nft_iterations_train(runs):
    import numpy as np

    tmp, _, status = runs
    for name in ("straight", "nft"):
        code, out, err = status[name]
        assert code == 0, err
        assert "done: eval reward" in out, out
        rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
        assert any("train/loss" in r and np.isfinite(r["train/loss"]) for r in rows), name
    assert status["straight_released"] and status["nft_released"]


def test_a_killed_run_rerun_ends_where_the_straight_run_ends(runs):
    import jax
    import numpy as np

    tmp, _, status = runs
    assert status["rerun"][0] == 0, status["rerun"][2]
    assert status["rerun_resumed"] and not status["straight_resumed"]
    expected, rerun = _final_params(tmp / "expected"), _final_params(tmp / "straight/checkpoints")
    moved = jax.tree_util.tree_map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), expected, rerun
    )
    assert max(jax.tree_util.tree_leaves(moved)) <= 1e-6, moved


def test_the_export_is_the_trained_transformer(runs):
    import jax
    import numpy as np

    from tree_grpo_jax.models.wan.load import load_wan

    tmp, folder, status = runs
    assert status["export"] == 0
    out = tmp / "exported"
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (out / part).is_dir(), part
    options = dict(resolution=(16, 32), num_frames=9, t5_max_length=8)
    exported, base = load_wan(str(out), **options), load_wan(str(folder), **options)
    trained = _final_params(tmp / "straight/checkpoints")
    for a, b in zip(jax.tree_util.tree_leaves(exported.params), jax.tree_util.tree_leaves(trained)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)
    changed = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(base.params))
    ]
    assert max(changed) > 0  # the iterations moved the weights


@pytest.mark.parametrize(
    "override, words",
    [
        ("--config.model.wan.num_frames=8", "model.wan.num_frames must be 4k + 1"),
        ("--config.model.wan.resolution=(16,20)", "model.wan.resolution must be (height, width)"),
        ("--config.model.wan.shift=-1.0", "model.wan.shift must be >= 0"),
        ("--config.model.wan.t5_max_length=513", "model.wan.t5_max_length must be in [1, 512]"),
    ],
)
def test_bad_options_are_one_sentence_and_write_nothing(tmp_path, override, words):
    result = run_main(*BRANCH, "--config.model.path=/nowhere", override, f"--workdir={tmp_path}/r")
    assert words in one_error_line(result)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("remove", ["text_encoder", "vae"])
def test_a_folder_missing_a_component_is_one_sentence_and_writes_nothing(runs, tmp_path, remove):
    _, folder, _ = runs
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / remove)
    args = [*BRANCH, *SHRINK, f"--config.model.path={broken}", f"--workdir={tmp_path}/r"]
    assert f"has no {remove}/" in one_error_line(run_main(*args))
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Wan folder alone (no run): its transformer has 32 rotary positions an axis."""
    from launch import tiny_folders

    return tiny_folders.write_folder("wan", tmp_path_factory.mktemp("tiny") / "wan")


def _run_on(folder, tmp_path, *overrides):
    """The shrunk BranchGRPO run on `folder` with `overrides` in place of SHRINK's own."""
    return run_main(*shrunk(*overrides), f"--config.model.path={folder}", f"--workdir={tmp_path}/r")


@pytest.mark.parametrize(
    "override, words",
    [
        # 1000001 frames once reached the prompt check, whose blank videos (57 GiB) did not
        # fit, and left checkpoints/ behind: 32 positions of one latent frame are 125 frames
        (
            "--config.model.wan.num_frames=1000001",
            "model.wan.num_frames 1000001 is more than the 125 this transformer can place",
        ),
        # 32 positions of 2x2 latents of 4 pixels: 256 pixels a side
        (
            "--config.model.wan.resolution=(16384,16384)",
            "model.wan.resolution 16384x16384 is larger than the 256 pixels a side",
        ),
    ],
)
def test_a_video_the_transformer_cannot_place_is_one_sentence(folder, tmp_path, override, words):
    line = one_error_line(_run_on(folder, tmp_path, override))
    assert words in line and "rope_max_seq_len" in line, line
    assert not (tmp_path / "r").exists()


def test_a_video_too_large_for_memory_names_its_size_not_the_batch(folder, tmp_path):
    """With rotary tables long enough, 4093 frames of 8192x8192 pixels are 64 GiB of latents
    a sample: not even one prompt's rollout fits, whatever the batch, and the sentence says
    which settings size the sample (the batch is 1 here)."""
    roomy = tmp_path / "roomy"
    shutil.copytree(folder, roomy)
    config = roomy / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_max_seq_len": 1024}))
    result = _run_on(
        roomy,
        tmp_path,
        "--config.model.wan.resolution=(8192,8192)",
        "--config.model.wan.num_frames=4093",
    )
    line = one_error_line(result)
    assert "one rollout stores about" in line and "even for one prompt" in line, line
    assert "each sample 64 GiB of latents (1024, 2048, 2048, 4)" in line, line
    assert "lower model.wan.resolution=(8192, 8192) or model.wan.num_frames=4093" in line, line
    assert "prompts.batch_size" not in line
    assert not (tmp_path / "r").exists()


def test_an_export_onto_another_familys_folder_names_the_family(runs, tmp_path, capsys):
    """A Wan run exported onto an SD1.5 folder: once told to add --allow_other_base, which
    then failed for want of transformer/; the folder is no Wan base at all, flag or not."""
    from launch import tiny_folders
    from tree_grpo_jax.cli import export

    tmp, folder, _ = runs
    sd15 = tiny_folders.write_folder("sd15", tmp_path / "sd15")
    out = tmp_path / "exported"
    args = [f"--workdir={tmp}/straight", f"--model_path={sd15}", f"--out={out}"]
    for extra in ([], ["--allow_other_base"]):
        assert export.main([*args, *extra]) == 2
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
        assert "Traceback" not in err, err
        assert f"{sd15} is a folder of the 'sd' model family (it has unet/)" in line, line
        assert "trained one of the 'wan' family (transformer/)" in line, line
        assert f"the run's own base, {folder}." in line and "--allow_other_base" not in line
        assert not out.exists()
