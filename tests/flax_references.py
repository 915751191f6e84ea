"""The recorded outputs of diffusers' and transformers' former Flax classes, and how to
rebuild their inputs.

diffusers 0.40 and transformers 5 dropped their Flax UNet, VAE and CLIP. While they had
them, `tests/fixtures/make_flax_references.py` ran them on the tiny cases below and saved
what they computed in `tests/fixtures/flax_references.npz`: each case's parameter tree
(names and shapes), the first values of the params that class drew from `INIT_SEED`, and
its outputs on params and inputs drawn here in numpy from fixed seeds. Only the outputs are
stored; `draw_params` and the `*_inputs` functions rebuild everything they were computed
from, so tests/parity/test_flax_references.py runs the package's own modules on the same
params and inputs, with no Flax class installed.

Nothing here imports diffusers' or transformers' Flax classes nor the package's models:
the recording script and the tests share only this plain data and numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "flax_references.npz"
INIT_SEED = 7  # the key each class drew its initial params from
INIT_VALUES = 8  # the first values of each initial param that the fixture keeps
DROPOUT_SEED = 3  # the key of the train-mode runs' dropout masks
DTYPES = ("float32", "bfloat16")

# ---------------------------------------------------------------------------------------------
# The cases. Configs are the upstream classes' keyword arguments (tuples as lists, as JSON
# keeps them); `ours` in the tests turns each into the package's module.

# The tiny demo model's UNet (tree_grpo_jax/models/tiny/networks.py's UNET_CONFIG: the test
# checks the two stay the same), float timesteps.
UNET_TINY = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    block_out_channels=[32, 64],
    layers_per_block=1,
    attention_head_dim=4,
    cross_attention_dim=32,
)
# The tiny SD1.5 folder's UNet (launch/tiny_architectures.py's SD15["unet"] but its
# norm_num_groups, which the Flax class did not take: 32 there too), int timesteps.
UNET_SD15 = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    block_out_channels=[32, 64],
    layers_per_block=1,
    cross_attention_dim=32,
    attention_head_dim=4,
)
# Every other option the Flax class had and the package keeps: heads per block, linear
# projections, cross-attention only, two transformer layers a block, the other timestep
# sinusoid, heads split in their own axis, and (in its train-mode run) dropout.
UNET_OPTIONS = dict(
    sample_size=8,
    in_channels=2,
    out_channels=3,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    block_out_channels=[32, 64],
    layers_per_block=1,
    attention_head_dim=[2, 4],  # the head counts (SD1.x's name; the Flax class took no other)
    cross_attention_dim=24,
    use_linear_projection=True,
    only_cross_attention=[True, False],
    transformer_layers_per_block=2,
    flip_sin_to_cos=False,
    freq_shift=1,
    split_head_dim=True,
    dropout=0.1,
)
# name: (config, timesteps, text length)
UNET_CASES = {
    "unet_tiny": (UNET_TINY, [1.0, 421.0, 981.0], 16),
    "unet_sd15": (UNET_SD15, [1, 421, 981], 16),
    "unet_options": (UNET_OPTIONS, [0.5, 17.25, 999.0], 6),
}

# The VAE: two levels, two resnets a block, a channel change each way. The Flax class always
# had quant convs; the 16-channel case also runs with them set to the identity, which is what
# the flow families' VAE (no quant convs) computes.
VAE_BASE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 16],
    layers_per_block=2,
    norm_num_groups=4,
    sample_size=8,
)
VAE_CASES = {
    "vae4": dict(VAE_BASE, latent_channels=4),
    "vae16": dict(VAE_BASE, latent_channels=16),
}
VAE_IMAGE = (2, 8, 8, 3)  # [B, H, W, C]
VAE_LATENT_SIZE = 4

# CLIP: tests/parity/test_clip_model.py's text tower and tests/clip_fixtures.py's vision
# tower, with both activations and both pooling rules (eos id 2: the legacy argmax rule).
CLIP_EOS = 5
CLIP_TEXT = dict(
    vocab_size=40,
    hidden_size=24,
    intermediate_size=29,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=12,
    projection_dim=16,
    bos_token_id=1,
    pad_token_id=CLIP_EOS,
)
CLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
CLIP_CASES = {
    "clip_quick_gelu_legacy_eos": ("quick_gelu", 2),
    "clip_gelu_first_eos": ("gelu", CLIP_EOS),
}
CLIP_PIXELS = (2, 32, 32, 3)  # [B, H, W, C]
CLIP_ATTENTION_DROPOUT = 0.3  # the text towers' train-mode run
# the trees of the three classes: the dual model, and the text towers (a part of its tree)
CLIP_TREES = ("model", "text", "text_with_projection")

# The runs beyond float32 and bfloat16, in float32: the UNet with chunked attention and in
# train mode (dropout), the 16-channel VAE with identity quant convs, a CLIP text tower in
# train mode (attention dropout).
EXTRA_RUNS = {
    "unet_options": ("memory_efficient", "train"),
    "vae16": ("identity_quant",),
    "clip_quick_gelu_legacy_eos": ("text_dropout",),
}


def clip_kwargs(act: str, eos: int) -> dict:
    """`transformers.CLIPConfig`'s keyword arguments for a CLIP case."""
    return dict(
        text_config=dict(CLIP_TEXT, hidden_act=act, eos_token_id=eos),
        vision_config=dict(CLIP_VISION, hidden_act=act),
        projection_dim=16,
        logit_scale_init_value=2.5,
    )


