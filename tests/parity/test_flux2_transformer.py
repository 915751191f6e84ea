"""The Flax FLUX.2 transformer against diffusers' PyTorch `Flux2Transformer2DModel` (tiny,
random, every weight perturbed; FLUX.2-dev style with the guidance embedding and klein style
without), its state dict converted both ways; the position ids against Flux2Pipeline's own
helpers, the rotary tables against `Flux2PosEmbed` at the released size, and the released
configs' parameter counts against diffusers on the meta device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import Flux2Pipeline  # noqa: E402

from tree_grpo_jax.models.flux2 import transformer  # noqa: E402
from tree_grpo_jax.weights import convert, stacking  # noqa: E402

DEV_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
KLEIN_CONFIG = {**DEV_CONFIG, "guidance_embeds": False}
LATENT_CHANNELS = DEV_CONFIG["in_channels"]  # the patchified latent's channels
SIGMAS = (0.03, 0.97)
GUIDANCE = (4.0, 1.5)
TEXT_TOKENS = 5
GRID = (3, 4)  # the noisy latent's token rows and columns
# Reference images' token grids, appended after the noisy latent's tokens.
REFERENCES = ((2, 3), (2, 2))
# Relative to the output's scale (max |PyTorch output|, about 3); measured: at most 2.8e-7 in
# float32 (max abs difference 8.3e-7) over the four cases, 0.6% in bfloat16.
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 3e-2


class Reference:
    """A tiny random PyTorch model, noise on every weight (so the ones of the norms are not
    special), its state dict in numpy, and our modules' compiled applies."""

    def __init__(self, config: dict, seed: int):
        torch.manual_seed(seed)
        self.torch_model = diffusers.Flux2Transformer2DModel(**config).eval()
        with torch.no_grad():
            for param in self.torch_model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        self.state = {k: v.numpy() for k, v in self.torch_model.state_dict().items()}
        self.config = dict(self.torch_model.config)
        self._compiled = {}

    def module(self, **options):
        return transformer.transformer_module(self.config, **options)

    def output(self, inputs, **options) -> np.ndarray:
        key = tuple(sorted(options.items(), key=str))
        if key not in self._compiled:
            module = self.module(**options)
            params = transformer.params_from_state_dict(module, self.state)
            self._compiled[key] = (jax.jit(module.apply), params)
        apply, params = self._compiled[key]
        return np.asarray(apply({"params": params}, **_ours(inputs)), np.float32)


@pytest.fixture(scope="module")
def dev():
    return Reference(DEV_CONFIG, seed=0)


@pytest.fixture(scope="module")
def klein():
    return Reference(KLEIN_CONFIG, seed=1)


def make_inputs(config: dict, references=(), seed: int = 0) -> dict:
    """The forward's arguments as the pipeline builds them (torch tensors): tokens of the
    noisy latent, then of each reference image, with ids from Flux2Pipeline's helpers
    (batched, int64)."""
    rng = np.random.default_rng(seed)
    batch = len(SIGMAS)

    def tokens(rows, columns):
        grid = rng.standard_normal((batch, LATENT_CHANNELS, rows, columns)).astype(np.float32)
        return torch.from_numpy(grid)

    latents = tokens(*GRID)
    hidden = [Flux2Pipeline._pack_latents(latents)]
    ids = [Flux2Pipeline._prepare_latent_ids(latents)]
    if references:
        images = [tokens(*grid) for grid in references]
        hidden += [Flux2Pipeline._pack_latents(image) for image in images]
        ids.append(Flux2Pipeline._prepare_image_ids([i[:1] for i in images]).repeat(batch, 1, 1))
    text = rng.standard_normal((batch, TEXT_TOKENS, config["joint_attention_dim"]))
    text = torch.from_numpy(text.astype(np.float32))
    inputs = dict(
        hidden_states=torch.cat(hidden, dim=1),
        encoder_hidden_states=text,
        timestep=torch.tensor(SIGMAS),
        img_ids=torch.cat(ids, dim=1),
        txt_ids=Flux2Pipeline._prepare_text_ids(text),
    )
    if config["guidance_embeds"]:
        inputs["guidance"] = torch.tensor(GUIDANCE)
    return inputs


def _ours(inputs: dict) -> dict:
    return {k: jnp.asarray(v.numpy()) for k, v in inputs.items()}


def torch_output(model, inputs) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs).sample.numpy()


def _errors(ours, theirs) -> tuple[float, float]:
    """(max abs difference, the same relative to max |theirs|)."""
    worst = float(np.abs(ours - theirs).max())
    return worst, worst / float(np.abs(theirs).max())


