"""FLUX.1-Kontext editing on the tiny FLUX.1 folder (tests/flux_fixtures.py) against
diffusers' FluxKontextPipeline built from the same folder: the reference tokens and ids
against the pipeline's `prepare_latents`, the deterministic sampler with one input image
against the pipeline's `image=` editing (`_auto_resize=False`), the one-sentence refusals;
then configs/flux_kontext_edit.py end to end: a prompt file naming digit images, one
TreeGRPO iteration in a process without torch, and the exported Kontext folder in
FluxKontextPipeline editing as our sampler does with the trained params."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageDraw

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import ModelLoadError, Sampling

torch = pytest.importorskip("torch")
import edit_fixtures  # noqa: E402
import family_checks  # noqa: E402
from edit_fixtures import ROWS  # noqa: E402
from flux_fixtures import RESOLUTION  # noqa: E402

from tree_grpo_jax.models import patches  # noqa: E402
from tree_grpo_jax.models.flux.abstract import abstract_flux  # noqa: E402
from tree_grpo_jax.models.flux.load import load_flux  # noqa: E402

T5_TOKENS = 16
SIDE = 32  # the input images: 8x8 reference tokens with the tiny VAE (2 px a latent)
LATENT = RESOLUTION // 2
GUIDANCE = 2.5
OPTIONS = dict(
    t5_max_length=T5_TOKENS,
    resolution=RESOLUTION,
    reference_images=1,
    reference_resolution=SIDE,
    guidance=GUIDANCE,
)


def _digit(value: int) -> np.ndarray:
    """A white digit on grey noise, SIDE pixels square (the noise gives every latent a say)."""
    picture = Image.new("L", (SIDE // 2, SIDE // 2), 40)
    ImageDraw.Draw(picture).text((3, 2), str(value), fill=255)
    pixels = np.asarray(picture.resize((SIDE, SIDE), Image.Resampling.NEAREST).convert("RGB"))
    noise = np.random.default_rng(value).integers(0, 60, pixels.shape)
    return np.clip(pixels.astype(int) + noise, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def kontext_folder(flux_folder, tmp_path_factory):
    """The tiny FLUX.1 folder as a Kontext one: its model_index names FluxKontextPipeline."""
    folder = tmp_path_factory.mktemp("tiny_flux_kontext") / "folder"
    shutil.copytree(flux_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "FluxKontextPipeline"}, indent=2)
    )
    return folder


@pytest.fixture(scope="module")
def model(kontext_folder):
    return load_flux(str(kontext_folder), **OPTIONS)


@pytest.fixture(scope="module")
def pipe(kontext_folder):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(str(kontext_folder), torch_dtype=torch.float32)


def test_reference_tokens_and_ids_equal_prepare_latents(model, pipe):
    digit = _digit(3)
    image = pipe.image_processor.preprocess(Image.fromarray(digit), SIDE, SIDE)
    with torch.no_grad():
        _, image_latents, _, image_ids = pipe.prepare_latents(
            image, 1, 16, RESOLUTION, RESOLUTION, torch.float32, "cpu", None, None
        )
    tokens, ids = model.encode_prompts.references([digit])
    expected = image_latents[0].numpy()
    diff = np.abs(tokens - expected).max()
    print(f"reference tokens max abs difference {diff:.2e} (up to {np.abs(expected).max():.2f})")
    assert tokens.shape == expected.shape == ((SIDE // 4) ** 2, 64)
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max())
    np.testing.assert_array_equal(ids, image_ids.numpy())
    # The conditioning: the text rows, the pooled row, then the reference rows.
    cond = np.asarray(model.encode_prompts([ROWS[0][0]], input_images=[[digit]]))
    assert cond.shape == (1, T5_TOKENS + 1 + len(tokens), 67)  # widened for the rows
    rows = cond[0, T5_TOKENS + 1 :]
    np.testing.assert_array_equal(rows[:, :64], tokens)
    np.testing.assert_array_equal(rows[:, 64:67], ids)
    assert not rows[:, 67:].any()


def _pipeline_latents(pipe, prompt, digit, noise, steps=3, true_cfg=1.0):
    packed = np.array(patches.pack_latents(jnp.asarray(noise)))
    cfg = dict(negative_prompt="", true_cfg_scale=true_cfg) if true_cfg != 1.0 else {}
    with torch.no_grad():
        out = pipe(
            **cfg,
            prompt=prompt,
            image=Image.fromarray(digit),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=steps,
            guidance_scale=GUIDANCE,
            latents=torch.from_numpy(packed),
            output_type="latent",
            max_sequence_length=T5_TOKENS,
            max_area=RESOLUTION**2,  # else the pipeline scales the output to 1024**2 pixels
            _auto_resize=False,
        ).images.numpy()
    return np.asarray(patches.unpack_latents(jnp.asarray(out), LATENT, LATENT))


def _sample(model, cond, noise, **guidance) -> np.ndarray:
    """Our deterministic sampler over 3 steps from `noise`, as the pipeline runs."""
    schedule = model.make_schedule(3, Sampling())
    return np.asarray(
        rollout.sample_deterministic(
            model.denoise, model.params, cond, jnp.asarray(noise), schedule, **guidance
        )
    )


def test_the_sampler_with_an_input_image_equals_the_kontext_pipeline(model, pipe, kontext_folder):
    digit = _digit(7)
    noise = np.random.default_rng(0).standard_normal((1, *model.sample_shape)).astype("f4")
    expected = _pipeline_latents(pipe, ROWS[1][0], digit, noise)
    got = _sample(model, model.encode_prompts([ROWS[1][0]], input_images=[[digit]]), noise)
    plain = load_flux(str(kontext_folder), **{**OPTIONS, "reference_images": 0})
    text_only = _sample(plain, plain.encode_prompts([ROWS[1][0]]), noise)
    diff, scale = np.abs(got - expected).max(), np.abs(expected).max()
    apart = np.abs(text_only - expected).max()
    print(f"edited latents max abs difference {diff:.2e}, relative {diff / scale:.2e} (up to "
          f"{scale:.2f}; text-to-image from the same noise is {apart:.2e} away)")  # fmt: skip
    assert diff <= 1e-5 * max(1.0, scale) and apart > 100 * diff


def test_true_guidance_keeps_the_input_image_in_the_empty_prompts_pass(model, pipe):
    """The pipeline's true classifier-free guidance feeds the image latents to both passes:
    the package's guidance (`sampling.guidance_scale`) against the empty prompt's text rows
    (`unconditional_rows`) keeps each prompt's reference rows there too."""
    digit = _digit(3)
    noise = np.random.default_rng(1).standard_normal((1, *model.sample_shape)).astype("f4")
    expected = _pipeline_latents(pipe, ROWS[0][0], digit, noise, true_cfg=3.0)
    cond = model.encode_prompts([ROWS[0][0]], input_images=[[digit]])
    empty = model.encode_prompts([""])[0]
    assert model.unconditional_rows == T5_TOKENS + 1
    got, blank = (
        _sample(model, cond, noise, uncond=uncond, guidance_scale=3.0)
        for uncond in (empty[: model.unconditional_rows], empty)
    )
    diff, scale = np.abs(got - expected).max(), np.abs(expected).max()
    apart = np.abs(blank - expected).max()
    print(f"true CFG 3 with an input image: {diff:.2e} (up to {scale:.2f}); with blank "
          f"references in the empty prompt's pass {apart:.2e}")  # fmt: skip
    assert diff <= 1e-5 * max(1.0, scale) and apart > 100 * diff


