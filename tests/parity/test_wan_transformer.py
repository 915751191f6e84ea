"""The Flax Wan2.1 transformer against diffusers' PyTorch `WanTransformer3DModel` (tiny and
random, every weight perturbed), its state dict converted both ways by
`models.wan.transformer_weights`; the rotary tables against `WanRotaryPosEmbed` at the
released head size; the released configs' parameter trees against diffusers' models built
on the meta device (no memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tree_grpo_jax.models import attention as attention_backends  # noqa: E402
from tree_grpo_jax.models.wan import transformer, transformer_weights  # noqa: E402
from tree_grpo_jax.weights import convert, stacking  # noqa: E402

CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=8,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)
# The other shapes diffusers' class allows: a patch over two frames, no norm before the
# cross-attention, more output channels than input channels.
VARIANT = dict(CONFIG, patch_size=(2, 2, 1), cross_attn_norm=False, out_channels=6)
VARIANT_LATENTS = (1, 4, 4, 3, 4)
# [B, F, h, w, C] latents: 3 frames of 4x6 (a 3x2x3 token grid, no two axes alike).
LATENT_SHAPE = (2, 3, 4, 6, 4)
TIMESTEPS = (30.0, 970.0)
TEXT_TOKENS = 5
# Relative to the output's scale (max |PyTorch output|, about 2.5); measured 1.9e-7 in
# float32 and 0.7% in bfloat16.
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 1e-2


class Reference:
    """A tiny random PyTorch model, noise on every weight (so the ones and zeros of norms,
    biases and tables are not special), and its state dict in numpy."""

    def __init__(self, config: dict, seed: int = 0):
        torch.manual_seed(seed)
        self.torch_model = diffusers.WanTransformer3DModel(**config).eval()
        with torch.no_grad():
            for param in self.torch_model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        self.state = {k: v.numpy() for k, v in self.torch_model.state_dict().items()}
        self.config = dict(self.torch_model.config)

    def module(self, **options):
        return transformer.transformer_module(self.config, **options)

    def params(self, module):
        return transformer_weights.params_from_state_dict(module, self.state)


@pytest.fixture(scope="module")
def reference():
    return Reference(CONFIG)


@pytest.fixture(scope="module")
def variant():
    return Reference(VARIANT, seed=1)


def make_inputs(seed: int = 0, timesteps=TIMESTEPS, shape=LATENT_SHAPE) -> dict:
    rng = np.random.default_rng(seed)
    inputs = dict(
        hidden_states=rng.standard_normal(shape),
        timestep=np.asarray(timesteps[: shape[0]]),
        encoder_hidden_states=rng.standard_normal((shape[0], TEXT_TOKENS, CONFIG["text_dim"])),
    )
    return {k: np.asarray(v, np.float32) for k, v in inputs.items()}


def torch_output(model, inputs) -> np.ndarray:
    """PyTorch's output in our channels-last layout (its latents are [B, C, F, h, w])."""
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    tensors["hidden_states"] = tensors["hidden_states"].permute(0, 4, 1, 2, 3)
    with torch.no_grad():
        out = model(**tensors).sample
    return out.permute(0, 2, 3, 4, 1).numpy()


def flax_output(module, params, inputs) -> np.ndarray:
    return np.asarray(jax.jit(module.apply)({"params": params}, **inputs), np.float32)


