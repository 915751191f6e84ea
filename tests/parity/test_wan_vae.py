"""The Wan2.1 and Wan2.2 VAE decoders and first-frame encoders (models/causal_vae.py) against
diffusers' `AutoencoderKLWan` built tiny and random in PyTorch and saved as a `vae/` folder:
the same videos from the same latents (de-normalised as WanPipeline does, decoded frame by
frame with diffusers' causal cache), the frame count rule, and bad folders in one sentence.
The encoders: images resized and scaled as the image-to-video pipelines do, encoded to the
latent distribution's mode and normalised with the folder's statistics, as
`WanImageToVideoPipeline.prepare_latents` does."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models import causal_vae, causal_vae_encoder
from tree_grpo_jax.models.base import ModelLoadError

torch = pytest.importorskip("torch")
from causal_vae_fixtures import (  # noqa: E402
    TINY,
    Z_DIM,
    decode_reference,
    random_torch_vae,
    saved_vae_folder,
)
from sd_fixtures import perturb  # noqa: E402

HINT = "point model.path at a Wan2.1 diffusers folder"


@pytest.fixture(scope="module")
def torch_vae():
    from diffusers import AutoencoderKLWan

    return random_torch_vae(AutoencoderKLWan, seed=0)


@pytest.fixture(scope="module")
def folder(torch_vae, tmp_path_factory):
    return saved_vae_folder(torch_vae, tmp_path_factory, "wan_vae")


@pytest.fixture(scope="module")
def loaded(folder):
    return causal_vae.load_decoder(folder, jnp.float32, HINT)


@pytest.mark.parametrize("frames, chunked", [(3, True), (3, False), (1, True)])
def test_decode_equals_diffusers(torch_vae, loaded, frames, chunked):
    """One latent frame at a time (with the caches) and all at once give diffusers' video."""
    module, params, config = loaded
    latents = np.random.default_rng(frames).standard_normal((2, frames, 4, 4, Z_DIM)).astype("f4")
    expected = decode_reference(torch_vae, latents)
    decode = causal_vae.decode_fn(module, config, jnp.float32, chunked=chunked)
    got = np.asarray(decode(params, jnp.asarray(latents)))
    video_frames = 1 + 4 * (frames - 1)
    assert got.shape == expected.shape == (2, video_frames, 32, 32, 3)
    # Most pixels inside (0, 1): the comparison is not of clamped constants.
    assert np.mean((expected > 0) & (expected < 1)) > 0.5
    diff = np.abs(got - expected).max()
    print(f"{frames} latent frames, chunked {chunked}: max abs difference {diff:.2e}")
    assert diff <= 1e-4 * np.abs(expected).max(), diff
    # The two latents give different videos, and so do the frames within one video.
    assert np.abs(expected[0] - expected[1]).mean() > 1e-2
    if frames > 1:
        assert np.abs(expected[0, 0] - expected[0, -1]).mean() > 1e-2


def test_frame_count_rule(loaded):
    _, _, config = loaded
    assert (config.temporal_factor, config.spatial_factor) == (4, 8)
    assert [causal_vae.num_frames(f, config) for f in (1, 2, 3, 21)] == [1, 5, 9, 81]
    assert causal_vae.latent_frames(81, config) == 21 and causal_vae.latent_frames(1, config) == 1
    with pytest.raises(
        ValueError, match=r"^this VAE's videos have 1 \+ 4k frames .* use 77 or 81\.$"
    ):
        causal_vae.latent_frames(80, config)
    # Wan2.1's own config (the class's defaults): 4x in time, 8x in space.
    wan21 = causal_vae.vae_config({"base_dim": 96, "z_dim": 16})
    assert (wan21.temporal_factor, wan21.spatial_factor, wan21.dim) == (4, 8, 96)
    assert causal_vae.num_frames(21, {}) == 81
    # One temporal level fewer: 2x.
    stats = {"latents_mean": [0.0] * Z_DIM, "latents_std": [1.0] * Z_DIM}
    assert (
        causal_vae.num_frames(3, {**TINY, **stats, "temperal_downsample": [False, False, True]})
        == 5
    )


