"""The Flax Qwen-Image transformer against diffusers' PyTorch `QwenImageTransformer2DModel`
(tiny, random, every weight perturbed), its state dict converted by the project's generic
converter; the latent packing against QwenImagePipeline's own helper and the rotary tables
against `QwenEmbedRope` at the released head size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import QwenImagePipeline  # noqa: E402

from tree_grpo_jax.models import patches  # noqa: E402
from tree_grpo_jax.models.qwenimage import transformer  # noqa: E402
from tree_grpo_jax.weights import convert, stacking  # noqa: E402

LATENT_CHANNELS = 4
CONFIG = dict(
    patch_size=2,
    in_channels=4 * LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)
SIGMAS = (0.03, 0.97)
# (latent height, width, text tokens): a square grid (4x4 tokens) with 5 text tokens, and a
# non-square one with odd sides (3x5 tokens) with 7.
CASES = ((8, 8, 5), (6, 10, 7))
PADDING = 2  # the second prompt of a batch is this many tokens shorter
# Measured: a largest difference of 1.2e-6 at outputs of scale ~2.5 in float32, and 1.2% of
# the scale in bfloat16.
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 3e-2


class Reference:
    """A tiny random PyTorch model, noise on every weight (so the ones and zeros of norms and
    biases are not special), and its state dict in numpy."""

    def __init__(self, config: dict, seed: int = 0):
        torch.manual_seed(seed)
        self.torch_model = diffusers.QwenImageTransformer2DModel(**config).eval()
        with torch.no_grad():
            for param in self.torch_model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        self.state = {k: v.numpy() for k, v in self.torch_model.state_dict().items()}
        self.config = dict(self.torch_model.config)
        self._compiled = {}

    def module(self, **options):
        return transformer.transformer_module(self.config, **options)

    def output(self, inputs, **options) -> np.ndarray:
        """Our module of `options` on `inputs` (`flax_output`), compiled once per options."""
        key = tuple(sorted(options.items(), key=str))
        if key not in self._compiled:
            module = self.module(**options)
            self._compiled[key] = (jax.jit(module.apply), self.params(module))
        return flax_output(*self._compiled[key], inputs)

    def params(self, module):
        """The state dict converted onto the blocks one by one, then stacked where `module`
        scans them."""
        blockwise = module.clone(scan_layers=False)
        shapes = convert.shapes_of(_abstract_params(blockwise))
        params = convert.pytorch_to_flax(self.state, shapes, merge_indices=True)
        return stacking.stack(params, _abstract_params(module))


def _abstract_params(module):
    return jax.eval_shape(module.init_weights, jax.random.key(0))


@pytest.fixture(scope="module")
def reference():
    return Reference(CONFIG)


def make_inputs(height, width, text_tokens, seed=0, sigmas=SIGMAS, padded=True) -> dict:
    """Unpacked latents and the rest of the forward's arguments, numpy; the padding tokens
    hold noise too, so that only the mask keeps them out."""
    rng = np.random.default_rng(seed)
    batch = len(sigmas)
    mask = np.ones((batch, text_tokens), np.int64)
    if padded:
        mask[1, text_tokens - PADDING :] = 0
    inputs = dict(
        latents=rng.standard_normal((batch, LATENT_CHANNELS, height, width)).astype(np.float32),
        encoder_hidden_states=rng.standard_normal(
            (batch, text_tokens, CONFIG["joint_attention_dim"])
        ).astype(np.float32),
        encoder_hidden_states_mask=mask,
        timestep=np.asarray(sigmas, np.float32),
    )
    return inputs


def torch_output(model, inputs) -> np.ndarray:
    """The PyTorch model on latents packed by QwenImagePipeline's helper, with the
    pipeline's `img_shapes`."""
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    latents = tensors.pop("latents")
    batch, channels, height, width = latents.shape
    packed = QwenImagePipeline._pack_latents(latents, batch, channels, height, width)
    img_shapes = [[(1, height // 2, width // 2)]] * batch
    with torch.no_grad():
        return model(hidden_states=packed, img_shapes=img_shapes, **tensors).sample.numpy()


def flax_output(apply, params, inputs) -> np.ndarray:
    """A jitted `apply` of our module on latents packed, and position ids made, by our
    helpers."""
    arrays = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    latents = arrays.pop("latents")
    _, _, height, width = latents.shape
    out = apply(
        {"params": params},
        hidden_states=patches.pack_latents(latents),
        img_ids=jnp.asarray(transformer.image_ids(height, width)),
        **arrays,
    )
    return np.asarray(out, np.float32)


def _relative_error(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


# Each latent size and text length once, one with the blocks scanned and one without.
@pytest.mark.parametrize("case, scan_layers", zip(CASES, (True, False)))
def test_matches_pytorch_in_float32(reference, case, scan_layers):
    height, width, text_tokens = case
    params = reference.params(reference.module(scan_layers=scan_layers))
    assert stacking.is_stacked(params) == scan_layers
    inputs = make_inputs(height, width, text_tokens)
    theirs = torch_output(reference.torch_model, inputs)
    ours = reference.output(inputs, scan_layers=scan_layers)
    tokens = (height // 2) * (width // 2)
    assert ours.shape == theirs.shape == (len(SIGMAS), tokens, 4 * LATENT_CHANNELS)
    np.testing.assert_allclose(ours, theirs, rtol=FLOAT32_TOLERANCE, atol=1e-6)


def test_no_mask_matches_pytorch(reference):
    inputs = make_inputs(6, 10, 7, padded=False)
    del inputs["encoder_hidden_states_mask"]
    theirs = torch_output(reference.torch_model, inputs)
    ours = reference.output(dict(inputs, encoder_hidden_states_mask=None), scan_layers=False)
    np.testing.assert_allclose(ours, theirs, rtol=FLOAT32_TOLERANCE, atol=1e-6)


def test_the_reference_depends_on_every_input(reference):
    """The compared outputs are not constant: the timestep, the latents, the text and its
    mask each move PyTorch's output."""
    base = make_inputs(6, 10, 7)
    reference_out = torch_output(reference.torch_model, base)
    other = make_inputs(6, 10, 7, seed=1, sigmas=(0.5, 0.2))
    unpadded = make_inputs(6, 10, 7, padded=False)
    for change in (
        dict(timestep=other["timestep"]),
        dict(latents=other["latents"]),
        dict(encoder_hidden_states=other["encoder_hidden_states"]),
        dict(encoder_hidden_states_mask=unpadded["encoder_hidden_states_mask"]),
    ):
        changed = torch_output(reference.torch_model, dict(base, **change))
        assert _relative_error(changed, reference_out) > 0.02, list(change)
    # the two rows of a batch (different timesteps, latents and text) differ too
    assert _relative_error(reference_out[1], reference_out[0]) > 0.05


def test_bfloat16_compute_with_float32_params_is_close_to_float32(reference):
    inputs = make_inputs(6, 10, 7)
    full = reference.output(inputs, scan_layers=False)
    half = reference.output(inputs, scan_layers=False, dtype=jnp.bfloat16)
    assert np.isfinite(half).all()
    assert _relative_error(half, full) < BFLOAT16_TOLERANCE


def test_params_are_float32_and_named_as_the_state_dict(reference):
    bf16 = reference.module(dtype=jnp.bfloat16, scan_layers=True)
    shapes = jax.eval_shape(bf16.init_weights, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
    params = reference.params(reference.module())
    exported = convert.flax_to_pytorch(params, list_names=transformer.MODULE_LISTS)
    assert sorted(exported) == sorted(reference.state)
    for key, value in reference.state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_scanned_block_remat_gives_pytorchs_gradient(reference):
    """`remat` over scanned blocks (what `model.remat` and `model.scan_layers` build):
    PyTorch autograd's gradient of a weighted sum of the output, every parameter."""
    inputs = make_inputs(6, 10, 5)
    tokens = (6 // 2) * (10 // 2)
    weights = np.random.default_rng(2).standard_normal((len(SIGMAS), tokens, 4 * LATENT_CHANNELS))
    weights = weights.astype(np.float32)
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    latents = tensors.pop("latents")
    packed = QwenImagePipeline._pack_latents(latents, *latents.shape)
    model = reference.torch_model
    model.zero_grad()
    out = model(hidden_states=packed, img_shapes=[[(1, 3, 5)]] * len(SIGMAS), **tensors).sample
    (out * torch.from_numpy(weights)).sum().backward()
    # The last block's text stream after its attention does not reach the output: PyTorch
    # leaves those gradients unset, ours are zeros.
    theirs = {
        k: np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy()
        for k, p in model.named_parameters()
    }
    model.zero_grad()

    module = reference.module(remat="block", scan_layers=True)
    arrays = {k: jnp.asarray(v) for k, v in inputs.items()}
    latents = arrays.pop("latents")
    img_ids = jnp.asarray(transformer.image_ids(6, 10))

    def loss(params):
        out = module.apply(
            {"params": params},
            hidden_states=patches.pack_latents(latents),
            img_ids=img_ids,
            **arrays,
        )
        return jnp.sum(out * weights)

    grads = jax.jit(jax.grad(loss))(reference.params(module))
    ours = convert.flax_to_pytorch(
        stacking.unstack(dict(grads)), list_names=transformer.MODULE_LISTS
    )
    assert sorted(ours) == sorted(theirs)
    scale = max(np.abs(g).max() for g in theirs.values())
    worst = max(np.abs(ours[k] - theirs[k]).max() for k in theirs)
    assert worst < 1e-5 * scale, (worst, scale)


def test_packing_matches_the_pipeline_and_round_trips():
    latents = np.random.default_rng(0).standard_normal((2, LATENT_CHANNELS, 6, 10), np.float32)
    packed = np.asarray(patches.pack_latents(jnp.asarray(latents)))
    theirs = QwenImagePipeline._pack_latents(torch.from_numpy(latents), 2, LATENT_CHANNELS, 6, 10)
    np.testing.assert_array_equal(packed, theirs.numpy())
    np.testing.assert_array_equal(np.asarray(patches.unpack_latents(packed, 6, 10)), latents)
    # The pipeline unpacks from the image size (8 pixels per latent), adding a frame axis.
    unpacked = QwenImagePipeline._unpack_latents(torch.from_numpy(packed.copy()), 48, 80, 8)
    np.testing.assert_array_equal(unpacked.numpy()[:, :, 0], latents)


@pytest.mark.parametrize("height, width", [(128, 96), (2, 6)])
def test_rope_tables_match_qwen_embed_rope_at_full_size(height, width):
    """The released axes (16, 56, 56) over a 1024x768-pixel image's grid (and a one-row
    one), with 300 text tokens after it: our angles against diffusers' complex
    frequencies."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    axes, text_tokens = (16, 56, 56), 300
    rows, columns = height // 2, width // 2
    img_freqs, txt_freqs = QwenEmbedRope(10000, list(axes), scale_rope=True)(
        [(1, rows, columns)], max_txt_seq_len=text_tokens, device=torch.device("cpu")
    )
    theirs = torch.cat([txt_freqs, img_freqs]).numpy()
    img_ids = jnp.asarray(transformer.image_ids(height, width))
    text = jnp.repeat(transformer.text_positions(img_ids, text_tokens)[:, None], 3, axis=1)
    cos, sin = transformer.rope_tables(jnp.concatenate([text, img_ids]), axes)
    np.testing.assert_allclose(np.asarray(cos), theirs.real, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin), theirs.imag, rtol=0, atol=2e-6)


def test_odd_latents_are_refused():
    with pytest.raises(ValueError, match="7x8"):
        patches.pack_latents(jnp.zeros((1, LATENT_CHANNELS, 7, 8)))
    with pytest.raises(ValueError, match="7x8"):
        transformer.image_ids(7, 8)


def test_released_config_keys_are_read():
    """Qwen-Image's first `config.json` also names a `pooled_projection_dim` the model does
    not use; lists become tuples, metadata is ignored."""
    config = {
        **CONFIG,
        "axes_dims_rope": [4, 6, 6],
        "pooled_projection_dim": 768,
        "_class_name": "QwenImageTransformer2DModel",
        "_diffusers_version": "0.34.0.dev0",
    }
    assert transformer.transformer_module(config).axes_dims_rope == (4, 6, 6)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"guidance_embeds": True}, "guidance_embeds"),
        ({"zero_cond_t": True}, "zero_cond_t"),
        ({"use_layer3d_rope": True}, "use_layer3d_rope"),
        ({"axes_dims_rope": (4, 6, 8)}, "add up to 18"),
        ({"axes_dims_rope": (5, 5, 6)}, r"axes_dims_rope \[5, 5, 6\]"),
        ({"mlp_ratio": 2.0}, "mlp_ratio"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, words):
    with pytest.raises(ValueError, match=words) as raised:
        transformer.transformer_module({**CONFIG, **change})
    message = str(raised.value)
    assert "\n" not in message and message.endswith(".")
    assert message.count(". ") == 0
