"""Qwen-Image end to end on a tiny random folder built with PyTorch
(tests/qwenimage_fixtures.py): the folder is a QwenImagePipeline diffusers loads and samples
from. Classifier-free guidance stays off throughout (`true_cfg_scale=1`, no negative prompt):
the pipeline's true CFG rescales the guided prediction to the conditional one's norm, which
is not the package's guidance, and the denoiser here is the conditional prediction."""

import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models import patches
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
from qwenimage_fixtures import LATENT_CHANNELS, RESOLUTION, SCHEDULER, TEXT_WIDTH  # noqa: E402

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
