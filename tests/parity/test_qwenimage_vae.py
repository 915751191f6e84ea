"""Qwen-Image's VAE decoder (models/causal_vae.py, the network Wan2.1's VAE also is) against
diffusers' `AutoencoderKLQwenImage` built tiny and random in PyTorch and saved as a `vae/`
folder: its config (with `input_channels` and without Wan's decoder fields) is read, its
weights load, and the same latents, de-normalised as QwenImagePipeline does, give the same
images (one latent frame, as Qwen-Image decodes) and videos (three)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models import causal_vae
from tree_grpo_jax.models.base import ModelLoadError

torch = pytest.importorskip("torch")
from causal_vae_fixtures import (  # noqa: E402
    Z_DIM,
    decode_reference,
    random_torch_vae,
    saved_vae_folder,
)

HINT = "point model.path at a Qwen-Image diffusers folder"
# Fields of AutoencoderKLWan's config that Qwen-Image's lacks: the decoder's defaults stand in.
WAN_ONLY = {"decoder_base_dim", "is_residual", "patch_size", "out_channels", "in_channels"}


@pytest.fixture(scope="module")
def torch_vae():
    from diffusers import AutoencoderKLQwenImage

    return random_torch_vae(AutoencoderKLQwenImage, seed=1)


@pytest.fixture(scope="module")
def folder(torch_vae, tmp_path_factory):
    return saved_vae_folder(torch_vae, tmp_path_factory, "qwenimage_vae")


@pytest.fixture(scope="module")
def loaded(folder):
    return causal_vae.load_decoder(folder, jnp.float32, HINT)


def test_the_config_is_qwen_images(folder, loaded):
    raw = json.loads((folder / "config.json").read_text())
    assert raw["_class_name"] == "AutoencoderKLQwenImage" and raw["input_channels"] == 3
    assert not WAN_ONLY & set(raw)
    _, _, config = loaded
    assert (config.dim, config.z_dim, config.dim_mult) == (8, Z_DIM, (1, 2, 2, 2))
    assert (config.temporal_factor, config.spatial_factor) == (4, 8)


@pytest.mark.parametrize("frames", [1, 3])
def test_decode_equals_diffusers(torch_vae, loaded, frames):
    module, params, config = loaded
    latents = np.random.default_rng(frames).standard_normal((2, frames, 4, 4, Z_DIM)).astype("f4")
    expected = decode_reference(torch_vae, latents)
    decode = causal_vae.decode_fn(module, config, jnp.float32)
    got = np.asarray(decode(params, jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, 1 + 4 * (frames - 1), 32, 32, 3)
    # Most pixels inside (0, 1): the comparison is not of clamped constants.
    assert np.mean((expected > 0) & (expected < 1)) > 0.5
    diff = np.abs(got - expected).max()
    print(f"{frames} latent frames: max abs difference {diff:.2e}")
    assert diff <= 1e-5 * np.abs(expected).max(), diff
    # The two latents give different pictures, and so do the frames within one video.
    assert np.abs(expected[0] - expected[1]).mean() > 1e-2
    if frames > 1:
        assert np.abs(expected[0, 0] - expected[0, -1]).mean() > 1e-2


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
        ({"input_channels": 4}, r"sets input_channels=4, but only input_channels=3 is supported"),
        (
            {"_class_name": "AutoencoderKLHunyuanVideo"},
            r"describes AutoencoderKLHunyuanVideo, not a causal video VAE \(AutoencoderKLWan "
            r"or AutoencoderKLQwenImage\); point model\.path at a Qwen-Image",
        ),
    ],
)
def test_bad_folders_are_one_sentence(folder, tmp_path, changes, message):
    with pytest.raises(ModelLoadError, match=message) as error:
        causal_vae.load_decoder(_broken(folder, tmp_path, **changes), jnp.float32, HINT)
    assert "\n" not in str(error.value) and str(error.value).endswith(".")
