"""Image preprocessing for CLIP-family reward models, in JAX.

The official scorers (HPS-v2.1, PickScore, the LAION aesthetic predictor, CLIP score) are
handed 8-bit images and resize them with PIL's bicubic filter, which works in 22-bit fixed
point with an 8-bit intermediate image. Small resampling differences move the scores, so
this module redoes that arithmetic exactly, in int32 inside XLA, so that a jitted reward on
the accelerator sees the same pixels as the reference scorer.

Layouts (``LAYOUTS``), each from quantized images to ``[B, S, S, 3]``:

* ``resize_crop_torchvision``: torchvision ``Resize(S, BICUBIC)`` + ``CenterCrop(S)`` on a PIL
  image (OpenAI CLIP's ``clip.load`` preprocess, used by the LAION aesthetic predictor).
  Crop offset ``int(round(d / 2))``, Python's round half to even.
* ``resize_crop_hf``: transformers' PIL ``CLIPImageProcessor`` (PickScore, torchmetrics
  CLIPScore; ``CLIPImageProcessorPil`` in transformers 5, whose ``CLIPImageProcessor``
  resizes with torchvision instead). Same resized size as torchvision, but crop offset
  ``d // 2``: the two differ by one pixel when the cropped-off amount ``d`` is 3 mod 4.
* ``resize_pad``: longest side to S with ``round(side * S / longest)``, PIL bicubic, zero padding
  with ``pad // 2`` before (HPSv2's ``ResizeMaxSize(S, fill=0)`` on a PIL image; open_clip's
  ``image_transform(..., resize_mode="longest")``).
* ``resize_pad_hpsv2``: what the hpsv2 package's ``preprocess_val`` runs: ``ToTensor`` comes
  first, so ``ResizeMaxSize`` resizes a float tensor with torchvision's antialiased bicubic
  (the default since torchvision 0.17; same filter as PIL, in float32, no 8-bit rounding),
  then pads with 0. It differs from ``resize_pad`` by up to about 2 levels.

Where the longest side already equals S, hpsv2 neither resizes nor pads (a non-square result);
both pad layouts pad, as open_clip does.

Measured in tests/parity/test_reward_preprocess.py: the resize equals ``PIL.Image.resize(BICUBIC)``
(max abs difference 0 levels); the 8-bit layouts equal torchvision, transformers 4.57 and
open_clip 3.3 before normalization and match them to 5e-7 after; ``resize_pad_hpsv2`` matches
torchvision's tensor path to 3e-6.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

LAYOUTS = ("resize_crop_torchvision", "resize_crop_hf", "resize_pad", "resize_pad_hpsv2")

PRECISION_BITS = 22  # PIL's fixed point for 8-bit images: 32 - 8 - 2
_BICUBIC_A = -0.5  # PIL's (and torch's antialiased) cubic
_BICUBIC_SUPPORT = 2.0


def quantize(images: jax.Array) -> jax.Array:
    """Floats in [0, 1] -> uint8 levels, ``round(clip(x) * 255)`` half to even, as diffusers
    pipelines do before handing PIL images to a scorer."""
    images = images.astype(jnp.promote_types(images.dtype, jnp.float32))  # bf16 can't hold x*255
    return jnp.round(jnp.clip(images, 0.0, 1.0) * 255.0).astype(jnp.uint8)


def _bicubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = _BICUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=64)
def bicubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """Normalized antialiased bicubic weights ``[out, in]`` float64, computed as PIL's
    ``precompute_coeffs`` does (window, filter argument and sequential sum in float64)."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"Sizes must be positive, got {in_size} -> {out_size}.")
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _BICUBIC_SUPPORT * filterscale
    inv = 1.0 / filterscale
    weights = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = _bicubic((np.arange(lo, hi) - center + 0.5) * inv)
        total = np.cumsum(w)[-1]  # sequential, like the C loop
        if total != 0.0:
            w = w / total
        weights[i, lo:hi] = w
    weights.setflags(write=False)
    return weights


