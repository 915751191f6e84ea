"""The embedded tiny text-to-image model: Stable Diffusion's parts at 8x8 pixels.

A word-level tokenizer, a two-layer CLIP text encoder (transformers' `FlaxCLIPTextModel`), a
conditional UNet with cross-attention (diffusers' `FlaxUNet2DConditionModel`) on 8x8x1 pixel
space and no VAE: `decode` maps [-1, 1] to [0, 1]. It is trained on scikit-learn's bundled
`load_digits` by `python -m tree_grpo_jax.models.train_tiny`, in two twins: `ddim` (epsilon
prediction on SD's scaled_linear schedule) and `flow` (rectified flow, velocity prediction).

The shipped weights live in `tree_grpo_jax/assets/` as Flax msgpack files and load through
the same code that loads any saved checkpoint of this model.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax import prompts
from tree_grpo_jax.models import text
from tree_grpo_jax.models.base import TextToImageModel
from tree_grpo_jax.models.quiet import quiet_flax_deprecation_notices

ASSETS_DIR = pathlib.Path(__file__).resolve().parent.parent / "assets"
KINDS = ("ddim", "flow")
SAMPLE_SHAPE = (1, 8, 8)  # channels first, as the denoiser sees it
FORMAT_VERSION = 1

UNET_CONFIG = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),  # GroupNorm uses 32 groups: multiples of 32
    layers_per_block=1,
    attention_head_dim=4,  # diffusers' Flax UNet reads this as the number of heads
    cross_attention_dim=32,
)
TEXT_CONFIG = dict(
    vocab_size=len(text.VOCAB),
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=text.MAX_LENGTH,
    projection_dim=32,
    pad_token_id=text.PAD_ID,
    bos_token_id=text.BOS_ID,
    eos_token_id=text.EOS_ID,
)

# ---------------------------------------------------------------------------------------------
# Prompts.

DIGIT_PROMPTS = prompts.DIGITS
STYLED_PROMPTS = tuple(
    f"a {style} handwritten digit {word}" for style in text.STYLE_WORDS for word in text.DIGIT_WORDS
)


def digit_prompt(digit: int, style: str | None = None) -> str:
    """`digit_prompt(7, "thick") == "a thick handwritten digit seven"`."""
    if style is None:
        return DIGIT_PROMPTS[digit]
    if style not in text.STYLE_WORDS:
        raise ValueError(f"style must be one of {text.STYLE_WORDS} or None, got {style!r}.")
    return f"a {style} handwritten digit {text.DIGIT_WORDS[digit]}"


def prompt_digit(prompt: str) -> int:
    """The digit a prompt asks for (the last digit word in it)."""
    found = [text.DIGIT_WORDS.index(w) for w in prompt.lower().split() if w in text.DIGIT_WORDS]
    if not found:
        raise ValueError(f"prompt {prompt!r} names no digit; expected one of {text.DIGIT_WORDS}.")
    return found[-1]


# ---------------------------------------------------------------------------------------------
# Data: scikit-learn's bundled 8x8 digits, one fixed split.

TEST_FRACTION = 0.3
SPLIT_SEED = 0


@functools.cache
def _digit_splits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    return {"train": (x_train, y_train), "test": (x_test, y_test)}


def digits_dataset(split: str) -> tuple[np.ndarray, np.ndarray]:
    """`(images [N, 8, 8, 1] float32 in [0, 1], labels [N] int32)` of the fixed 70/30 split."""
    splits = _digit_splits()
    if split not in splits:
        raise ValueError(f"split must be one of {tuple(splits)}, got {split!r}.")
    images, labels = splits[split]
    return images.copy(), labels.copy()


# ---------------------------------------------------------------------------------------------
# Networks.


@functools.cache
def make_unet(dtype=jnp.float32):
    from diffusers import FlaxUNet2DConditionModel

    quiet_flax_deprecation_notices()
    return FlaxUNet2DConditionModel(dtype=dtype, **UNET_CONFIG)


@functools.cache
def make_text_encoder(dtype=jnp.float32):
    from transformers import CLIPTextConfig, FlaxCLIPTextModel

    quiet_flax_deprecation_notices()
    return FlaxCLIPTextModel(CLIPTextConfig(**TEXT_CONFIG), dtype=dtype, _do_init=False)


def init_weights(key: jax.Array) -> dict:
    """Random weights `{"unet": ..., "text_encoder": ...}` (float32)."""
    unet_key, text_key = jax.random.split(key)
    hidden = TEXT_CONFIG["hidden_size"]
    unet_params = make_unet().init(
        unet_key,
        jnp.zeros((1, *SAMPLE_SHAPE)),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, text.MAX_LENGTH, hidden)),
    )["params"]
    text_params = make_text_encoder().init_weights(text_key, (1, text.MAX_LENGTH))
    return {"unet": unet_params, "text_encoder": text_params}


def random_weights(seed: int) -> dict:
    """Random weights drawn in numpy from the architecture's shapes: fan-in scaled normal
    kernels, small normal embeddings, unit scales, zero biases.

    The networks' own `init` traces and compiles the whole UNet forward (~15 s on two CPU
    cores); this gives a usable random model in well under a second.
    """
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(init_weights, jax.random.key(0))

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":
            fan_in = int(np.prod(leaf.shape[:-1]))
            return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(np.float32)
        if name == "embedding":
            return (0.02 * rng.standard_normal(leaf.shape)).astype(np.float32)
        fill = 1.0 if name == "scale" else 0.0
        return np.full(leaf.shape, fill, np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def encode_tokens(text_params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Token ids `[P, L]` -> the encoder's last hidden states `[P, L, D]`, as SD conditions."""
    encoder = make_text_encoder(jax.tree.leaves(text_params)[0].dtype)
    out = encoder(input_ids, attention_mask=attention_mask, params=text_params, train=False)
    return out.last_hidden_state


