"""Z-Image end to end on a tiny random folder built with PyTorch (tests/zimage_fixtures.py):
the folder is a ZImagePipeline diffusers loads and samples from; the prompt encoding against
ZImagePipeline.encode_prompt, the schedule against its scheduler, the deterministic sampler
against ZImagePipeline from the same noise (guidance_scale 0: no classifier-free guidance, as
the distilled Z-Image-Turbo samples and as our denoiser predicts), the VAE decode, a TreeGRPO
training iteration (configs/zimage_treegrpo.py) and its export loaded back by PyTorch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
import family_checks  # noqa: E402
from zimage_fixtures import RESOLUTION, SCHEDULER, TEXT_WIDTH  # noqa: E402

from tree_grpo_jax.models.zimage import transformer  # noqa: E402
from tree_grpo_jax.models.zimage.load import ZImageScheduleConfig, load_zimage  # noqa: E402

LONG = " ".join(["a photo of a cat"] * 4)  # past the tests' 40 text tokens
PROMPTS = ["a photo of a cat", "two dogs", LONG]
TEXT_TOKENS = 40
LATENT = RESOLUTION // 2  # the tiny VAE's two levels: 2 pixels per latent


@pytest.fixture(scope="module")
def pipe(zimage_folder):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(zimage_folder), torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def model(zimage_folder):
    return load_zimage(str(zimage_folder), text_max_length=TEXT_TOKENS, resolution=RESOLUTION)


def test_the_tiny_folder_is_a_pipeline_diffusers_samples(pipe):
    import transformers

    assert isinstance(pipe.text_encoder, transformers.Qwen3Model)
    with torch.no_grad():
        images = pipe(
            list(PROMPTS[:2]),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=2,
            guidance_scale=0.0,
            max_sequence_length=TEXT_TOKENS,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
    assert images.shape == (2, RESOLUTION, RESOLUTION, 3) and np.isfinite(images).all()
    assert np.abs(images[0] - images[1]).max() > 1e-3  # the prompts condition the image


def test_text_equals_encode_prompt(model, pipe):
    with torch.no_grad():
        # (a copy: the pipeline writes the templated prompts into the list it is given)
        theirs, negative = pipe.encode_prompt(
            list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS
        )
    assert negative == []
    ours = model.text_encoders.encode(PROMPTS)
    assert [o.shape for o in ours] == [tuple(t.shape) for t in theirs]
    assert ours[2].shape == (TEXT_TOKENS, TEXT_WIDTH) and ours[0].shape[0] < TEXT_TOKENS
    for ours_i, theirs_i in zip(ours, theirs):
        np.testing.assert_allclose(ours_i, theirs_i.numpy(), rtol=1e-5, atol=1e-5)
    diff = max(np.abs(o - t.numpy()).max() for o, t in zip(ours, theirs))
    print(f"prompt embeddings max abs difference {diff:.2e}")
    # The conditioning: the states at the front, zeros after, the mask as one last feature.
    cond = np.asarray(model.encode_prompts(PROMPTS))
    assert cond.shape == (3, TEXT_TOKENS, TEXT_WIDTH + 1)
    tokens = len(ours[0])
    np.testing.assert_array_equal(cond[0, :tokens, :-1], ours[0])
    assert (cond[0, :tokens, -1] == 1).all() and not cond[0, tokens:].any()


@pytest.mark.parametrize("dynamic", [False, True])
def test_schedule_equals_the_pipeline_scheduler(dynamic):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import (
        calculate_shift,
        get_default_z_image_sigmas,
    )

    config = {**SCHEDULER, "use_dynamic_shifting": dynamic}
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    tokens, steps = 2025, 8
    mu = calculate_shift(tokens)  # the pipeline's default shift range, as the folder's
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), mu=mu)
    ours = ZImageScheduleConfig(image_seq_len=tokens, **config).make_schedule(steps, Sampling())
    np.testing.assert_allclose(np.asarray(ours.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.timesteps), scheduler.timesteps.numpy(), atol=1e-3)


def test_deterministic_sampler_equals_the_pipeline(model, pipe):
    noise = np.random.default_rng(0).standard_normal((3, *model.sample_shape)).astype("f4")
    assert model.sample_shape == (16, LATENT, LATENT)
    with torch.no_grad():
        expected = pipe(
            list(PROMPTS),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=4,
            guidance_scale=0.0,
            latents=torch.from_numpy(noise),
            output_type="latent",
            max_sequence_length=TEXT_TOKENS,
        ).images.numpy()
    schedule = model.make_schedule(4, Sampling())
    got = rollout.sample_deterministic(
        model.denoise, model.params, model.encode_prompts(PROMPTS), jnp.asarray(noise), schedule
    )
    diff = np.abs(np.asarray(got) - expected).max()
    print(f"sampler max abs difference {diff:.2e}, latents up to {np.abs(expected).max():.2f}")
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    assert np.abs(expected - noise).max() > 0.1  # the steps moved the latents


def test_decode_equals_the_vae(model, pipe):
    latents = np.random.default_rng(1).standard_normal((2, *model.sample_shape)).astype("f4")
    vae = pipe.vae
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)
    with torch.no_grad():
        z = torch.from_numpy(latents) / vae.config.scaling_factor + vae.config.shift_factor
        expected = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, RESOLUTION, RESOLUTION, 3)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _pytorch_velocity(pt_transformer, x, embeds, sigma):
    """The flow velocity of diffusers' transformer as ZImagePipeline calls it."""
    latents = torch.from_numpy(x).unsqueeze(2)
    captions = [torch.from_numpy(e) for e in embeds]
    timestep = torch.from_numpy(1.0 - sigma)
    with torch.no_grad():
        out = pt_transformer(list(latents.unbind(0)), timestep, captions, return_dict=False)[0]
    return -torch.stack(out).squeeze(2).numpy()