def _relative_error(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("scan_layers", [True, False])
def test_matches_pytorch_in_float32(reference, scan_layers):
    module = reference.module(scan_layers=scan_layers)
    params = reference.params(module)
    assert stacking.is_stacked(params) == scan_layers
    inputs = make_inputs()
    theirs = torch_output(reference.torch_model, inputs)
    ours = flax_output(module, params, inputs)
    assert ours.shape == theirs.shape == LATENT_SHAPE
    assert _relative_error(ours, theirs) < FLOAT32_TOLERANCE


def test_other_patches_and_no_cross_attention_norm_match_pytorch(variant):
    module = variant.module()
    inputs = make_inputs(shape=VARIANT_LATENTS)
    theirs = torch_output(variant.torch_model, inputs)
    ours = flax_output(module, variant.params(module), inputs)
    assert ours.shape == theirs.shape == (*VARIANT_LATENTS[:-1], 6)
    assert _relative_error(ours, theirs) < FLOAT32_TOLERANCE


def test_the_reference_depends_on_timestep_latents_and_text(reference):
    """The compared outputs are not constant: each input moves PyTorch's output."""
    base = make_inputs()
    outputs = [torch_output(reference.torch_model, base)]
    for change in ("timestep", "hidden_states", "encoder_hidden_states"):
        changed = dict(base, **{change: make_inputs(seed=1, timesteps=(500.0, 5.0))[change]})
        outputs.append(torch_output(reference.torch_model, changed))
    for other in outputs[1:]:
        assert _relative_error(other, outputs[0]) > 0.05
    # the two rows of a batch (different timesteps and latents) differ too
    assert _relative_error(outputs[0][1], outputs[0][0]) > 0.05


def test_bfloat16_compute_is_within_one_percent(reference):
    inputs = make_inputs()
    theirs = torch_output(reference.torch_model, inputs)
    module = reference.module(dtype=jnp.bfloat16)
    params = reference.params(module)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    half = flax_output(module, params, inputs)
    assert np.isfinite(half).all()
    assert _relative_error(half, theirs) < BFLOAT16_TOLERANCE


def test_export_round_trip_loads_strictly_into_pytorch(reference):
    """Scanned params -> a diffusers state dict -> a fresh PyTorch model with strict loading:
    the same tensors and the same output as the model they came from."""
    params = reference.params(reference.module())
    exported = transformer_weights.state_dict_from_params(params)
    assert sorted(exported) == sorted(reference.state)
    for key, value in reference.state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    torch.manual_seed(7)
    fresh = diffusers.WanTransformer3DModel(**CONFIG).eval()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    inputs = make_inputs()
    np.testing.assert_array_equal(
        torch_output(fresh, inputs), torch_output(reference.torch_model, inputs)
    )


def test_attention_backends_agree(reference, monkeypatch):
    """XLA's attention against the blockwise one, its keys cut into blocks of 4 (18 video
    tokens, 5 text tokens: several blocks, the last one padded)."""
    blockwise = attention_backends.blockwise_attention

    def small_blocks(query, key, value, *, mask=None, block_size=None):
        return blockwise(query, key, value, mask=mask, block_size=4)

    inputs = make_inputs()
    outputs = []
    for backend in ("xla", "blockwise"):
        module = reference.module(attention=backend)
        with monkeypatch.context() as patch:
            patch.setattr(attention_backends, "blockwise_attention", small_blocks)
            outputs.append(flax_output(module, reference.params(module), inputs))
    assert _relative_error(outputs[1], outputs[0]) < 1e-6


def test_remat_gives_pytorchs_gradient(reference):
    """The gradient of a weighted sum of the output, without remat and with blocks
    recomputed but their attention kept (the remat mode with the most machinery), against
    PyTorch autograd's."""
    inputs = make_inputs()
    weights = np.random.default_rng(2).standard_normal(LATENT_SHAPE).astype(np.float32)
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    tensors["hidden_states"] = tensors["hidden_states"].permute(0, 4, 1, 2, 3)
    model = reference.torch_model
    model.zero_grad()
    out = model(**tensors).sample.permute(0, 2, 3, 4, 1)
    (out * torch.from_numpy(weights)).sum().backward()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters()}
    scale = max(np.abs(g).max() for g in theirs.values())

    for remat in ("none", "block_save_attention"):
        module = reference.module(remat=remat)

        def loss(p, module=module):
            return jnp.sum(module.apply({"params": p}, **inputs) * weights)

        params = reference.params(module)
        grads = transformer_weights.state_dict_from_params(jax.jit(jax.grad(loss))(params))
        assert sorted(grads) == sorted(theirs)
        worst = max(np.abs(grads[k] - theirs[k]).max() for k in theirs)
        assert worst < 1e-5 * scale, (remat, worst, scale)