def test_bad_inputs_are_one_sentence(model, kontext_folder):
    with pytest.raises(ValueError, match=r"1 input image\(s\) per prompt .* names 2"):
        model.encode_prompts(["a"], input_images=[[_digit(1), _digit(2)]])
    with pytest.raises(ValueError, match=r"is 16x16 pixels; the model takes 32x32"):
        model.encode_prompts(["a"], input_images=[[_digit(1)[:16, :16]]])
    with pytest.raises(
        ModelLoadError, match="reference_resolution 30 must be a positive multiple of 4"
    ):
        load_flux(str(kontext_folder), **{**OPTIONS, "reference_resolution": 30})
    with pytest.raises(ValueError, match="too narrow for 64 reference channels and 3 ids"):
        from tree_grpo_jax.models.references import reference_rows

        reference_rows(np.zeros((4, 64)), np.zeros((4, 3)), 32)
    plan = abstract_flux(str(kontext_folder), **OPTIONS)
    assert plan.cond_shape == (T5_TOKENS + 1 + (SIDE // 4) ** 2, 67)


def test_an_editing_iteration_and_the_export_edit_in_the_kontext_pipeline(
    model, kontext_folder, tmp_path
):
    from diffusers import FluxKontextPipeline

    workdir, out = tmp_path / "run", tmp_path / "exported"
    settings = {k: v for k, v in OPTIONS.items() if k != "guidance"}  # the config's 2.5
    overrides = [
        f"--config.model.path={kontext_folder}",
        *(f"--config.model.flux.{k}={v}" for k, v in settings.items()),
        "--config.model.flux.shift=0",  # the folder's dynamic shifting, as the pipeline's
        f"--config.prompts.source={edit_fixtures.prompt_file(tmp_path, _digit)}",
        "--config.eval.num_steps=0",
        "--config.tree.window=2",
        "--config.tree.split_steps=(0,1)",
        "--config.train.rows_per_minibatch=2",
    ]
    family_checks.train_one_iteration_without_torch(
        "configs/flux_kontext_edit.py",
        workdir,
        overrides,
        released="prompts encoded ahead; T5 released",
    )
    trained = family_checks.export_the_trained_params(workdir, out, model.params)
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == (
        "FluxKontextPipeline"
    )

    pipe = FluxKontextPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    digit = _digit(3)
    noise = np.random.default_rng(1).standard_normal((1, *model.sample_shape)).astype("f4")
    expected = _pipeline_latents(pipe, ROWS[0][0], digit, noise)
    cond = model.encode_prompts([ROWS[0][0]], input_images=[[digit]])
    schedule = model.make_schedule(3, Sampling())
    got, before = (
        np.asarray(
            rollout.sample_deterministic(model.denoise, p, cond, jnp.asarray(noise), schedule)
        )
        for p in (trained, model.params)
    )
    diff, moved = np.abs(got - expected).max(), np.abs(got - before).max()
    print(f"edited latents max abs difference {diff:.2e} (up to {np.abs(expected).max():.2f};"
          f" the iteration moved them by {moved:.2e})")  # fmt: skip
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()) and moved > 100 * diff