@functools.lru_cache(maxsize=64)
def pil_bicubic_coefficients(in_size: int, out_size: int) -> np.ndarray:
    """PIL's 8-bit bicubic coefficients ``[out, in]`` int32 in 22-bit fixed point."""
    weights = bicubic_weights(in_size, out_size)
    scaled = weights * float(1 << PRECISION_BITS)
    fixed = np.trunc(np.where(weights < 0.0, scaled - 0.5, scaled + 0.5)).astype(np.int64)
    # Every partial sum of an output pixel stays within 2**21 + 255 * sum|k|: check int32.
    worst = (1 << (PRECISION_BITS - 1)) + 255 * int(np.abs(fixed).sum(axis=1).max())
    if worst >= 2**31:
        raise ValueError(f"Resize {in_size} -> {out_size} would overflow int32 accumulation.")
    coefficients = fixed.astype(np.int32)
    coefficients.setflags(write=False)
    return coefficients


def _resize_axis_uint8(images: jax.Array, axis: int, out_size: int) -> jax.Array:
    in_size = images.shape[axis]
    if in_size == out_size:
        return images
    k = jnp.asarray(pil_bicubic_coefficients(in_size, out_size))
    spec = "bhwc,ow->bhoc" if axis == 2 else "bhwc,oh->bowc"
    acc = jnp.einsum(spec, images.astype(jnp.int32), k, preferred_element_type=jnp.int32)
    acc = jnp.right_shift(acc + (1 << (PRECISION_BITS - 1)), PRECISION_BITS)
    return jnp.clip(acc, 0, 255).astype(jnp.uint8)


def resize_bicubic_uint8(images: jax.Array, height: int, width: int) -> jax.Array:
    """Bit-exact ``PIL.Image.resize((width, height), BICUBIC)`` of uint8 ``[B, H, W, C]``:
    horizontal pass first, clamped 8-bit intermediate, a pass skipped if its size is kept."""
    images = _resize_axis_uint8(images, 2, width)
    return _resize_axis_uint8(images, 1, height)


@functools.lru_cache(maxsize=64)
def torch_antialias_weights(in_size: int, out_size: int) -> np.ndarray:
    """torch's CPU antialiased bicubic weights ``[out, in]`` float32. Same filter and window
    as PIL, but torch keeps the sample centre and the weights in float32, which moves them by
    up to ~1e-5: emulated here so the float path matches torch to float32 rounding."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"Sizes must be positive, got {in_size} -> {out_size}.")
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    support = f32(_BICUBIC_SUPPORT) * scale if scale >= 1.0 else f32(_BICUBIC_SUPPORT)
    inv = np.float64(f32(1.0) / scale if scale >= 1.0 else f32(1.0))
    weights = np.zeros((out_size, in_size), f32)
    for i in range(out_size):
        center = f32(np.float64(scale) * (i + 0.5))
        lo = max(int(np.float64(center - support) + 0.5), 0)
        hi = min(int(np.float64(center + support) + 0.5), in_size)
        offsets = (np.arange(lo, hi).astype(f32) - center).astype(f32)
        w = _bicubic((offsets.astype(np.float64) + 0.5) * inv).astype(f32)
        total = np.cumsum(w, dtype=f32)[-1]
        if total != 0.0:
            w = w / total
        weights[i, lo:hi] = w
    weights.setflags(write=False)
    return weights


def resize_bicubic_float(images: jax.Array, height: int, width: int) -> jax.Array:
    """torchvision's tensor ``resize(..., BICUBIC, antialias=True)`` of float ``[B, H, W, C]``:
    the same filter as PIL, in float32, neither rounded nor clamped."""
    images = images.astype(jnp.float32)
    for axis, out_size, spec in ((2, width, "bhwc,ow->bhoc"), (1, height, "bhwc,oh->bowc")):
        if images.shape[axis] != out_size:
            w = jnp.asarray(torch_antialias_weights(images.shape[axis], out_size))
            images = jnp.einsum(spec, images, w, precision=jax.lax.Precision.HIGHEST)
    return images


def shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) with the short side at ``size``, the long side ``int(size * long /
    short)``: torchvision's ``Resize(int)`` and transformers' ``shortest_edge`` agree."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (new_long, size) if width <= height else (size, new_long)


def longest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) with the long side at ``size``, each side ``round(side * scale)``
    (round half to even), as HPSv2's ``ResizeMaxSize`` computes it."""
    scale = size / float(max(height, width))
    if scale == 1.0:
        return height, width
    return round(height * scale), round(width * scale)


def _center_crop(images: jax.Array, size: int, offset: Callable[[int], int]) -> jax.Array:
    top = offset(images.shape[1] - size)
    left = offset(images.shape[2] - size)
    return images[:, top : top + size, left : left + size, :]


