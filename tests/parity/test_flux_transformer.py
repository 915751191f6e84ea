"""The Flax FLUX transformer against diffusers' PyTorch `FluxTransformer2DModel` (tiny, random,
FLUX.1-dev and -schnell style), its state dict converted by the project's generic converter;
the latent packing and position ids against FluxPipeline's own helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import FluxPipeline  # noqa: E402
from residuals import residual_bytes  # noqa: E402

from tree_grpo_jax.models import patches  # noqa: E402
from tree_grpo_jax.models.flux import transformer  # noqa: E402
from tree_grpo_jax.weights import convert  # noqa: E402

DEV_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
SCHNELL_CONFIG = {**DEV_CONFIG, "guidance_embeds": False}
LATENT_CHANNELS = 16
# (latent height, width): square, and non-square with an odd side of the packed grid.
LATENT_SIZES = ((8, 8), (6, 12))
SIGMAS = (0.03, 0.97)
GUIDANCE = (3.5, 1.0)
TEXT_TOKENS = 5
# Relative to the output's scale (max |PyTorch output|, about 2.4); measured: 9.2e-7 in
# float32 (max abs difference 2.2e-6) and 1.0% in bfloat16.
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 3e-2


class Reference:
    """A tiny random PyTorch model and its state dict converted to our params."""

    def __init__(self, config: dict, seed: int = 0):
        torch.manual_seed(seed)
        self.torch_model = diffusers.FluxTransformer2DModel(**config).eval()
        with torch.no_grad():
            # Noise on every weight, so that ones and zeros (norm scales, biases) are not special.
            for param in self.torch_model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        self.state = {k: v.numpy() for k, v in self.torch_model.state_dict().items()}
        self.module = transformer.transformer_module(dict(self.torch_model.config))
        self.apply = jax.jit(self.module.apply)
        shapes = jax.eval_shape(self.module.init_weights, jax.random.key(0))
        self.params = convert.pytorch_to_flax(
            self.state, convert.shapes_of(shapes), merge_indices=True
        )


def make_inputs(module, height: int, width: int, seed: int = 0, random_text_ids=False):
    """Unpacked latents and the rest of the forward's arguments, numpy float32."""
    rng = np.random.default_rng(seed)
    batch = len(SIGMAS)
    ids = rng.integers(0, 4, (TEXT_TOKENS, 3)) if random_text_ids else np.zeros((TEXT_TOKENS, 3))
    inputs = dict(
        latents=rng.standard_normal((batch, LATENT_CHANNELS, height, width)),
        encoder_hidden_states=rng.standard_normal((batch, TEXT_TOKENS, module.joint_attention_dim)),
        pooled_projections=rng.standard_normal((batch, module.pooled_projection_dim)),
        timestep=np.asarray(SIGMAS),
        txt_ids=ids,
    )
    if module.guidance_embeds:
        inputs["guidance"] = np.asarray(GUIDANCE)
    return {k: np.asarray(v, np.float32) for k, v in inputs.items()}


def torch_output(model, inputs) -> np.ndarray:
    """The PyTorch model on latents packed, and image ids made, by FluxPipeline's helpers."""
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    latents = tensors.pop("latents")
    batch, channels, height, width = latents.shape
    packed = FluxPipeline._pack_latents(latents, batch, channels, height, width)
    ids = FluxPipeline._prepare_latent_image_ids(
        batch, height // 2, width // 2, torch.device("cpu"), torch.float32
    )
    with torch.no_grad():
        return model(hidden_states=packed, img_ids=ids, **tensors).sample.numpy()


def flax_forward(apply, params, inputs) -> jax.Array:
    """Our module on latents packed, and image ids made, by our helpers."""
    arrays = {k: jnp.asarray(v) for k, v in inputs.items()}
    latents = arrays.pop("latents")
    _, _, height, width = latents.shape
    return apply(
        {"params": params},
        hidden_states=patches.pack_latents(latents),
        img_ids=jnp.asarray(transformer.image_ids(height, width)),
        **arrays,
    )


def flax_output(apply, params, inputs) -> np.ndarray:
    return np.asarray(flax_forward(apply, params, inputs), np.float32)