@pytest.mark.parametrize("size, heads, layers", [("1.3b", 12, 30), ("14b", 40, 40)])
def test_builtin_configs_have_diffusers_parameter_tree(size, heads, layers):
    """The released configs' params against diffusers' model of the same config built on the
    meta device: the same names and shapes, unscanned and scanned (two of the identical
    blocks, to keep the tracing short)."""
    config = transformer.builtin_config(size)
    assert (config["num_attention_heads"], config["num_layers"]) == (heads, layers)
    config["num_layers"] = 2
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(config)
    # zero-stride views: the tree's shapes without its memory
    state = {
        k: np.broadcast_to(np.zeros((), np.float32), tuple(v.shape))
        for k, v in model.state_dict().items()
    }
    module = transformer.transformer_module(config, scan_layers=False)
    shapes = convert.shapes_of(transformer_weights.abstract_params(module))
    convert.pytorch_to_flax(state, shapes, merge_indices=True)  # raises on any mismatch
    assert module.inner_dim == heads * 128
    scanned = transformer.transformer_module(config)
    stacked = stacking.stack(
        transformer_weights.abstract_params(module), transformer_weights.abstract_params(scanned)
    )
    assert convert.shapes_of(stacked) == convert.shapes_of(
        transformer_weights.abstract_params(scanned)
    )
    assert "blocks_0_to_1" in stacked


def test_rope_tables_match_wan_rotary_pos_embed_at_the_released_head_size():
    """Head size 128 over 21 frames of 30x52 tokens (81 frames at 480x832): our per-pair
    angles against diffusers' tables, which repeat each pair's value for its two channels."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    grid = (21, 30, 52)
    rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024)
    their_cos, their_sin = rope(torch.zeros(1, 16, grid[0], 2 * grid[1], 2 * grid[2]))
    cos, sin = transformer.rope_tables(grid, 128)
    for ours, theirs in ((cos, their_cos), (sin, their_sin)):
        theirs = theirs.numpy().reshape(np.prod(grid), 128)
        np.testing.assert_array_equal(theirs[:, ::2], theirs[:, 1::2])
        np.testing.assert_allclose(np.asarray(ours), theirs[:, ::2], rtol=0, atol=1e-7)


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".")
    assert message.count(". ") == 0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"image_dim": 1280}, "image_dim 1280"),
        ({"added_kv_proj_dim": 16}, "added_kv_proj_dim 16"),
        ({"pos_embed_seq_len": 514}, "pos_embed_seq_len 514"),
        ({"qk_norm": "rms_norm"}, "qk_norm 'rms_norm'"),
        ({"patch_size": (2, 2)}, r"patch_size \[2, 2\]"),
        ({"attention_head_dim": 4}, "attention_head_dim 4"),
        ({"window_size": (-1, -1)}, "window_size"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, words):
    with pytest.raises(ValueError, match=words) as raised:
        transformer.transformer_module({**CONFIG, **change})
    _one_sentence(str(raised.value))


def test_image_to_video_is_refused_as_text_to_video_only():
    with pytest.raises(ValueError, match="text-to-video only") as raised:
        transformer.transformer_module({**CONFIG, "image_dim": 1280, "added_kv_proj_dim": 16})
    _one_sentence(str(raised.value))


def test_latents_the_patches_do_not_tile_or_the_rotary_tables_do_not_reach_are_refused(reference):
    module = reference.module()
    params = transformer_weights.abstract_params(module)
    inputs = make_inputs()
    inputs["hidden_states"] = np.zeros((2, 3, 5, 6, 4), np.float32)
    with pytest.raises(ValueError, match="3 frames of 5x6") as raised:
        jax.eval_shape(module.apply, {"params": params}, **inputs)
    _one_sentence(str(raised.value))
    # 33 frames: more positions on one axis than the rotary tables of 32 hold
    inputs["hidden_states"] = np.zeros((2, 33, 4, 6, 4), np.float32)
    with pytest.raises(ValueError, match="rope_max_seq_len 32") as raised:
        jax.eval_shape(module.apply, {"params": params}, **inputs)
    _one_sentence(str(raised.value))


def test_metadata_is_ignored_and_lists_become_tuples():
    config = {**transformer.builtin_config("1.3b"), "_diffusers_version": "0.33.0.dev0"}
    module = transformer.transformer_module(config)
    assert module.patch_size == (1, 2, 2) and module.scan_layers
    with pytest.raises(ValueError, match="'7b'"):
        transformer.builtin_config("7b")