# ---------------------------------------------------------------------------------------------
# Params and inputs, drawn in numpy.


def _unit_noise(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform noise of unit variance: the generator's plain doubles, whose stream numpy
    keeps from version to version."""
    return ((2.0 * rng.random(shape) - 1.0) * np.sqrt(3.0)).astype(np.float32)


def _case_seed(case: str, offset: int) -> int:
    return offset + sum(ord(c) for c in case)


def param_seed(case: str) -> int:
    return _case_seed(case, 1000)


def input_seed(case: str) -> int:
    return _case_seed(case, 2000)


def draw_params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """float32 params for a tree given as {"a/b/kernel": shape}, in name order: kernels
    scaled by their fan-in, norm scales about 1, everything else about 0 (but never 0 or 1
    exactly, so that no weight is special)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        noise = _unit_noise(rng, shape)
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "kernel":
            params[name] = noise / np.float32(np.sqrt(np.prod(shape[:-1])))
        elif leaf == "scale":
            params[name] = 1 + np.float32(0.1) * noise
        elif leaf == "embedding":
            params[name] = np.float32(0.5) * noise
        else:
            params[name] = np.float32(0.1) * noise
    return params


def identity_quant_convs(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The VAE's 1x1 quant convs as the identity (kernel eye, bias 0)."""
    params = dict(params)
    for conv in ("quant_conv", "post_quant_conv"):
        kernel = params[f"{conv}/kernel"]
        params[f"{conv}/kernel"] = np.eye(kernel.shape[-1], dtype=np.float32).reshape(kernel.shape)
        params[f"{conv}/bias"] = np.zeros_like(params[f"{conv}/bias"])
    return params


def unet_inputs(case: str):
    """(sample [B, C, H, W], timesteps [B], text [B, L, D]) of a UNet case."""
    config, timesteps, length = UNET_CASES[case]
    rng = np.random.default_rng(input_seed(case))
    size = config["sample_size"]
    sample = _unit_noise(rng, (len(timesteps), config["in_channels"], size, size))
    text = _unit_noise(rng, (len(timesteps), length, config["cross_attention_dim"]))
    dtype = np.int32 if isinstance(timesteps[0], int) else np.float32
    return sample, np.asarray(timesteps, dtype), text


def vae_inputs(case: str):
    """(images [B, H, W, C] in [-1, 1], latents [B, h, w, latent_channels]) of a VAE case."""
    rng = np.random.default_rng(input_seed(case))
    images = (2.0 * rng.random(VAE_IMAGE) - 1.0).astype(np.float32)
    size = VAE_LATENT_SIZE
    latents = _unit_noise(rng, (VAE_IMAGE[0], size, size, VAE_CASES[case]["latent_channels"]))
    return images, latents


def clip_inputs(case: str):
    """(ids [3, L], attention mask [3, L], position ids [3, L], pixels [B, H, W, C]): prompts
    of three lengths padded with the eos id, a large id after each eos (so that the two
    pooling rules pick different tokens), and pixels drawn from the case's seed."""
    length = CLIP_TEXT["max_position_embeddings"]
    ids = np.full((3, length), CLIP_EOS, np.int32)
    mask = np.zeros_like(ids)
    for row, words in enumerate([[7, 9, 11], [30, 8], [12, 13, 14, 15, 16, 17, 18]]):
        ids[row, 0] = CLIP_TEXT["bos_token_id"]
        ids[row, 1 : len(words) + 1] = words
        ids[row, len(words) + 2] = CLIP_TEXT["vocab_size"] - 1
        mask[row, : len(words) + 2] = 1
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy()
    pixels = _unit_noise(np.random.default_rng(input_seed(case)), CLIP_PIXELS)
    return ids, mask, positions, pixels


def runs(case: str) -> tuple[str, ...]:
    """The runs recorded for a case: each dtype, then the case's extra ones."""
    return (*DTYPES, *EXTRA_RUNS.get(case, ()))


# ---------------------------------------------------------------------------------------------
# The file: one JSON manifest (versions, configs, trees, seeds, output names) and the outputs.


def output_key(case: str, run: str, name: str) -> str:
    return f"{case}.{run}.{name}"


def init_key(case: str, tree: str) -> str:
    return f"{case}.init.{tree}"


def load(path: Path = FIXTURE) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, arrays) of the fixture file."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    return json.loads(str(arrays.pop("manifest"))), arrays


def init_sample(flat: dict[str, np.ndarray]) -> np.ndarray:
    """[leaves, INIT_VALUES] the first values of each param in name order (NaN past a short
    param's end): enough to tell one initializer or one random stream from another."""
    sample = np.full((len(flat), INIT_VALUES), np.nan, np.float32)
    for row, name in enumerate(sorted(flat)):
        values = np.asarray(flat[name], np.float32).reshape(-1)[:INIT_VALUES]
        sample[row, : values.size] = values
    return sample