def _pad_to_square(images: jax.Array, size: int) -> jax.Array:
    pad_h = size - images.shape[1]
    pad_w = size - images.shape[2]
    widths = ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    return jnp.pad(images, widths)


def resize_crop_torchvision(images: jax.Array, size: int) -> jax.Array:
    """torchvision ``Resize(size, BICUBIC)`` + ``CenterCrop(size)`` on uint8 ``[B, H, W, 3]``."""
    images = resize_bicubic_uint8(images, *shortest_edge_size(*images.shape[1:3], size))
    return _center_crop(images, size, lambda d: int(round(d / 2.0)))


def resize_crop_hf(images: jax.Array, size: int) -> jax.Array:
    """transformers' PIL ``CLIPImageProcessor`` (``shortest_edge`` and crop ``size``) resize
    and crop on uint8 ``[B, H, W, 3]``; the crop offset is floored, unlike torchvision's."""
    images = resize_bicubic_uint8(images, *shortest_edge_size(*images.shape[1:3], size))
    return _center_crop(images, size, lambda d: d // 2)


def resize_pad(images: jax.Array, size: int) -> jax.Array:
    """Longest side to ``size`` with PIL bicubic, then zero padding to a square, on uint8."""
    images = resize_bicubic_uint8(images, *longest_edge_size(*images.shape[1:3], size))
    return _pad_to_square(images, size)


def resize_pad_hpsv2(images: jax.Array, size: int) -> jax.Array:
    """The hpsv2 package's float path: ``images`` are ``uint8 / 255`` floats, resized with the
    antialiased bicubic in float, then padded with 0 (before normalization)."""
    images = resize_bicubic_float(images, *longest_edge_size(*images.shape[1:3], size))
    return _pad_to_square(images, size)


def normalize(
    images: jax.Array,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> jax.Array:
    """uint8 levels -> float32 ``(x / 255 - mean) / std``, as ToTensor + Normalize do."""
    return _standardize(images.astype(jnp.float32) / 255.0, mean, std)


def _standardize(x: jax.Array, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    mean = jnp.asarray(mean, jnp.float32)
    std = jnp.asarray(std, jnp.float32)
    return (x - mean) / std


_UINT8_LAYOUTS = {
    "resize_crop_torchvision": resize_crop_torchvision,
    "resize_crop_hf": resize_crop_hf,
    "resize_pad": resize_pad,
}


def make_preprocess(
    layout: str,
    size: int,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> Callable[[jax.Array], jax.Array]:
    """A jittable ``images [B, H, W, 1 or 3] in [0, 1] -> pixel values [B, size, size, 3]``
    float32 (NHWC, what Flax CLIP takes), reproducing one scorer's preprocessing."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}.")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}.")
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"mean and std must have 3 values each, got {mean!r} and {std!r}.")
    mean = tuple(float(m) for m in mean)
    std = tuple(float(s) for s in std)

    def preprocess(images: jax.Array) -> jax.Array:
        shape = tuple(images.shape)
        if len(shape) != 4 or shape[-1] not in (1, 3) or min(shape[1:3]) < 1:
            raise ValueError(f"images must be [B, H, W, 1 or 3] with H, W >= 1, got {shape}.")
        chex.assert_type(images, float)
        levels = quantize(images)
        if shape[-1] == 1:
            levels = jnp.repeat(levels, 3, axis=-1)
        if layout == "resize_pad_hpsv2":
            resized = resize_pad_hpsv2(levels.astype(jnp.float32) / 255.0, size)
            pixels = _standardize(resized, mean, std)
        else:
            pixels = normalize(_UINT8_LAYOUTS[layout](levels, size), mean, std)
        chex.assert_shape(pixels, (shape[0], size, size, 3))
        chex.assert_type(pixels, jnp.float32)
        return pixels

    return preprocess


__all__ = [
    "LAYOUTS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PRECISION_BITS",
    "bicubic_weights",
    "longest_edge_size",
    "make_preprocess",
    "normalize",
    "pil_bicubic_coefficients",
    "quantize",
    "resize_bicubic_float",
    "resize_bicubic_uint8",
    "resize_crop_hf",
    "resize_crop_torchvision",
    "resize_pad",
    "resize_pad_hpsv2",
    "shortest_edge_size",
    "torch_antialias_weights",
]