@functools.cache
def _denoise_fn(dtype):
    """One function object per dtype, so jitted callers that take it as static compile once."""
    unet = make_unet(dtype)

    def denoise(params, x, t, cond):
        chex.assert_rank(x, 4)
        chex.assert_shape(t, (x.shape[0],))
        chex.assert_rank(cond, 3)
        return unet.apply({"params": params}, x.astype(dtype), t, cond.astype(dtype)).sample

    return denoise


def decode(x: jax.Array) -> jax.Array:
    """Pixel space [-1, 1], channels first -> images `[B, 8, 8, 1]` in [0, 1]."""
    chex.assert_rank(x, 4)
    images = jnp.clip((x.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)
    return jnp.transpose(images, (0, 2, 3, 1))


_encode_tokens_jit = jax.jit(encode_tokens)  # shared: models of one dtype compile it once


def _prompt_encoder(text_params):
    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        ids, mask = text.tokenize(list(prompts))
        cond = _encode_tokens_jit(text_params, jnp.asarray(ids), jnp.asarray(mask))
        return cond.astype(jnp.float32)

    return encode_prompts


def model_from_weights(kind: str, weights: dict, dtype=jnp.float32, name: str | None = None):
    """Wraps `{"unet", "text_encoder"}` weights as a `TextToImageModel` of the given kind."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    cast = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)
    return TextToImageModel(
        name=name or f"tiny-{kind}",
        sample_shape=SAMPLE_SHAPE,
        params=cast(weights["unet"]),
        denoise=_denoise_fn(jnp.dtype(dtype)),
        encode_prompts=_prompt_encoder(cast(weights["text_encoder"])),
        decode=decode,
        schedule_kind=kind,
        prediction_type="epsilon",
        extras={"prompts": DIGIT_PROMPTS, "styled_prompts": STYLED_PROMPTS},
    )


def build_tiny(kind: str = "ddim", seed: int = 0, dtype=jnp.float32) -> TextToImageModel:
    """The tiny model with random weights (for tests of components that need any model)."""
    return model_from_weights(kind, random_weights(seed), dtype, name=f"tiny-{kind}-random")


# ---------------------------------------------------------------------------------------------
# Weights on disk.


def weights_path(kind: str) -> pathlib.Path:
    return ASSETS_DIR / f"tiny_{kind}.msgpack"


def save_weights(path, weights: dict, kind: str, storage_dtype=np.float16) -> None:
    """Writes `{"unet", "text_encoder"}` as Flax msgpack; float16 storage halves the file."""
    payload = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "weights": jax.tree.map(lambda a: np.asarray(a, storage_dtype), weights),
    }
    pathlib.Path(path).write_bytes(flax.serialization.msgpack_serialize(payload))


def load_weights(path, kind: str) -> dict:
    """Reads a file written by `save_weights` and checks it against this architecture."""
    payload = flax.serialization.msgpack_restore(pathlib.Path(path).read_bytes())
    if payload.get("format_version") != FORMAT_VERSION or payload.get("kind") != kind:
        raise ValueError(
            f"{path} holds format {payload.get('format_version')!r} of kind "
            f"{payload.get('kind')!r}; expected format {FORMAT_VERSION} of kind {kind!r}."
        )
    weights = payload["weights"]
    expected = jax.eval_shape(init_weights, jax.random.key(0))
    shapes = jax.tree.map(lambda a: a.shape, weights)
    if shapes != jax.tree.map(lambda a: a.shape, expected):
        raise ValueError(f"{path} does not match the tiny model's architecture.")
    return jax.tree.map(lambda a: np.asarray(a, np.float32), weights)


def load_tiny(kind: str = "ddim", dtype=jnp.float32, path=None) -> TextToImageModel:
    """The trained tiny model: `kind="ddim"` (epsilon, DDIM) or `"flow"` (velocity)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    path = pathlib.Path(path) if path is not None else weights_path(kind)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; run `python -m tree_grpo_jax.models.train_tiny --kind={kind}`."
        )
    return model_from_weights(kind, load_weights(path, kind), dtype)
