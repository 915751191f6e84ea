"""The Flax MMDiT against diffusers' PyTorch `SD3Transformer2DModel`, loaded through the
project's generic converter from a file `save_pretrained` wrote."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from residuals import residual_bytes  # noqa: E402
from sd3_fixtures import TRANSFORMER_CONFIG  # noqa: E402

from tree_grpo_jax.models.sd3 import mmdit  # noqa: E402
from tree_grpo_jax.weights import convert  # noqa: E402

# SD3.5 style: MMDiT-X blocks (not the last, context_pre_only, block) and RMS qk-norm; the
# tiny folder's transformer, with narrower text inputs.
SD35_CONFIG = {**TRANSFORMER_CONFIG, "joint_attention_dim": 32, "pooled_projection_dim": 24}
# SD3-Medium (v1) style: plain joint blocks, no qk-norm.
SD3_CONFIG = {**SD35_CONFIG, "dual_attention_layers": (), "qk_norm": None}
# (latent height, width): square, and non-square with an odd patch-grid side.
LATENT_SIZES = ((8, 8), (6, 12))
TIMESTEPS = ((37.5, 981.0), (500.0, 1.0))
TEXT_TOKENS = 7
# Relative to the output's scale (max |PyTorch output|, about 2); measured: 3.5e-7 in
# float32 (max abs difference 7.2e-7) and 0.9% in bfloat16.
FLOAT32_TOLERANCE = 2e-6
BFLOAT16_TOLERANCE = 3e-2


class Reference:
    """A tiny random PyTorch model, its safetensors file and our converted params."""

    def __init__(self, config: dict, folder):
        torch.manual_seed(0)
        self.torch_model = diffusers.SD3Transformer2DModel(**config).eval()
        with torch.no_grad():
            for param in self.torch_model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        self.torch_model.save_pretrained(folder, safe_serialization=True)
        self.file_state = safetensors_numpy.load_file(
            str(folder / "diffusion_pytorch_model.safetensors")
        )
        self.module = mmdit.transformer_module(dict(self.torch_model.config))
        self.apply = jax.jit(self.module.apply)
        self.state = {k: v for k, v in self.file_state.items() if k not in mmdit.BUFFERS}
        shapes = jax.eval_shape(self.module.init_weights, jax.random.key(0))
        self.params = convert.pytorch_to_flax(
            self.state, convert.shapes_of(shapes), merge_indices=True
        )

    def inputs(self, height: int, width: int, timesteps, seed: int = 0):
        rng = np.random.default_rng(seed)
        config = self.module
        batch = len(timesteps)
        return dict(
            hidden_states=rng.standard_normal((batch, config.in_channels, height, width)),
            encoder_hidden_states=rng.standard_normal(
                (batch, TEXT_TOKENS, config.joint_attention_dim)
            ),
            pooled_projections=rng.standard_normal((batch, config.pooled_projection_dim)),
            timestep=np.asarray(timesteps),
        )

    def torch_output(self, inputs) -> np.ndarray:
        tensors = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in inputs.items()}
        with torch.no_grad():
            return self.torch_model(**tensors).sample.numpy()


def flax_output(apply, params, inputs) -> np.ndarray:
    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    return np.asarray(apply({"params": params}, **arrays), np.float32)


@pytest.fixture(scope="module")
def sd35(tmp_path_factory):
    return Reference(SD35_CONFIG, tmp_path_factory.mktemp("sd35"))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return Reference(SD3_CONFIG, tmp_path_factory.mktemp("sd3"))


def _relative_error(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("name", ["sd35", "sd3"])
def test_matches_pytorch_in_float32(name, request):
    reference = request.getfixturevalue(name)
    for height, width in LATENT_SIZES:
        for timesteps in TIMESTEPS:
            inputs = reference.inputs(height, width, timesteps)
            theirs = reference.torch_output(inputs)
            ours = flax_output(reference.apply, reference.params, inputs)
            assert ours.shape == theirs.shape == (len(timesteps), 16, height, width)
            assert _relative_error(ours, theirs) < FLOAT32_TOLERANCE, (height, width, timesteps)


def test_bfloat16_compute_is_close_to_float32(sd35):
    inputs = sd35.inputs(8, 12, TIMESTEPS[0])
    full = flax_output(sd35.apply, sd35.params, inputs)
    bf16 = mmdit.transformer_module(SD35_CONFIG, dtype=jnp.bfloat16)
    half = flax_output(jax.jit(bf16.apply), sd35.params, inputs)
    assert np.isfinite(half).all()
    assert _relative_error(half, full) < BFLOAT16_TOLERANCE


def test_position_table_equals_the_files_buffer(sd35):
    config = sd35.module
    table = mmdit.sincos_position_table(
        config.inner_dim, config.pos_embed_max_size, config.sample_size // config.patch_size
    )
    np.testing.assert_array_equal(table[None], sd35.file_state["pos_embed.pos_embed"])


def test_params_export_to_the_diffusers_keys(sd35, sd3):
    for reference in (sd35, sd3):
        exported = convert.flax_to_pytorch(reference.params)
        assert sorted(exported) == sorted(reference.state)
        for key, value in reference.state.items():
            np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_config_metadata_is_ignored_and_lists_become_tuples():
    config = {
        **SD35_CONFIG,
        "dual_attention_layers": [0, 1],
        "_class_name": "SD3Transformer2DModel",
        "_diffusers_version": "0.31.0",
    }
    module = mmdit.transformer_module(config)
    assert module.dual_attention_layers == (0, 1)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"qk_norm": "layer_norm"}, "qk_norm 'layer_norm'"),
        ({"pos_embed_max_size": None}, "pos_embed_max_size"),
        ({"caption_projection_dim": 24}, "caption_projection_dim 24"),
        ({"use_rope": True}, "use_rope"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, words):
    with pytest.raises(ValueError, match=words) as raised:
        mmdit.transformer_module({**SD35_CONFIG, **change})
    message = str(raised.value)
    assert "\n" not in message and message.endswith(".")
    assert message.count(". ") == 0


def test_latents_larger_than_the_position_table_are_refused(sd3):
    inputs = sd3.inputs(26, 8, (1.0,))
    with pytest.raises(ValueError, match="pos_embed_max_size 12"):
        flax_output(sd3.apply, sd3.params, inputs)


def test_block_remat_keeps_params_and_gradients_and_saves_less(sd35):
    """`remat` (what `model.remat` builds): the same param tree, the gradient PyTorch's
    autograd gives, and of the forward's activations only the blocks' inputs kept for it."""
    inputs = sd35.inputs(8, 8, TIMESTEPS[0])
    weights = np.random.default_rng(1).standard_normal((2, 16, 8, 8)).astype(np.float32)
    tensors = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in inputs.items()}
    sd35.torch_model.zero_grad()
    (sd35.torch_model(**tensors).sample * torch.from_numpy(weights)).sum().backward()
    theirs = {k: p.grad.numpy() for k, p in sd35.torch_model.named_parameters()}

    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}

    def loss_of(module):
        return lambda p: jnp.sum(module.apply({"params": p}, **arrays) * weights)

    def compiled_grad(module):
        return jax.jit(jax.grad(loss_of(module))).lower(sd35.params).compile()

    remat = compiled_grad(mmdit.transformer_module(SD35_CONFIG, remat=True))
    ours = convert.flax_to_pytorch(remat(sd35.params))
    assert sorted(ours) == sorted(theirs)
    scale = max(np.abs(g).max() for g in theirs.values())
    worst = max(np.abs(ours[k] - theirs[k]).max() for k in theirs)
    assert worst < 1e-5 * scale, (worst, scale)

    plain, remat = (
        residual_bytes(loss_of(mmdit.transformer_module(SD35_CONFIG, remat=r)), sd35.params)
        for r in (False, True)
    )
    assert remat < 0.5 * plain, (remat, plain)