@pytest.mark.parametrize(
    "name, scan_layers, references",
    [
        ("dev", False, ()),
        ("dev", True, REFERENCES),
        ("klein", False, REFERENCES[:1]),
        ("klein", True, ()),
    ],
)
def test_matches_pytorch_in_float32(request, name, scan_layers, references):
    reference = request.getfixturevalue(name)
    inputs = make_inputs(reference.config, references)
    theirs = torch_output(reference.torch_model, inputs)
    ours = reference.output(inputs, scan_layers=scan_layers)
    image_tokens = GRID[0] * GRID[1] + sum(r * c for r, c in references)
    assert ours.shape == theirs.shape == (len(SIGMAS), image_tokens, LATENT_CHANNELS)
    # the rows (different timesteps, latents, text and guidance) give different outputs
    assert _errors(theirs[1], theirs[0])[1] > 0.05
    worst, relative = _errors(ours, theirs)
    assert relative < FLOAT32_TOLERANCE, (worst, relative)


def test_ids_as_one_row_match_batched_ids(dev):
    """[S, 4] ids stand for every row, as the batched ids the pipeline passes."""
    inputs = make_inputs(DEV_CONFIG)
    batched = dev.output(inputs, scan_layers=False)
    one_row = dict(inputs, img_ids=inputs["img_ids"][0], txt_ids=inputs["txt_ids"][0])
    np.testing.assert_array_equal(dev.output(one_row, scan_layers=False), batched)


def test_the_reference_depends_on_the_reference_tokens_and_guidance(dev):
    """The compared outputs move with what the cases vary: the reference image's tokens
    reach the noisy latent's outputs, and the guidance scale moves them."""
    inputs = make_inputs(DEV_CONFIG, REFERENCES[:1])
    base = torch_output(dev.torch_model, inputs)
    tokens = GRID[0] * GRID[1]
    other = inputs["hidden_states"].clone()
    other[:, tokens:] = torch.randn_like(other[:, tokens:])
    moved = torch_output(dev.torch_model, dict(inputs, hidden_states=other))
    assert _errors(moved[:, :tokens], base[:, :tokens])[1] > 0.01
    guided = torch_output(dev.torch_model, dict(inputs, guidance=torch.tensor((1.0, 6.0))))
    assert _errors(guided, base)[1] > 0.01


def test_bfloat16_compute_with_float32_params_is_close_to_float32(klein):
    inputs = make_inputs(KLEIN_CONFIG)
    full = klein.output(inputs, scan_layers=True)
    half = klein.output(inputs, scan_layers=True, dtype=jnp.bfloat16)
    assert np.isfinite(half).all()
    assert _errors(half, full)[1] < BFLOAT16_TOLERANCE


def test_the_attention_backend_is_chosen_by_name(klein):
    """The blockwise backend (keys a block at a time) gives PyTorch's output too; an unknown
    name is refused."""
    inputs = make_inputs(KLEIN_CONFIG, REFERENCES[:1])
    theirs = torch_output(klein.torch_model, inputs)
    ours = klein.output(inputs, scan_layers=True, attention="blockwise")
    assert _errors(ours, theirs)[1] < FLOAT32_TOLERANCE
    with pytest.raises(ValueError, match="attention backend 'flash'"):
        klein.module(attention="flash")


