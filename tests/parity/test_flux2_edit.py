"""FLUX.2-klein editing end to end on the tiny klein folder (tests/flux2_fixtures.py): a
prompt file whose rows name digit images and an instruction, configs/flux2_klein_edit.py
with the `input_similarity` reward, one TreeGRPO iteration in a process without torch, and
the exported folder in diffusers' Flux2KleinPipeline sampling with an input image (`image=`)
what our sampler gives with the trained params."""

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageDraw

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
import edit_fixtures  # noqa: E402
import family_checks  # noqa: E402
from edit_fixtures import ROWS  # noqa: E402
from flux2_fixtures import RESOLUTION  # noqa: E402

from tree_grpo_jax.models.flux2.load import load_flux2  # noqa: E402

TEXT_TOKENS = 64
SIDE = 64  # the input images' side: the pipeline takes references of 64 pixels and more


def _digit(value: int) -> np.ndarray:
    """A white digit on black, SIDE pixels square."""
    picture = Image.new("L", (SIDE // 4, SIDE // 4))
    ImageDraw.Draw(picture).text((4, 2), str(value), fill=255)
    return np.asarray(picture.resize((SIDE, SIDE), Image.Resampling.NEAREST).convert("RGB"))


def test_an_editing_iteration_and_the_export_edits_in_the_pipeline(flux2_klein_folder, tmp_path):
    from diffusers import Flux2KleinPipeline

    workdir, out = tmp_path / "run", tmp_path / "exported"
    options = dict(
        text_max_length=TEXT_TOKENS,
        resolution=RESOLUTION,
        reference_images=1,
        reference_resolution=SIDE,
    )
    overrides = [
        f"--config.model.path={flux2_klein_folder}",
        *(f"--config.model.flux2.{k}={v}" for k, v in options.items()),
        f"--config.prompts.source={edit_fixtures.prompt_file(tmp_path, _digit)}",
        "--config.rewards=input_similarity",
        "--config.eval.num_steps=0",
        "--config.tree.window=1",
        "--config.train.rows_per_minibatch=2",
    ]
    family_checks.train_one_iteration_without_torch(
        "configs/flux2_klein_edit.py",
        workdir,
        overrides,
        released="prompts encoded ahead; text encoder released",
    )
    model = load_flux2(str(flux2_klein_folder), **options)
    trained = family_checks.export_the_trained_params(workdir, out, model.params)

    pipe = Flux2KleinPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    digit = _digit(3)
    noise = np.random.default_rng(1).standard_normal((1, *model.sample_shape)).astype("f4")
    with torch.no_grad():
        expected = pipe(
            prompt=ROWS[0][0],
            image=Image.fromarray(digit),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=3,
            latents=torch.from_numpy(noise),
            output_type="latent",
            max_sequence_length=TEXT_TOKENS,
        ).images.numpy()
        pictures = pipe(
            prompt=ROWS[0][0],
            image=Image.fromarray(digit),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=3,
            output_type="np",
            max_sequence_length=TEXT_TOKENS,
        ).images
    assert pictures.shape == (1, RESOLUTION, RESOLUTION, 3) and np.isfinite(pictures).all()
    cond = model.encode_prompts([ROWS[0][0]], input_images=[[digit]])
    got = rollout.sample_deterministic(
        model.denoise, trained, cond, jnp.asarray(noise), model.make_schedule(3, Sampling())
    )
    before = rollout.sample_deterministic(
        model.denoise, model.params, cond, jnp.asarray(noise), model.make_schedule(3, Sampling())
    )
    # the klein pipeline returns its latents denormalised and unpatched; ours the same way
    got, before = (_denormalised(pipe, np.asarray(x)) for x in (got, before))
    diff = np.abs(got - expected).max()
    moved = np.abs(got - before).max()
    print(f"edited latents max abs difference {diff:.2e} (up to {np.abs(expected).max():.2f};"
          f" the iteration moved them by {moved:.2e})")  # fmt: skip
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max()) and moved > 100 * diff


def _denormalised(pipe, latents):
    """[B, 4C, h, w] -> [B, C, 2h, 2w] by the pipeline's own statistics and unpatching."""
    z = torch.from_numpy(np.array(latents))
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return pipe._unpatchify_latents(z * std + mean).numpy()
