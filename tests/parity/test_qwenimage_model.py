"""Qwen-Image end to end on a tiny random folder built with PyTorch
(tests/qwenimage_fixtures.py): the folder is a QwenImagePipeline diffusers loads and samples
from. Classifier-free guidance stays off throughout (`true_cfg_scale=1`, no negative prompt):
the pipeline's true CFG rescales the guided prediction to the conditional one's norm, which
is not the package's guidance, and the denoiser here is the conditional prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models import decoder_prompts, patches
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
import family_checks  # noqa: E402
from qwenimage_fixtures import LATENT_CHANNELS, RESOLUTION, SCHEDULER, TEXT_WIDTH  # noqa: E402

from tree_grpo_jax.models.qwenimage import transformer  # noqa: E402
from tree_grpo_jax.models.qwenimage.load import load_qwenimage, schedule_config  # noqa: E402

# The byte tokenizer spends a token a byte: the system turn left after the 34 dropped
# tokens is ~130 states, so a prompt of ~20 characters is ~150 and LONG is past 160.
TEXT_TOKENS = 160
LONG = " ".join(["a photo of a cat"] * 4)
PROMPTS = ["a photo of a cat", "two dogs", LONG]
LATENT = RESOLUTION // 8


@pytest.fixture(scope="module")
def pipe(qwenimage_folder):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(qwenimage_folder), torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def model(qwenimage_folder):
    return load_qwenimage(str(qwenimage_folder), text_max_length=TEXT_TOKENS, resolution=RESOLUTION)


def test_the_tiny_folder_is_a_pipeline_diffusers_samples(pipe):
    import transformers

    assert isinstance(pipe.text_encoder, transformers.Qwen2_5_VLForConditionalGeneration)
    assert pipe.vae_scale_factor == 8
    with torch.no_grad():
        images = pipe(
            list(PROMPTS[:2]),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
    assert images.shape == (2, RESOLUTION, RESOLUTION, 3) and np.isfinite(images).all()
    assert np.abs(images[0] - images[1]).max() > 1e-3  # the prompts condition the image


def test_text_equals_encode_prompt(model, pipe):
    with torch.no_grad():
        theirs, their_mask = pipe.encode_prompt(list(PROMPTS), max_sequence_length=TEXT_TOKENS)
    ours = model.text_encoders.encode(PROMPTS)
    counts = their_mask.sum(dim=1).tolist()
    assert [len(o) for o in ours] == counts and counts[2] == TEXT_TOKENS > counts[0]
    for ours_i, theirs_i, n in zip(ours, theirs.numpy(), counts):
        np.testing.assert_allclose(ours_i, theirs_i[:n], rtol=1e-5, atol=1e-5)
        assert not theirs_i[n:].any()
    diff = max(np.abs(o - t[:n]).max() for o, t, n in zip(ours, theirs.numpy(), counts))
    print(f"prompt embeddings max abs difference {diff:.2e}")
    # The conditioning: the states at the front, zeros after, the mask as one last feature.
    cond = np.asarray(model.encode_prompts(PROMPTS))
    assert cond.shape == (3, TEXT_TOKENS, TEXT_WIDTH + 1)
    np.testing.assert_array_equal(cond[0, : counts[0], :-1], ours[0])
    assert (cond[0, : counts[0], -1] == 1).all() and not cond[0, counts[0] :].any()


@pytest.mark.parametrize("dynamic", [True, False])
def test_schedule_equals_the_pipeline_scheduler(dynamic, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    config = {**SCHEDULER, "use_dynamic_shifting": dynamic, "shift": 2.0}
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    tokens, steps = 2025, 8
    mu = calculate_shift(tokens, 256, 8192, 0.5, 0.9)  # the folder's range, as the pipeline
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    assert abs(float(scheduler.sigmas[-2]) - SCHEDULER["shift_terminal"]) < 1e-6
    ours = schedule_config(dict(scheduler.config), tmp_path, tokens)
    schedule = ours.make_schedule(steps, Sampling())
    np.testing.assert_allclose(np.asarray(schedule.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(schedule.timesteps), scheduler.timesteps.numpy(), atol=1e-3
    )


def _pack(pipe, latents: np.ndarray):
    """[B, C, h, w] -> the pipeline's packed tokens, packed by the pipeline."""
    b, c, h, w = latents.shape
    return pipe._pack_latents(torch.from_numpy(latents), b, c, h, w)


