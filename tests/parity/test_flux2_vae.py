"""FLUX.2's VAE decoder (models/flux2/vae.py) against diffusers' PyTorch `AutoencoderKLFlux2`
built tiny and random (float32), its batch-norm statistics set off zero and one: our `decode`
from the pipeline's normalised patch latents against `Flux2Pipeline`'s own steps from its
final tokens to images (`_unpack_latents_with_ids`, the statistics undone, its
`_unpatchify_latents`, the VAE's decode, the image processor's [0, 1] mapping)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models.flux2 import vae as flux2_vae
from tree_grpo_jax.weights.convert import ParamTreeMismatch

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from sd_fixtures import perturb  # noqa: E402

RTOL = 1e-5
# Two levels, two resnets a block, widths that change both ways; a decoder wider than the
# encoder (`decoder_block_out_channels`) so that the two are not confused.
TINY = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 16],
    decoder_block_out_channels=[16, 24],
    layers_per_block=1,
    latent_channels=8,
    norm_num_groups=4,
    sample_size=16,
    batch_norm_eps=1e-2,
)
BATCH, ROWS, COLUMNS = 2, 3, 4  # the patch grid: latents 6x8, images 12x16


@functools.cache
def reference():
    """diffusers' tiny VAE (float32, eval), weights perturbed, the BN statistics random."""
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLFlux2(**TINY)
    perturb(model, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    features = model.bn.running_mean.shape[0]
    model.bn.running_mean.copy_(0.3 * torch.randn(features, generator=generator))
    model.bn.running_var.copy_(0.5 + torch.rand(features, generator=generator))
    return model.eval()


def _pipeline_images(model, tokens: np.ndarray) -> np.ndarray:
    """The pipeline's steps from its final tokens [B, N, C] to images [B, H, W, 3]."""
    from diffusers import Flux2Pipeline

    latents = torch.as_tensor(tokens)
    grid = torch.zeros(BATCH, tokens.shape[-1], ROWS, COLUMNS)
    ids = Flux2Pipeline._prepare_latent_ids(grid)
    with torch.no_grad():
        latents = Flux2Pipeline._unpack_latents_with_ids(latents, ids)
        mean = model.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
        latents = Flux2Pipeline._unpatchify_latents(latents * std + mean)
        image = model.decode(latents, return_dict=False)[0]
    processor = diffusers.pipelines.flux2.image_processor.Flux2ImageProcessor()
    image = processor.postprocess(image, output_type="pt")
    return image.permute(0, 2, 3, 1).numpy()


def _ours():
    model = reference()
    module = flux2_vae.module_from_config(dict(model.config))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return module, flux2_vae.params_from_state_dict(state, module)


def _tokens(seed=0):
    features = 4 * TINY["latent_channels"]
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, ROWS * COLUMNS, features)).astype(np.float32)


def test_decode_matches_the_pipeline():
    tokens = _tokens()
    theirs = _pipeline_images(reference(), tokens)
    module, params = _ours()
    latents = flux2_vae.tokens_to_latents(jnp.asarray(tokens), ROWS, COLUMNS)
    ours = np.asarray(flux2_vae.decode_fn(module)(params, latents))
    assert ours.shape == theirs.shape == (BATCH, 4 * ROWS, 4 * COLUMNS, 3)
    error = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"max error relative to max |image|: {error:.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * np.abs(theirs).max())
    # the images differ from prompt to prompt, and are not clipped flat
    assert np.abs(theirs[0] - theirs[1]).max() > 0.05
    assert 0.0 < theirs.mean() < 1.0 and np.std(theirs) > 0.05


def test_the_statistics_and_the_patch_order_matter():
    """Decoding without undoing the statistics, or with the patch channels in another order,
    gives other images: the test above checks both."""
    tokens = _tokens(1)
    theirs = _pipeline_images(reference(), tokens)
    module, params = _ours()
    decode = flux2_vae.decode_fn(module)
    plain = dict(params, running_mean=jnp.zeros_like(params["running_mean"]))
    plain["running_var"] = jnp.ones_like(params["running_var"]) - module.batch_norm_eps
    latents = flux2_vae.tokens_to_latents(jnp.asarray(tokens), ROWS, COLUMNS)
    assert np.abs(np.asarray(decode(plain, latents)) - theirs).max() > 1e-2
    swapped = tokens.reshape(BATCH, -1, TINY["latent_channels"], 2, 2).swapaxes(-1, -2)
    swapped = flux2_vae.tokens_to_latents(jnp.asarray(swapped.reshape(tokens.shape)), 3, 4)
    assert np.abs(np.asarray(decode(params, swapped)) - theirs).max() > 1e-2