def _relative_error(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def dev():
    return Reference(DEV_CONFIG)


@pytest.fixture(scope="module")
def schnell():
    return Reference(SCHNELL_CONFIG, seed=1)


@pytest.mark.parametrize("name", ["dev", "schnell"])
def test_matches_pytorch_in_float32(name, request):
    reference = request.getfixturevalue(name)
    for (height, width), random_text_ids in zip(LATENT_SIZES, (False, True)):
        inputs = make_inputs(reference.module, height, width, random_text_ids=random_text_ids)
        theirs = torch_output(reference.torch_model, inputs)
        ours = flax_output(reference.apply, reference.params, inputs)
        tokens = (height // 2) * (width // 2)
        assert ours.shape == theirs.shape == (len(SIGMAS), tokens, 64)
        error = _relative_error(ours, theirs)
        assert error < FLOAT32_TOLERANCE, (height, width, error)


def test_bfloat16_compute_with_float32_params_is_close_to_float32(dev):
    inputs = make_inputs(dev.module, 6, 12)
    full = flax_output(dev.apply, dev.params, inputs)
    bf16 = transformer.transformer_module(DEV_CONFIG, dtype=jnp.bfloat16)
    assert jax.tree.leaves(dev.params)[0].dtype == jnp.float32
    half = flax_output(jax.jit(bf16.apply), dev.params, inputs)
    assert np.isfinite(half).all()
    assert _relative_error(half, full) < BFLOAT16_TOLERANCE


def test_init_gives_float32_params_named_as_the_state_dict(schnell):
    bf16 = transformer.transformer_module(SCHNELL_CONFIG, dtype=jnp.bfloat16)
    params = jax.eval_shape(bf16.init_weights, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    exported = convert.flax_to_pytorch(schnell.params, list_names=transformer.MODULE_LISTS)
    assert sorted(exported) == sorted(schnell.state)
    for key, value in schnell.state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_packing_matches_the_pipeline_and_round_trips():
    latents = np.random.default_rng(0).standard_normal((2, LATENT_CHANNELS, 6, 10), np.float32)
    packed = np.asarray(patches.pack_latents(jnp.asarray(latents)))
    theirs = FluxPipeline._pack_latents(torch.from_numpy(latents), 2, LATENT_CHANNELS, 6, 10)
    np.testing.assert_array_equal(packed, theirs.numpy())
    np.testing.assert_array_equal(np.asarray(patches.unpack_latents(packed, 6, 10)), latents)
    # The pipeline unpacks from the image size: 8 pixels per latent.
    unpacked = FluxPipeline._unpack_latents(torch.from_numpy(packed.copy()), 48, 80, 8)
    np.testing.assert_array_equal(unpacked.numpy(), latents)


def test_ids_match_the_pipeline():
    theirs = FluxPipeline._prepare_latent_image_ids(1, 3, 5, torch.device("cpu"), torch.float32)
    np.testing.assert_array_equal(transformer.image_ids(6, 10), theirs.numpy())
    np.testing.assert_array_equal(transformer.text_ids(4), np.zeros((4, 3), np.float32))


def test_rope_tables_match_flux_pos_embed_at_full_size():
    """FLUX.1's real axes over a 1024-pixel image's ids (128x128 latents, positions to 63):
    our float32 angles against diffusers' float64 ones."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    axes = (16, 56, 56)
    ids = np.concatenate([transformer.text_ids(3), transformer.image_ids(128, 128)])
    their_cos, their_sin = FluxPosEmbed(10000, list(axes))(torch.from_numpy(ids))
    cos, sin = transformer.rope_tables(jnp.asarray(ids), axes)
    # diffusers repeats each pair's angle for its two channels.
    for ours, theirs in ((cos, their_cos.numpy()), (sin, their_sin.numpy())):
        np.testing.assert_array_equal(theirs[:, ::2], theirs[:, 1::2])
        np.testing.assert_allclose(np.asarray(ours), theirs[:, ::2], rtol=0, atol=1e-5)


def test_odd_latents_are_refused():
    with pytest.raises(ValueError, match="7x8"):
        patches.pack_latents(jnp.zeros((1, LATENT_CHANNELS, 7, 8)))
    with pytest.raises(ValueError, match="7x8"):
        transformer.image_ids(7, 8)


def test_guidance_goes_with_guidance_embeds(dev, schnell):
    for reference, guidance in ((dev, None), (schnell, np.ones(2, np.float32))):
        module = reference.module
        arguments = (*module.example_inputs()[:-1], guidance)
        with pytest.raises(ValueError, match="guidance"):
            module.apply({"params": reference.params}, *arguments)


def test_config_metadata_is_ignored_and_lists_become_tuples():
    config = {
        **DEV_CONFIG,
        "axes_dims_rope": [4, 6, 6],
        "_class_name": "FluxTransformer2DModel",
        "_diffusers_version": "0.30.0.dev0",
    }
    assert transformer.transformer_module(config).axes_dims_rope == (4, 6, 6)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"patch_size": 2}, "patch_size 2"),
        ({"axes_dims_rope": (4, 6, 8)}, "add up to 18"),
        ({"axes_dims_rope": (5, 5, 6)}, r"axes_dims_rope \[5, 5, 6\]"),
        ({"axes_dims_rope": (8, 8)}, "3 positive even sizes"),
        ({"mlp_ratio": 2.0}, "mlp_ratio"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, words):
    with pytest.raises(ValueError, match=words) as raised:
        transformer.transformer_module({**DEV_CONFIG, **change})
    message = str(raised.value)
    assert "\n" not in message and message.endswith(".")
    assert message.count(". ") == 0


def test_compute_dtype_is_checked():
    with pytest.raises(ValueError, match="float16"):
        transformer.transformer_module(DEV_CONFIG, dtype=jnp.float16)


def test_block_remat_gives_pytorchs_gradient(dev):
    """`remat` (what `model.remat` builds): PyTorch autograd's gradient of a weighted
    sum of the output."""
    inputs = make_inputs(dev.module, 8, 8)
    tokens = (8 // 2) * (8 // 2)
    weights = np.random.default_rng(2).standard_normal((len(SIGMAS), tokens, 64))
    weights = weights.astype(np.float32)
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    latents = tensors.pop("latents")
    packed = FluxPipeline._pack_latents(latents, *latents.shape)
    ids = FluxPipeline._prepare_latent_image_ids(1, 4, 4, torch.device("cpu"), torch.float32)
    dev.torch_model.zero_grad()
    out = dev.torch_model(hidden_states=packed, img_ids=ids, **tensors).sample
    (out * torch.from_numpy(weights)).sum().backward()
    theirs = {k: p.grad.numpy() for k, p in dev.torch_model.named_parameters()}

    def compiled_grad(module):
        def loss(params):
            return jnp.sum(flax_forward(module.apply, params, inputs) * weights)

        return jax.jit(jax.grad(loss)).lower(dev.params).compile()

    remat = compiled_grad(transformer.transformer_module(DEV_CONFIG, remat=True))
    ours = convert.flax_to_pytorch(remat(dev.params), list_names=transformer.MODULE_LISTS)
    assert sorted(ours) == sorted(theirs)
    scale = max(np.abs(g).max() for g in theirs.values())
    worst = max(np.abs(ours[k] - theirs[k]).max() for k in theirs)
    assert worst < 1e-5 * scale, (worst, scale)


def test_block_remat_saves_only_the_blocks_inputs():
    """What the gradient keeps from the forward: with `remat`, each block's input
    (and the parameters) instead of every activation inside the blocks."""
    inputs = make_inputs(transformer.transformer_module(DEV_CONFIG), 16, 16)

    def saved(remat_blocks: bool) -> int:
        module = transformer.transformer_module(DEV_CONFIG, remat=remat_blocks)
        params = jax.eval_shape(module.init_weights, jax.random.key(0))
        return residual_bytes(lambda p: flax_forward(module.apply, p, inputs), params)

    remat, plain = saved(True), saved(False)
    assert remat < 0.5 * plain, (remat, plain)
