"""The image VAE (models/autoencoder_kl.py) against diffusers' PyTorch `AutoencoderKL` built
tiny and random (4 and 16 latent channels, with and without quant convs), its weights
converted by `weights.convert`: the same latent Gaussians from the same images and the same
images from the same latents. While diffusers still ships its PyTorch-to-Flax converter
(before 0.40), also the same tree and values from it. (Against diffusers' former Flax VAE:
tests/parity/test_flax_references.py.)"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from tree_grpo_jax.models.autoencoder_kl import AutoencoderKL, module_from_config
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.weights import convert

# Two levels (2x smaller latents), two resnets a block, a channel change in each direction.
TINY = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 16],
    layers_per_block=2,
    norm_num_groups=4,
    sample_size=8,
)
IMAGE = (2, 8, 8, 3)  # [B, H, W, C]
# (latent channels, quant convs): SD1.x's kind, the flow families' kind, and the other two.
KINDS = [(4, True), (16, False), (4, False), (16, True)]


def _config(latent_channels=4, quant=True) -> dict:
    return dict(
        TINY,
        latent_channels=latent_channels,
        use_quant_conv=quant,
        use_post_quant_conv=quant,
    )


def _module(config: dict, dtype=jnp.float32) -> AutoencoderKL:
    return module_from_config(config, "the test's VAE config", dtype, fixed={})


def _inputs(latent_channels: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1.0, 1.0, IMAGE).astype(np.float32)
    latents = rng.standard_normal((2, 4, 4, latent_channels)).astype(np.float32)
    return images, latents


def _encode(module):
    return jax.jit(lambda p, x: module.apply({"params": p}, x, method=module.encode))


def _decode(module):
    return jax.jit(lambda p, z: module.apply({"params": p}, z, method=module.decode))


# ---------------------------------------------------------------------------------------------
# Against diffusers' PyTorch AutoencoderKL.


@functools.cache
def _torch_vae(latent_channels: int, quant: bool):
    """(diffusers' PyTorch VAE, its config) of one kind, every weight perturbed."""
    import torch
    from diffusers import AutoencoderKL as TorchAutoencoderKL
    from sd_fixtures import perturb

    torch.manual_seed(0)
    config = _config(latent_channels, quant)
    vae = TorchAutoencoderKL(**config)
    perturb(vae, torch.Generator().manual_seed(1))  # norm scales and biases off 1 and 0
    return vae.eval(), config


@pytest.fixture(params=KINDS, ids=lambda k: f"latent{k[0]}-quant{k[1]}")
def torch_kind(request):
    pytest.importorskip("torch")
    return _torch_vae(*request.param)


def _converted(vae, module) -> dict:
    """The PyTorch VAE's weights on our tree, as a `vae/` folder's are loaded."""
    state = {k: v.detach().numpy() for k, v in vae.state_dict().items()}
    reference = convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.PRNGKey(0)))
    return convert.pytorch_to_flax(state, reference, merge_indices=True)


def test_decode_equals_torch(torch_kind):
    import torch

    vae, config = torch_kind
    module = _module(config)
    params = _converted(vae, module)
    assert ("post_quant_conv" in params) == config["use_post_quant_conv"]
    _, latents = _inputs(config["latent_channels"])
    with torch.no_grad():
        expected = vae.decode(torch.from_numpy(latents).permute(0, 3, 1, 2)).sample
    expected = expected.permute(0, 2, 3, 1).numpy()
    got = np.asarray(_decode(module)(params, latents))
    assert got.shape == expected.shape == (2, 8, 8, 3)
    assert np.abs(expected[0] - expected[1]).mean() > 0.05  # the latents matter
    diff = np.abs(got - expected).max()
    print(f"decode {config['latent_channels']} channels: max abs difference {diff:.2e}")
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff


def test_encode_equals_torch(torch_kind):
    import torch

    vae, config = torch_kind
    module = _module(config)
    params = _converted(vae, module)
    images, _ = _inputs(config["latent_channels"])
    with torch.no_grad():
        dist = vae.encode(torch.from_numpy(images).permute(0, 3, 1, 2)).latent_dist
    mean, logvar = _encode(module)(params, images)
    for name, got, want in (("mean", mean, dist.mean), ("logvar", logvar, dist.logvar)):
        want = want.permute(0, 2, 3, 1).numpy()
        assert got.shape == want.shape == (2, 4, 4, config["latent_channels"])
        diff = np.abs(np.asarray(got) - want).max()
        print(f"encode {config['latent_channels']} channels, {name}: max abs difference {diff:.2e}")
        assert diff <= 1e-5 * max(1.0, np.abs(want).max()), (name, diff)


def test_missing_torch_weight_is_named(torch_kind):
    vae, config = torch_kind
    module = _module(config)
    state = {k: v.detach().numpy() for k, v in vae.state_dict().items()}
    del state["decoder.mid_block.attentions.0.to_q.weight"]
    reference = convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.PRNGKey(0)))
    with pytest.raises(Exception, match="decoder/mid_block/attentions_0/query/kernel"):
        convert.pytorch_to_flax(state, reference, merge_indices=True)


# ---------------------------------------------------------------------------------------------
# Against diffusers' own PyTorch-to-Flax converter, while diffusers ships it (before 0.40).
# (Against its former Flax VAE: tests/parity/test_flax_references.py.)


def _diffusers_converter():
    try:
        from diffusers.models.modeling_flax_pytorch_utils import (
            convert_pytorch_state_dict_to_flax,
        )
    except ImportError:
        pytest.skip("this diffusers has no PyTorch-to-Flax converter (removed in 0.40)")
    return convert_pytorch_state_dict_to_flax


@pytest.mark.parametrize("latent_channels", [4, 16])
def test_conversion_equals_diffusers_converter(latent_channels):
    """diffusers' own PyTorch->Flax converter (it needs torch) fills the same tree (the
    quant convs included: its Flax VAE always has them)."""
    pytest.importorskip("torch")
    convert_pytorch_state_dict_to_flax = _diffusers_converter()
    vae, config = _torch_vae(latent_channels, quant=True)
    module = _module(config)
    shapes_only = types.SimpleNamespace(
        init_weights=lambda key: jax.eval_shape(module.init_weights, key)
    )
    theirs = flatten_dict(dict(convert_pytorch_state_dict_to_flax(vae.state_dict(), shapes_only)))
    ours = flatten_dict(_converted(vae, module))
    assert sorted(ours) == sorted(theirs)
    for path, value in ours.items():
        np.testing.assert_array_equal(value, np.asarray(theirs[path]), err_msg=str(path))


# ---------------------------------------------------------------------------------------------
# Configs.


def test_config_fields_and_checks():
    module = _module(_config(16, quant=False))
    assert (module.block_out_channels, module.latent_channels) == ((8, 16), 16)
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    assert "quant_conv" not in shapes and "post_quant_conv" not in shapes
    with pytest.raises(ModelLoadError, match=r"sets use_quant_conv='no', but it must be true"):
        _module(dict(_config(), use_quant_conv="no"))
    with pytest.raises(ModelLoadError, match=r"sets up_block_types=\['AttnUpDecoderBlock2D'"):
        _module(dict(_config(), up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"]))
    with pytest.raises(ModelLoadError, match=r"one 'DownEncoderBlock2D' per block_out_channels"):
        _module(dict(_config(), down_block_types=["DownEncoderBlock2D"]))
    with pytest.raises(ModelLoadError, match=r"sets act_fn='gelu', but only act_fn='silu'"):
        module_from_config(dict(_config(), act_fn="gelu"), "here", jnp.float32, {"act_fn": "silu"})
