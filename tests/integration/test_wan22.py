"""Wan2.2 through the command line on the weights-free tiny folders that launch/tiny_folders.py
writes (`wan22`: TI2V-5B's layout, image to video from a prompt file naming a PNG;
`wan22-moe`: T2V-A14B's two experts), torch blocked: one BranchGRPO iteration of
configs/wan_branchgrpo.py each (shrunk by overrides) and the export,
which diffusers' WanPipeline loads (with `transformer_2` for the experts) holding the trained
weights. (tests/parity/test_wan22_pipeline.py checks the numbers against diffusers.)"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.test_wan import BRANCH, ROOT, SHRINK

KINDS = ("wan22", "wan22-moe")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan22")
    code = textwrap.dedent(
        f"""
        import json, runpy, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.path.insert(1, "tests")
        sys.argv = ["tiny_folders.py", "--out={tmp / "tiny"}", "--kinds={",".join(KINDS)}"]
        runpy.run_path("launch/tiny_folders.py", run_name="__main__")
        from in_process import run_main
        from tree_grpo_jax.cli import export
        import numpy as np
        from PIL import Image
        # TI2V animates each prompt's image: a prompt file naming a small PNG beside it.
        pixels = np.random.default_rng(0).integers(0, 256, (20, 36, 3), dtype=np.uint8)
        Image.fromarray(pixels).save("{tmp}/first.png")
        rows = [{{"prompt": p, "image": "first.png"}} for p in ("a cat", "a dog")]
        with open("{tmp}/prompts.jsonl", "w") as f:
            f.write("\\n".join(json.dumps(r) for r in rows) + "\\n")
        status = {{}}
        for kind in {KINDS!r}:
            prompts = "{tmp}/prompts.jsonl" if kind == "wan22" else "digits"
            shrink = [a for a in {SHRINK!r} if not a.startswith("--config.prompts.source=")]
            result = run_main(
                *{BRANCH!r}, *shrink, "--config.prompts.source=" + prompts,
                "--config.train.iterations=1",
                "--config.model.path={tmp}/tiny/" + kind, "--workdir={tmp}/run-" + kind,
            )
            status[kind] = [result.returncode, result.stdout[-1500:], result.stderr[-3000:]]
            status[kind + "_export"] = export.main(
                ["--workdir={tmp}/run-" + kind, "--out={tmp}/exported-" + kind]
            )
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
    return tmp, json.loads(line[len("STATUS") :])


@pytest.mark.parametrize("kind", KINDS)
def test_an_iteration_trains_and_the_export_loads_in_the_pipeline(runs, kind):
    import jax
    import numpy as np

    from tree_grpo_jax.models.wan.load import load_wan
    from tree_grpo_jax.run.checkpoint import Checkpointer

    tmp, status = runs
    code, out, err = status[kind]
    assert code == 0, err
    assert "done: eval reward" in out, out
    rows = [json.loads(x) for x in (tmp / f"run-{kind}" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r and np.isfinite(r["train/loss"]) for r in rows)
    assert status[kind + "_export"] == 0
    exported_dir = tmp / f"exported-{kind}"
    options = dict(resolution=(16, 32), num_frames=9, t5_max_length=8)
    exported = load_wan(str(exported_dir), **options)
    base = load_wan(str(tmp / "tiny" / kind), **options)
    assert exported.takes_input_images == base.takes_input_images == (kind == "wan22")
    trained = Checkpointer(str(tmp / f"run-{kind}" / "checkpoints"), read_only=True)
    trained = trained.restore_params()
    for a, b in zip(jax.tree_util.tree_leaves(exported.params), jax.tree_util.tree_leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    parts = ("transformer", "transformer_2") if kind == "wan22-moe" else (None,)
    for part in parts:  # every expert moved: the rollout's levels used both
        moved = jax.tree_util.tree_map(
            lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
            trained[part] if part else trained,
            base.params[part] if part else base.params,
        )
        assert max(jax.tree_util.tree_leaves(moved)) > 0, part
    torch = pytest.importorskip("torch")
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(exported_dir), torch_dtype=torch.float32)
    assert (pipe.transformer_2 is not None) == (kind == "wan22-moe")
    if kind == "wan22":
        assert pipe.config.expand_timesteps and pipe.vae.config.is_residual
        _animates_in_the_image_to_video_pipeline(exported, exported_dir, tmp / "first.png")


def _animates_in_the_image_to_video_pipeline(exported, exported_dir, first_frame):
    """The TI2V export in diffusers' `WanImageToVideoPipeline`: the trained weights animate
    the prompt file's image as our deterministic sampler does."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import WanImageToVideoPipeline
    from PIL import Image
    from wan_fixtures import image_to_video_latents

    from tree_grpo_jax.core import rollout
    from tree_grpo_jax.models.base import Sampling

    pipe = WanImageToVideoPipeline.from_pretrained(str(exported_dir), torch_dtype=torch.float32)
    assert pipe.config.expand_timesteps
    image = np.asarray(Image.open(first_frame))
    prompts = ["a cat", "a dog"]
    noise = np.random.default_rng(0).standard_normal((2, *exported.sample_shape)).astype("f4")
    schedule = exported.make_schedule(3, Sampling())
    expected = image_to_video_latents(
        pipe, image, noise, np.asarray(schedule.sigmas, np.float64), prompts=prompts,
        resolution=(16, 32), num_frames=9, tokens=8,
    )  # fmt: skip
    got = rollout.sample_deterministic(
        exported.denoise,
        exported.params,
        exported.encode_prompts(prompts, input_images=[[image], [image]]),
        jnp.asarray(noise),
        schedule,
    )
    np.testing.assert_allclose(
        np.asarray(got), expected, atol=1e-5 * max(1, np.abs(expected).max())
    )
