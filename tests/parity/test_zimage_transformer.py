"""The Flax Z-Image transformer against diffusers' PyTorch `ZImageTransformer2DModel` (tiny,
random), its state dict converted by the project's generic converter: a padded caption batch
against the pipeline's list of per-prompt embeddings, blocks scanned or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tree_grpo_jax.models.zimage import transformer  # noqa: E402
from tree_grpo_jax.weights import stacking  # noqa: E402

CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=48,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=24,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(8, 8, 8),
    axes_lens=(128, 16, 16),
)
# (latent height, width): square, and non-square with an odd number of patch columns; 16
# and 15 patches, so the image is padded to 32 tokens with the pad token either way.
LATENT_SIZES = ((8, 8), (6, 10))
SIGMAS = (0.9, 0.25)
# Valid caption tokens per row: padded by the model to 32 and 64, the batch padded to 40.
CAPTION_LENGTHS = (5, 37)
CAPTION_SLOTS = 40
WEIGHT_NOISE = 0.02
# Element-wise: 1e-5 relative, and an absolute floor of 5e-6 of the output's scale (max
# |PyTorch output|, about 2.4) for the elements near zero. Measured: largest difference
# 1.9e-6 of the scale (4.1e-6), 2.1e-5 relative on elements over 0.1; 3/4 of it from the
# timestep sinusoid, whose frequencies differ from PyTorch's float32 `exp` by one ulp at 3
# of 128 (times 1000 t in the angle). bfloat16: 1.1%.
FLOAT32_RTOL = 1e-5
FLOAT32_ATOL = 5e-6
BFLOAT16_TOLERANCE = 3e-2


class Reference:
    """A tiny random PyTorch model, and our module (blocks scanned or not, in float32 or
    bfloat16) on its converted state dict, jitted once each."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.torch_model = diffusers.ZImageTransformer2DModel(**CONFIG).eval()
        with torch.no_grad():
            # Noise on every weight, so that ones and zeros (norm scales, biases, pad tokens)
            # are not special.
            for param in self.torch_model.parameters():
                param.add_(WEIGHT_NOISE * torch.randn_like(param))
        self.state = {k: v.numpy() for k, v in self.torch_model.state_dict().items()}
        self._compiled = {}

    def module(self, scan_layers: bool, dtype=jnp.float32):
        key = (scan_layers, jnp.dtype(dtype))
        if key not in self._compiled:
            module = transformer.transformer_module(
                dict(self.torch_model.config), dtype=dtype, scan_layers=scan_layers
            )
            params = transformer.params_from_state_dict(module, self.state)
            self._compiled[key] = (module, params, jax.jit(module.apply))
        return self._compiled[key]

    def flax_output(self, inputs, scan_layers: bool = False, dtype=jnp.float32) -> np.ndarray:
        _, params, apply = self.module(scan_layers, dtype)
        out = apply({"params": params}, **{k: jnp.asarray(v) for k, v in inputs.items()})
        return np.asarray(out, np.float32)


@pytest.fixture(scope="module")
def reference():
    return Reference()


def assert_matches(ours, theirs):
    atol = FLOAT32_ATOL * np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, rtol=FLOAT32_RTOL, atol=atol)


def make_inputs(height: int, width: int, seed: int = 0) -> dict:
    """Latents, the model's time, and a padded caption batch whose padding holds garbage."""
    rng = np.random.default_rng(seed)
    batch = len(SIGMAS)
    features = rng.standard_normal((batch, CAPTION_SLOTS, CONFIG["cap_feat_dim"]))
    mask = np.arange(CAPTION_SLOTS)[None] < np.asarray(CAPTION_LENGTHS)[:, None]
    return dict(
        latents=rng.standard_normal((batch, CONFIG["in_channels"], height, width)).astype(
            np.float32
        ),
        timestep=np.asarray(transformer.timestep_from_sigma(np.asarray(SIGMAS))),
        caption_features=features.astype(np.float32),
        caption_mask=mask,
    )


def torch_output(model, inputs, lengths=CAPTION_LENGTHS) -> np.ndarray:
    """The PyTorch model as ZImagePipeline calls it: one-frame latents and the list of each
    prompt's valid embeddings."""
    latents = torch.from_numpy(inputs["latents"]).unsqueeze(2)
    captions = [torch.from_numpy(f[:n]) for f, n in zip(inputs["caption_features"], lengths)]
    timestep = torch.from_numpy(inputs["timestep"].copy())
    with torch.no_grad():
        out = model(list(latents.unbind(0)), timestep, captions, return_dict=False)[0]
    return torch.stack(out).squeeze(2).numpy()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_matches_pytorch_in_float32(reference, scan_layers):
    """Both latent sizes with the blocks one by one; the non-square one scanned (a compile
    less)."""
    _, params, _ = reference.module(scan_layers)
    assert stacking.is_stacked(params) == scan_layers
    outputs = []
    for height, width in LATENT_SIZES[1:] if scan_layers else LATENT_SIZES:
        inputs = make_inputs(height, width)
        theirs = torch_output(reference.torch_model, inputs)
        ours = reference.flax_output(inputs, scan_layers)
        assert ours.shape == theirs.shape == (2, CONFIG["in_channels"], height, width)
        assert_matches(ours, theirs)
        # The comparison can fail: the rows (time, caption) give other outputs.
        assert np.abs(theirs[0] - theirs[1]).max() > 0.1 * np.abs(theirs).max()
        outputs.append(theirs)
    if not scan_layers:  # and so do the sizes
        corner = (..., slice(0, 6), slice(0, 8))
        assert np.abs(outputs[0][corner] - outputs[1][corner]).max() > 1e-2


def test_caption_padding_matters_and_is_matched(reference):
    """A caption cut from 37 to 33 tokens keeps its 64-token padded length but not its
    output; a mask may also leave out places in the middle of a row."""
    inputs = make_inputs(6, 10, seed=1)
    full = torch_output(reference.torch_model, inputs)
    cut = torch_output(reference.torch_model, inputs, lengths=(5, 33))
    assert np.abs(full[1] - cut[1]).max() > 1e-2 * np.abs(full).max()
    np.testing.assert_array_equal(full[0], cut[0])
    # Row 1's tokens 33..36 moved to the end of its padded row, behind three masked places.
    features, mask = inputs["caption_features"].copy(), inputs["caption_mask"].copy()
    features[1, 36:40] = inputs["caption_features"][1, 33:37]
    mask[1, 33:36], mask[1, 36:40] = False, True
    moved = dict(inputs, caption_features=features, caption_mask=mask)
    assert_matches(reference.flax_output(moved, scan_layers=True), full)


def test_bfloat16_compute_and_conversion_round_trip(reference):
    exported = transformer.state_dict_from_params(reference.module(True)[1])
    assert sorted(exported) == sorted(reference.state)
    for key, value in reference.state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    inputs = make_inputs(*LATENT_SIZES[1])
    full = reference.flax_output(inputs, scan_layers=True)
    half = reference.flax_output(inputs, scan_layers=True, dtype=jnp.bfloat16)
    assert np.isfinite(half).all()
    assert np.abs(half - full).max() < BFLOAT16_TOLERANCE * np.abs(full).max()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"siglip_feat_dim": 8}, "siglip_feat_dim"),
        ({"all_patch_size": (2, 4), "all_f_patch_size": (1, 1)}, "one patch size"),
        ({"axes_dims": (8, 8, 10)}, "add up to 26"),
        ({"axes_dims": (8, 16)}, "3 positive even sizes"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, words):
    with pytest.raises(ValueError, match=words):
        transformer.transformer_module({**CONFIG, **change})