def test_convert_ignores_the_encoder_and_names_what_is_missing(torch_vae, loaded):
    _, params, config = loaded
    state = {k: v.numpy() for k, v in torch_vae.state_dict().items()}
    assert any(k.startswith("encoder.") for k in state)
    converted = causal_vae.convert_decoder(state, config)
    np.testing.assert_array_equal(
        converted["decoder"]["conv_in"]["kernel"],
        state["decoder.conv_in.weight"].transpose(2, 3, 4, 1, 0),
    )
    del state["decoder.up_blocks.1.upsamplers.0.time_conv.weight"]
    with pytest.raises(Exception, match="missing decoder/up_blocks_1/upsamplers_0/time_conv"):
        causal_vae.convert_decoder(state, config)


def _broken(folder, tmp_path, **changes):
    broken = tmp_path / "vae"
    broken.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **changes}))
    (broken / "diffusion_pytorch_model.safetensors").symlink_to(
        folder / "diffusion_pytorch_model.safetensors"
    )
    return broken


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"input_channels": 4}, r"sets input_channels=4, but only input_channels=3"),
        ({"latents_std": [1.0, 2.0]}, r"has 2 latents_std values for z_dim 4"),
        ({"base_dim": 16}, r"^the weights in .* do not match its config \(.*\); point model"),
        ({"dim_mult": "two"}, r"sets dim_mult='two', but it must be a list of whole numbers"),
        (
            {"_class_name": "AutoencoderKL"},
            r"describes AutoencoderKL, not a causal video VAE \(AutoencoderKLWan or "
            r"AutoencoderKLQwenImage\); point",
        ),
    ],
)
def test_bad_folders_are_one_sentence(folder, tmp_path, changes, message):
    with pytest.raises(ModelLoadError, match=message) as error:
        causal_vae.load_decoder(_broken(folder, tmp_path, **changes), jnp.float32, HINT)
    assert "\n" not in str(error.value) and str(error.value).endswith(".")


# Wan2.2's VAE (Wan2.2-TI2V-5B's layout, tiny): residual up blocks with the parameter-free
# shortcut, a decoder wider than the encoder, and 2x2 pixel patches (12 output channels).
TINY_22 = dict(
    TINY,
    decoder_base_dim=12,
    is_residual=True,
    patch_size=2,
    in_channels=12,
    out_channels=12,
    scale_factor_spatial=16,
)