def test_params_are_float32_and_export_gives_the_state_dict_back(dev):
    bf16 = dev.module(dtype=jnp.bfloat16, scan_layers=True)
    shapes = jax.eval_shape(bf16.init_weights, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
    for scan_layers in (False, True):
        params = transformer.params_from_state_dict(dev.module(scan_layers=scan_layers), dev.state)
        assert stacking.is_stacked(params) == scan_layers
        exported = transformer.state_dict_from_params(params)
        assert sorted(exported) == sorted(dev.state)
        for key, value in dev.state.items():
            np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_a_state_dict_that_does_not_fit_names_the_keys(dev):
    state = dict(dev.state)
    del state["transformer_blocks.1.ff.linear_in.weight"]
    state["transformer_blocks.1.ff.linear_mid.weight"] = np.zeros((4, 4), np.float32)
    with pytest.raises(convert.ParamTreeMismatch) as raised:
        transformer.params_from_state_dict(dev.module(scan_layers=True), state)
    message = str(raised.value)
    assert "transformer_blocks_1/ff/linear_in/kernel" in message
    assert "transformer_blocks.1.ff.linear_mid.weight" in message
    assert "\n" not in message and message.count(". ") == 0


def _weighted_sum_gradients(reference, weights, **options) -> dict:
    """Gradients of sum(output * weights), as a diffusers state dict."""
    inputs = _ours(make_inputs(reference.config, REFERENCES[:1]))
    module = reference.module(**options)

    def loss(params):
        return jnp.sum(module.apply({"params": params}, **inputs) * weights)

    params = transformer.params_from_state_dict(module, reference.state)
    return transformer.state_dict_from_params(jax.jit(jax.grad(loss))(params))


@pytest.mark.slow  # two gradient compilations, about 13 s on two shared CPU cores
def test_scanned_block_remat_gradients_match_unrolled_and_pytorch(dev):
    inputs = make_inputs(DEV_CONFIG, REFERENCES[:1])
    tokens = GRID[0] * GRID[1] + REFERENCES[0][0] * REFERENCES[0][1]
    weights = np.random.default_rng(2).standard_normal((len(SIGMAS), tokens, LATENT_CHANNELS))
    weights = weights.astype(np.float32)
    model = dev.torch_model
    model.zero_grad()
    (model(**inputs).sample * torch.from_numpy(weights)).sum().backward()
    theirs = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
    model.zero_grad()

    scanned = _weighted_sum_gradients(dev, weights, scan_layers=True, remat="block")
    unrolled = _weighted_sum_gradients(dev, weights, scan_layers=False)
    assert sorted(scanned) == sorted(unrolled) == sorted(theirs)
    scale = max(np.abs(g).max() for g in theirs.values())
    for ours in (scanned, unrolled):
        worst = max(np.abs(ours[k] - theirs[k]).max() for k in theirs)
        assert worst < 1e-5 * scale, (worst, scale)
    worst = max(np.abs(scanned[k] - unrolled[k]).max() for k in theirs)
    assert worst < 1e-6 * scale, (worst, scale)


def test_ids_match_the_pipeline():
    latents = torch.zeros(1, LATENT_CHANNELS, 3, 5)
    theirs = Flux2Pipeline._prepare_latent_ids(latents)[0].numpy()
    np.testing.assert_array_equal(transformer.image_ids(3, 5), theirs)
    images = [torch.zeros(1, LATENT_CHANNELS, 2, 3), torch.zeros(1, LATENT_CHANNELS, 4, 2)]
    theirs = Flux2Pipeline._prepare_image_ids(images)[0].numpy()
    ours = np.concatenate(
        [
            transformer.image_ids(2, 3, time=transformer.reference_time(0)),
            transformer.image_ids(4, 2, time=transformer.reference_time(1)),
        ]
    )
    np.testing.assert_array_equal(ours, theirs)
    theirs = Flux2Pipeline._prepare_text_ids(torch.zeros(1, 7, 8))[0].numpy()
    np.testing.assert_array_equal(transformer.text_ids(7), theirs)


def test_rope_tables_match_flux2_pos_embed_at_full_size():
    """The released axes (32 x 4, theta 2000) over a 1024-pixel image's ids (64x64 tokens),
    a reference image's and 512 text tokens': our float32 angles against diffusers' float64
    ones; the text index (up to 511) gives the largest angles."""
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    axes = (32, 32, 32, 32)
    ids = np.concatenate(
        [
            transformer.text_ids(512),
            transformer.image_ids(64, 64),
            transformer.image_ids(64, 64, time=transformer.reference_time(0)),
        ]
    )
    their_cos, their_sin = Flux2PosEmbed(2000, list(axes))(torch.from_numpy(ids))
    cos, sin = transformer.rope_tables(jnp.asarray(ids), axes, 2000)
    # diffusers repeats each pair's angle for its two channels.
    for ours, theirs in ((cos, their_cos.numpy()), (sin, their_sin.numpy())):
        np.testing.assert_array_equal(theirs[:, ::2], theirs[:, 1::2])
        # measured: 2.7e-5 (3.0e-6 over the image ids alone)
        np.testing.assert_allclose(np.asarray(ours), theirs[:, ::2], rtol=0, atol=5e-5)


def test_guidance_goes_with_guidance_embeds(dev, klein):
    for reference, guidance in ((dev, None), (klein, jnp.ones(1))):
        module = reference.module()
        params = jax.eval_shape(module.init_weights, jax.random.key(0))
        arguments = (*module.example_inputs()[:-1], guidance)
        with pytest.raises(ValueError, match="guidance"):
            jax.eval_shape(lambda p, a=arguments, m=module: m.apply({"params": p}, *a), params)


@pytest.mark.parametrize("name", sorted(transformer.RELEASED_CONFIGS))
def test_released_configs_have_diffusers_parameter_count(name):
    config = transformer.builtin_config(name)
    with torch.device("meta"):
        reference = diffusers.Flux2Transformer2DModel.from_config(config)
    theirs = sum(p.numel() for p in reference.parameters())
    module = transformer.transformer_module(config, dtype=jnp.bfloat16, scan_layers=True)
    shapes = jax.eval_shape(module.init_weights, jax.random.key(0))
    ours = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    assert ours == theirs, (ours, theirs)
    assert module.guidance_embeds == (name == "flux2-dev")


def test_config_metadata_is_ignored_and_lists_become_tuples():
    config = {
        **DEV_CONFIG,
        "axes_dims_rope": [4, 4, 4, 4],
        "_class_name": "Flux2Transformer2DModel",
        "_diffusers_version": "0.36.0.dev0",
    }
    assert transformer.transformer_module(config).axes_dims_rope == (4, 4, 4, 4)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"axes_dims_rope": (4, 4, 4, 6)}, "add up to 18"),
        ({"axes_dims_rope": (4, 6, 6)}, "4 positive even sizes"),
        ({"axes_dims_rope": (3, 5, 4, 4)}, r"axes_dims_rope \[3, 5, 4, 4\]"),
        ({"timestep_guidance_channels": 33}, "timestep_guidance_channels 33"),
        ({"pooled_projection_dim": 768}, "pooled_projection_dim"),
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


def test_unknown_release_names_the_known_ones():
    with pytest.raises(ValueError, match="flux2-klein-4b"):
        transformer.builtin_config("flux2-pro")