def test_deterministic_sampler_equals_the_pipeline(model, pipe):
    noise = np.random.default_rng(0).standard_normal((3, *model.sample_shape)).astype("f4")
    assert model.sample_shape == (LATENT_CHANNELS, LATENT, LATENT)
    with torch.no_grad():
        expected = pipe(
            list(PROMPTS),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=4,
            true_cfg_scale=1.0,
            latents=_pack(pipe, noise),
            output_type="latent",
            max_sequence_length=TEXT_TOKENS,
        ).images.numpy()
    schedule = model.make_schedule(4, Sampling())
    got = rollout.sample_deterministic(
        model.denoise, model.params, model.encode_prompts(PROMPTS), jnp.asarray(noise), schedule
    )
    got = np.asarray(patches.pack_latents(got))
    diff = np.abs(got - expected).max()
    print(f"sampler max abs difference {diff:.2e}, latents up to {np.abs(expected).max():.2f}")
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    assert np.abs(expected - _pack(pipe, noise).numpy()).max() > 0.1  # the steps moved them


def test_decode_equals_the_vae(model, pipe):
    latents = np.random.default_rng(1).standard_normal((2, *model.sample_shape)).astype("f4")
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, LATENT_CHANNELS, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, LATENT_CHANNELS, 1, 1, 1)
    with torch.no_grad():
        z = torch.from_numpy(latents)[:, :, None] / inv_std + mean  # one frame each
        image = pipe.vae.decode(z, return_dict=False)[0][:, :, 0]
    expected = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, RESOLUTION, RESOLUTION, 3)
    print(f"decode max abs difference {np.abs(got - expected).max():.2e}")
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _pytorch_velocity(pt_transformer, pipe, x, embeds, sigma):
    """The packed output of diffusers' transformer as QwenImagePipeline calls it: the
    prompt states padded to the longest with their mask, the timestep sigma."""
    length = max(len(e) for e in embeds)
    states = np.zeros((len(embeds), length, TEXT_WIDTH), "f4")
    mask = np.zeros((len(embeds), length), "i8")
    for i, e in enumerate(embeds):
        states[i, : len(e)], mask[i, : len(e)] = e, 1
    _, _, h, w = x.shape
    with torch.no_grad():
        out = pt_transformer(
            hidden_states=_pack(pipe, x),
            encoder_hidden_states=torch.from_numpy(states),
            encoder_hidden_states_mask=torch.from_numpy(mask),
            timestep=torch.from_numpy(sigma),
            img_shapes=[(1, h // 2, w // 2)] * len(embeds),
            return_dict=False,
        )[0]
    return out.numpy()


def _our_velocity(model, params, x, embeds, sigma):
    cond = decoder_prompts.pack_embeddings(embeds, TEXT_TOKENS)
    out = jax.jit(model.denoise)(
        params, jnp.asarray(x), jnp.asarray(sigma) * 1000.0, jnp.asarray(cond)
    )
    return np.asarray(patches.pack_latents(out))


def test_a_treegrpo_iteration_and_the_export_pytorch_loads(qwenimage_folder, model, pipe, tmp_path):
    """The family's one fast end-to-end run: TreeGRPO trains one iteration on the tiny
    folder without torch (with the config's classifier-free guidance against the empty
    prompt), the export loads in PyTorch and computes what the trained params compute."""
    from diffusers import QwenImageTransformer2DModel

    from tree_grpo_jax.models import registry

    assert registry.family_of_folder(str(qwenimage_folder)).name == "qwenimage"
    workdir, out = tmp_path / "run", tmp_path / "exported"
    overrides = [
        "--config.model.name=qwenimage",
        f"--config.model.path={qwenimage_folder}",
        f"--config.model.qwenimage.resolution={RESOLUTION}",
        f"--config.model.qwenimage.text_max_length={TEXT_TOKENS}",
        "--config.eval.num_steps=0",  # the training steps, not the release's evaluation steps
        "--config.tree.window=1",
        "--config.train.rows_per_minibatch=2",
    ]
    family_checks.train_one_iteration_without_torch(
        "configs/qwenimage_treegrpo.py",
        workdir,
        overrides,
        released="prompts encoded ahead; text encoder released",
    )
    trained = family_checks.export_the_trained_params(workdir, out, model.params)

    pt = QwenImageTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    x, embeds, sigma = family_checks.random_velocity_inputs(
        3, model.sample_shape, TEXT_WIDTH, lengths=(5, 37), sigmas=(0.9, 0.25)
    )
    expected = _pytorch_velocity(pt, pipe, x, embeds, sigma)
    got = _our_velocity(model, trained, x, embeds, sigma)
    diff = np.abs(got - expected).max()
    moved = np.abs(got - _our_velocity(model, model.params, x, embeds, sigma)).max()
    print(f"exported velocity max abs difference {diff:.2e} (up to {np.abs(expected).max():.2f}; "
          f"the iteration moved it by {moved:.2e})")  # fmt: skip
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max()) and moved > 100 * diff
    assert (out / "text_encoder").is_dir() and (out / "model_index.json").is_file()


def test_lora_export_loads_into_the_pipeline(model, pipe, tmp_path):
    from tree_grpo_jax import lora
    from tree_grpo_jax.models import registry

    family = registry.family_of("qwenimage")
    paths = lora.target_paths(model.params, family.lora_targets)
    assert paths and all("transformer_blocks" in "/".join(map(str, p)) for p in paths)
    factors = family_checks.random_lora(model.params, paths)
    assert family.export.list_names == transformer.MODULE_LISTS
    out = family_checks.export_lora(
        factors, family, tmp_path / "lora", list_names=transformer.MODULE_LISTS
    )
    x, embeds, sigma = family_checks.random_velocity_inputs(
        4, model.sample_shape, TEXT_WIDTH, lengths=(9, 21), sigmas=(0.7, 0.4)
    )
    expected = family_checks.with_lora_loaded(
        pipe, out, lambda pt: _pytorch_velocity(pt, pipe, x, embeds, sigma)
    )
    got = _our_velocity(model, family_checks.merged(model.params, factors), x, embeds, sigma)
    base = _our_velocity(model, model.params, x, embeds, sigma)
    diff = np.abs(got - expected).max()
    print(f"LoRA velocity max abs difference {diff:.2e}, moved {np.abs(expected - base).max():.2e}")
    assert np.abs(expected - base).max() > 1e-2  # the adapter is not a no-op
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max())


def test_the_plan_shapes_are_the_loaded_models(qwenimage_folder, model):
    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.qwenimage.abstract import abstract_qwenimage

    assert registry.family_of_folder(str(qwenimage_folder)).name == "qwenimage"
    assert not registry.family_of("flux").recognizes(qwenimage_folder)
    planned = abstract_qwenimage(
        str(qwenimage_folder), text_max_length=TEXT_TOKENS, resolution=RESOLUTION
    )
    assert planned.sample_shape == model.sample_shape
    assert planned.cond_shape == model.encode_prompts(["a cat"]).shape[1:]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), planned.params)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), model.params)
    assert planned.schedule_config == model.schedule_config
    latents = jnp.zeros((1, *model.sample_shape))
    assert jax.eval_shape(planned.decode, planned.decode_params, latents).shape == (
        1, RESOLUTION, RESOLUTION, 3,
    )  # fmt: skip