@pytest.fixture(scope="module")
def wan22_vae(tmp_path_factory):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    model = AutoencoderKLWan(
        **TINY_22,
        latents_mean=rng.normal(0.0, 0.5, Z_DIM).round(4).tolist(),
        latents_std=rng.uniform(0.5, 2.5, Z_DIM).round(4).tolist(),
    )
    perturb(model, torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("wan22_vae") / "vae"
    model.eval().save_pretrained(path, safe_serialization=True)
    return model, causal_vae.load_decoder(path, jnp.float32, HINT), path


@pytest.mark.parametrize("chunked", [True, False])
def test_wan22_decode_equals_diffusers(wan22_vae, chunked):
    """The residual, patched decoder: 3 latent frames of 3 x 2 latents -> 9 frames of
    48 x 32 pixels (16 per latent), frame by frame and all at once."""
    torch_vae, (module, params, config), _ = wan22_vae
    assert (config.spatial_factor, config.temporal_factor) == (16, 4)
    latents = np.random.default_rng(7).standard_normal((2, 3, 3, 2, Z_DIM)).astype("f4")
    expected = decode_reference(torch_vae, latents)
    got = np.asarray(
        causal_vae.decode_fn(module, config, jnp.float32, chunked=chunked)(
            params, jnp.asarray(latents)
        )
    )
    assert got.shape == expected.shape == (2, 9, 48, 32, 3)
    assert np.mean((expected > 0) & (expected < 1)) > 0.5
    diff = np.abs(got - expected).max()
    print(f"Wan2.2 VAE, chunked {chunked}: max abs difference {diff:.2e}")
    assert diff <= 1e-5 * np.abs(expected).max(), diff
    assert np.abs(expected[0] - expected[1]).mean() > 1e-2
    # Neighbouring pixels of one patch differ: the patch order is checked, not a constant.
    assert np.abs(expected[0, :, 0::2] - expected[0, :, 1::2]).mean() > 1e-3
    assert np.abs(expected[0, :, :, 0::2] - expected[0, :, :, 1::2]).mean() > 1e-3


def test_wan22_out_channels_must_fit_the_patch(tmp_path):
    stats = {"latents_mean": [0.0] * Z_DIM, "latents_std": [1.0] * Z_DIM}
    with pytest.raises(ModelLoadError, match=r"out_channels 3 for patch_size 2; .* 12\.$"):
        causal_vae.vae_config({**TINY_22, **stats, "out_channels": 3}, tmp_path / "config.json")


def encode_reference(torch_vae, images: list[np.ndarray], height: int, width: int) -> np.ndarray:
    """diffusers' first-frame latents [B, h, w, z] (channels last): the pipeline's
    preprocessing (PIL images, resized to height x width, in [-1, 1]), `vae.encode`'s mode,
    normalised with the config's statistics."""
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    pil = [Image.fromarray(i) for i in images]
    pixels = VideoProcessor(vae_scale_factor=8).preprocess(pil, height=height, width=width)
    with torch.no_grad():
        mode = torch_vae.encode(pixels.float().unsqueeze(2)).latent_dist.mode()
    c = torch_vae.config
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    return ((mode - mean) * inv_std)[:, :, 0].permute(0, 2, 3, 1).numpy()


def _images(seed: int, height: int, width: int, count: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def _check_encoder(torch_vae, folder, height, width, image_size, latent_shape):
    module, params, config = causal_vae_encoder.load_encoder(folder, jnp.float32, HINT)
    images = _images(3, *image_size)
    expected = encode_reference(torch_vae, images, height, width)
    pixels = np.stack([causal_vae_encoder.image_to_pixels(i, height, width) for i in images])
    got = np.asarray(causal_vae_encoder.encode_fn(module, config)(params, jnp.asarray(pixels)))
    assert got.shape == expected.shape == (2, *latent_shape)
    diff = np.abs(got - expected).max()
    print(f"encoder {image_size} -> {height}x{width}: max abs difference {diff:.2e}")
    assert diff <= 1e-5 * np.abs(expected).max(), diff
    assert np.abs(expected[0] - expected[1]).mean() > 1e-2 * np.abs(expected).max()


@pytest.mark.parametrize("image_size", [(32, 32), (40, 24)])
def test_encode_equals_diffusers(torch_vae, folder, image_size):
    """Wan2.1's encoder (flat down blocks, 8 pixels per latent), the image at the video's
    size and resized to it."""
    _check_encoder(torch_vae, folder, 32, 32, image_size, (4, 4, Z_DIM))


@pytest.mark.parametrize("image_size", [(48, 32), (37, 50)])
def test_wan22_encode_equals_diffusers(wan22_vae, image_size):
    """Wan2.2's encoder (residual down blocks with the averaging shortcut, 2x2 pixel
    patches, 16 pixels per latent)."""
    torch_vae, _, path = wan22_vae
    _check_encoder(torch_vae, path, 48, 32, image_size, (3, 2, Z_DIM))


def test_encoder_weights_are_required(wan22_vae, tmp_path):
    """A folder saved with its decoder only is one sentence."""
    from safetensors.numpy import load_file, save_file

    _, _, path = wan22_vae
    broken = tmp_path / "vae"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    state = load_file(path / "diffusion_pytorch_model.safetensors")
    decoder_only = {k: v for k, v in state.items() if not k.startswith(("encoder.", "quant_conv."))}
    save_file(decoder_only, broken / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ModelLoadError, match=r"holds no VAE encoder weights .*; point model"):
        causal_vae_encoder.load_encoder(broken, jnp.float32, HINT)