def _our_velocity(model, params, x, embeds, sigma):
    from tree_grpo_jax.models import decoder_prompts

    cond = decoder_prompts.pack_embeddings(embeds, TEXT_TOKENS)
    out = jax.jit(model.denoise)(
        params, jnp.asarray(x), jnp.asarray(sigma) * 1000.0, jnp.asarray(cond)
    )
    return np.asarray(out)


def test_a_treegrpo_iteration_and_the_export_pytorch_loads(zimage_folder, model, tmp_path):
    """The family's one fast end-to-end run: TreeGRPO trains one iteration on the tiny
    folder without torch, the export loads in PyTorch and computes what the trained params
    compute."""
    from diffusers import ZImageTransformer2DModel

    from tree_grpo_jax.models import registry

    assert registry.family_of_folder(str(zimage_folder)).name == "zimage"
    workdir, out = tmp_path / "run", tmp_path / "exported"
    overrides = [
        "--config.model.name=zimage",
        f"--config.model.path={zimage_folder}",
        f"--config.model.zimage.resolution={RESOLUTION}",
        "--config.model.zimage.text_max_length=40",
        "--config.eval.num_steps=0",  # the training steps, not the release's evaluation steps
        "--config.tree.window=1",
        "--config.train.rows_per_minibatch=2",
    ]
    family_checks.train_one_iteration_without_torch(
        "configs/zimage_treegrpo.py",
        workdir,
        overrides,
        released="prompts encoded ahead; text encoder released",
    )
    trained = family_checks.export_the_trained_params(workdir, out, model.params)

    pt = ZImageTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    x, embeds, sigma = family_checks.random_velocity_inputs(
        3, model.sample_shape, TEXT_WIDTH, lengths=(5, 37), sigmas=(0.9, 0.25)
    )
    expected = _pytorch_velocity(pt, x, embeds, sigma)
    got = _our_velocity(model, trained, x, embeds, sigma)
    diff = np.abs(got - expected).max()
    moved = np.abs(got - _our_velocity(model, model.params, x, embeds, sigma)).max()
    print(f"exported velocity max abs difference {diff:.2e} (up to {np.abs(expected).max():.2f}; "
          f"the iteration moved it by {moved:.2e})")  # fmt: skip
    # 1e-5 of the scale, as test_zimage_transformer.py measures the float32 model (its
    # timestep sinusoid one ulp off PyTorch's), with room for the trained weights.
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max()) and moved > 100 * diff
    assert (out / "text_encoder").is_dir() and (out / "model_index.json").is_file()


def test_lora_export_loads_into_the_pipeline(model, pipe, tmp_path):
    from tree_grpo_jax import lora
    from tree_grpo_jax.models import registry

    family = registry.family_of("zimage")
    paths = lora.target_paths(model.params, family.lora_targets)
    modules = {"/".join(str(k) for k in p[:-1]) for p in paths}
    assert any("noise_refiner" in m for m in modules) and any(
        "context_refiner" in m for m in modules
    )
    factors = family_checks.random_lora(model.params, paths)
    assert family.export.list_names == transformer.MODULE_LISTS
    out = family_checks.export_lora(
        factors, family, tmp_path / "lora", list_names=transformer.MODULE_LISTS
    )
    x, embeds, sigma = family_checks.random_velocity_inputs(
        4, model.sample_shape, TEXT_WIDTH, lengths=(9, 21), sigmas=(0.7, 0.4)
    )
    expected = family_checks.with_lora_loaded(
        pipe, out, lambda pt: _pytorch_velocity(pt, x, embeds, sigma)
    )
    got = _our_velocity(model, family_checks.merged(model.params, factors), x, embeds, sigma)
    base = _our_velocity(model, model.params, x, embeds, sigma)
    diff = np.abs(got - expected).max()
    print(f"LoRA velocity max abs difference {diff:.2e}, moved {np.abs(expected - base).max():.2e}")
    assert np.abs(expected - base).max() > 1e-2  # the adapter is not a no-op
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max())


def test_the_plan_shapes_are_the_loaded_models(zimage_folder, model):
    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.zimage.abstract import abstract_zimage

    assert registry.family_of_folder(str(zimage_folder)).name == "zimage"
    assert not registry.family_of("flux").recognizes(zimage_folder)
    planned = abstract_zimage(
        str(zimage_folder), text_max_length=TEXT_TOKENS, resolution=RESOLUTION
    )
    assert planned.sample_shape == model.sample_shape
    assert planned.cond_shape == model.encode_prompts(["a cat"]).shape[1:]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), planned.params)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), model.params)
    assert planned.schedule_config == model.schedule_config