def test_the_converter_reads_the_decoder_only_and_names_what_does_not_fit():
    module, params = _ours()
    assert set(params) == {"decoder", "post_quant_conv", "running_mean", "running_var"}
    state = {k: v.numpy() for k, v in reference().state_dict().items()}
    state.pop("decoder.conv_out.bias")
    state["decoder.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ParamTreeMismatch, match="missing.*conv_out/bias.*unexpected.*extra"):
        flux2_vae.params_from_state_dict(state, module)


def test_the_released_config_builds_the_decoder_diffusers_builds():
    """FLUX.2-dev's VAE config: our decoder's params have the shapes of diffusers' decoder
    (built on the meta device: nothing allocated)."""
    config = flux2_vae.FLUX2_DEV_VAE
    with torch.device("meta"):
        model = diffusers.AutoencoderKLFlux2.from_config(config)  # force_upcast: not a field
    module = flux2_vae.module_from_config(config)
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    ours = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))
    decoder = ("decoder.", "post_quant_conv.", "bn.running_")
    theirs = sum(v.numel() for k, v in model.state_dict().items() if k.startswith(decoder))
    assert ours == theirs
    assert module.block_out_channels == (128, 256, 512, 512) and module.latent_channels == 32


def test_unsupported_configs_are_one_sentence():
    with pytest.raises(ValueError, match="mid_block_add_attention"):
        flux2_vae.module_from_config(dict(TINY, mid_block_add_attention=False))
    with pytest.raises(ValueError, match="patch_size"):
        flux2_vae.module_from_config(dict(TINY, patch_size=[1, 1]))


# ---------------------------------------------------------------------------------------------
# The encoder and the pipelines' reference latents (editing).


def _pipeline_references(model, images: list[np.ndarray]):
    """Flux2Pipeline's path from reference pictures to (tokens [1, M, C], ids [1, M, 4]):
    `__call__`'s resizing and cropping, then its `prepare_image_latents` (the VAE encoded
    with `sample_mode="argmax"`, patched, normalised, ids from `_prepare_image_ids`)."""
    import types

    from diffusers import Flux2Pipeline
    from PIL import Image

    scale = 2 ** (len(model.config.block_out_channels) - 1)
    processor = diffusers.pipelines.flux2.image_processor.Flux2ImageProcessor(
        vae_scale_factor=scale * 2
    )
    pictures = []
    for array in images:
        picture = Image.fromarray(array)
        width, height = picture.size
        if width * height > 1024 * 1024:
            picture = processor._resize_to_target_area(picture, 1024 * 1024)
            width, height = picture.size
        multiple = scale * 2
        width, height = width // multiple * multiple, height // multiple * multiple
        pictures.append(
            processor.preprocess(picture, height=height, width=width, resize_mode="crop")
        )
    pipe = types.SimpleNamespace(
        vae=model,
        _prepare_image_ids=Flux2Pipeline._prepare_image_ids,
        _pack_latents=Flux2Pipeline._pack_latents,
        _patchify_latents=Flux2Pipeline._patchify_latents,
    )
    pipe._encode_vae_image = functools.partial(Flux2Pipeline._encode_vae_image, pipe)
    with torch.no_grad():
        tokens, ids = Flux2Pipeline.prepare_image_latents(
            pipe, pictures, 1, None, torch.device("cpu"), torch.float32
        )
    return tokens[0].numpy(), ids[0].numpy()


def _pictures(count: int):
    rng = np.random.default_rng(7)
    # sizes that are not multiples of 4 pixels (cropped), of two grids
    sizes = [(42, 53), (36, 30)][:count]
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _reference_encoder():
    from tree_grpo_jax.models.flux2.load import ReferenceEncoder

    model = reference()
    module = flux2_vae.encoder_from_config(dict(model.config))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    params = flux2_vae.encoder_params_from_state_dict(state, module)
    return ReferenceEncoder(module, params, multiple=4)


@pytest.mark.parametrize("count", [1, 2])
def test_reference_tokens_and_ids_match_the_pipeline(count):
    images = _pictures(count)
    their_tokens, their_ids = _pipeline_references(reference(), images)
    tokens, ids = _reference_encoder()(images)
    assert tokens.shape == their_tokens.shape and ids.shape == their_ids.shape
    scale = np.abs(their_tokens).max()
    error = np.abs(tokens - their_tokens).max() / scale
    print(f"{count} reference(s), {len(tokens)} tokens: max error / max |token| {error:.2e}")
    np.testing.assert_allclose(tokens, their_tokens, rtol=RTOL, atol=RTOL * scale)
    np.testing.assert_array_equal(ids, their_ids.astype(np.float32))
    assert set(np.unique(ids[:, 0])) == {10.0 * (i + 1) for i in range(count)}
    # the statistics are applied: the normalised tokens are not the raw means
    assert np.abs(tokens.mean(axis=0)).max() < np.abs(their_tokens).max()


def test_the_encoder_converter_reads_the_encoder_half():
    module = _reference_encoder().module
    state = {k: v.numpy() for k, v in reference().state_dict().items()}
    params = flux2_vae.encoder_params_from_state_dict(state, module)
    assert set(params) == {"encoder", "quant_conv", "running_mean", "running_var"}
    state.pop("quant_conv.weight")
    with pytest.raises(ParamTreeMismatch, match="missing.*quant_conv/kernel"):
        flux2_vae.encoder_params_from_state_dict(state, module)
