"""CLIP reward preprocessing against the libraries the official scorers use.

The JAX resize matches ``PIL.Image.resize(BICUBIC)`` exactly (max abs difference 0 levels, on
noise, smooth images and 0/255 stripes, down- and up-scaling). The resized and cropped or
padded 8-bit images match torchvision, transformers' ``CLIPImageProcessor`` and open_clip's
``resize_mode="longest"`` exactly, and the normalized pixels match them to 4.8e-7 (float32
rounding of ``(x / 255 - mean) / std``). The hpsv2 float path matches torchvision's
antialiased tensor resize + pad + Normalize to 2.3e-6 (two float32 passes).
"""

import importlib.util
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from tree_grpo_jax.rewards import preprocess as pp

MEAN, STD = pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD
NORMALIZED_TOL = 1e-5

# (H, W) -> (out H, out W); 300x200 and 1024x768 keep the aspect ratio as torchvision would.
RESIZE_CASES = [
    ((512, 512), (224, 224)),
    ((64, 64), (224, 224)),
    ((16, 16), (224, 224)),
    ((300, 200), (224, 149)),
    ((1024, 768), (298, 224)),
    ((224, 224), (224, 224)),
    ((200, 300), (91, 37)),
    ((5, 7), (1, 1)),
]

# Shapes for the layouts at S = 224. (207, 200) -> (231, 224) and (227, 224) leave 7 and 3
# rows to crop: torchvision's round-half-even offset is 4 and 2, transformers' floor 3 and 1.
LAYOUT_SHAPES = [(512, 512), (207, 200), (200, 207), (227, 224), (300, 200), (768, 1024), (64, 48)]


def _smooth_images(rng, n, h, w):
    """Natural-looking test images: Gaussian blobs and gradients plus mild noise, in [0, 1]."""
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    out = np.empty((n, h, w, 3), np.float64)
    for i in range(n):
        for c in range(3):
            gx, gy = rng.uniform(-0.5, 0.5, 2)
            img = 0.5 + gx * (xx - 0.5) + gy * (yy - 0.5)
            for _ in range(6):
                cy, cx = rng.uniform(0, 1, 2)
                r = rng.uniform(0.03, 0.3)
                img += rng.uniform(-0.6, 0.6) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / r**2)
            out[i, :, :, c] = img + rng.normal(0, 0.02, (h, w))
    return np.clip(out, 0, 1).astype(np.float32)


def _images(kind, seed, n, h, w):
    rng = np.random.default_rng(seed)
    if kind == "noise":
        return rng.uniform(size=(n, h, w, 3)).astype(np.float32)
    if kind == "stripes":  # 0/255 columns and rows: the most over- and undershoot to clamp
        stripes = ((np.arange(h)[:, None] // 1 + np.arange(w)[None, :] // 2) % 2).astype(np.float32)
        return np.broadcast_to(stripes[None, :, :, None], (n, h, w, 3)).copy()
    return _smooth_images(rng, n, h, w)


def _levels(images):
    return np.round(np.clip(images, 0, 1) * 255).astype(np.uint8)


def _chw_to_hwc(array):
    return np.asarray(array).transpose(1, 2, 0)


def test_quantize_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.2, 1.2, size=(4, 16, 16, 3)).astype(np.float32)
    # Exact halves in float32 (127.5, 0.5 * 255 / 255 ...) check round half to even.
    x[0, 0, :4, 0] = [0.5, 0.5 / 255, 1.5 / 255, 254.5 / 255]
    expected = np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)
    got = np.asarray(pp.quantize(jnp.asarray(x)))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)
    half = jnp.asarray(x, jnp.bfloat16)  # rounded in float32, not in bfloat16
    expected = np.round(np.clip(np.asarray(half, np.float32), 0, 1) * 255).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(pp.quantize(half)), expected)


@pytest.mark.parametrize("kind", ["noise", "smooth", "stripes"])
@pytest.mark.parametrize(("in_hw", "out_hw"), RESIZE_CASES)
def test_resize_is_bit_exact_to_pil(kind, in_hw, out_hw):
    levels = _levels(_images(kind, 1, 2, *in_hw))
    expected = np.stack(
        [np.asarray(Image.fromarray(im).resize(out_hw[::-1], Image.BICUBIC)) for im in levels]
    )
    got = np.asarray(jax.jit(pp.resize_bicubic_uint8, static_argnums=(1, 2))(levels, *out_hw))
    assert got.shape == expected.shape
    assert got.dtype == np.uint8
    assert np.abs(got.astype(int) - expected.astype(int)).max() == 0


def test_fixed_point_accumulation_fits_int32():
    # 2**21 + 255 * sum|k| bounds every partial sum of an output pixel, in any order.
    for in_size, out_size in [(4096, 224), (2048, 7), (512, 224), (16, 224), (3, 1000), (224, 1)]:
        k = pp.pil_bicubic_coefficients(in_size, out_size)
        assert k.dtype == np.int32 and k.shape == (out_size, in_size)
        k = k.astype(np.int64)
        assert 2**21 + 255 * np.abs(k).sum(axis=1).max() < 2**31


def _torchvision_reference(images, size):
    transforms = pytest.importorskip("torchvision.transforms")
    bicubic = transforms.InterpolationMode.BICUBIC
    geometry = transforms.Compose([transforms.Resize(size, bicubic), transforms.CenterCrop(size)])
    full = transforms.Compose([geometry, transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    pils = [Image.fromarray(im) for im in images]
    levels = np.stack([np.asarray(geometry(p)) for p in pils])
    return levels, np.stack([_chw_to_hwc(full(p)) for p in pils])


def _transformers_reference(images, size):
    from clip_fixtures import pil_image_processor

    CLIPImageProcessor = pil_image_processor()  # noqa: N806
    kwargs = dict(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    geometry = CLIPImageProcessor(do_rescale=False, do_normalize=False, **kwargs)
    full = CLIPImageProcessor(image_mean=list(MEAN), image_std=list(STD), **kwargs)
    images = list(images)
    levels = np.asarray(geometry(images=images, return_tensors="np")["pixel_values"])
    pixels = np.asarray(full(images=images, return_tensors="np")["pixel_values"])
    return levels.transpose(0, 2, 3, 1), pixels.transpose(0, 2, 3, 1)


def _open_clip_reference(images, size):
    open_clip = pytest.importorskip("open_clip")
    from open_clip.transform import CenterCropOrPad, ResizeKeepRatio

    full = open_clip.image_transform(
        size, is_train=False, mean=MEAN, std=STD, resize_mode="longest", fill_color=0
    )
    resize, pad = ResizeKeepRatio(size, longest=1), CenterCropOrPad(size, fill=0)
    pils = [Image.fromarray(im) for im in images]
    levels = np.stack([np.asarray(pad(resize(p))) for p in pils])
    return levels, np.stack([_chw_to_hwc(full(p)) for p in pils])


REFERENCES = {
    "resize_crop_torchvision": (_torchvision_reference, pp.resize_crop_torchvision),
    "resize_crop_hf": (_transformers_reference, pp.resize_crop_hf),
    "resize_pad": (_open_clip_reference, pp.resize_pad),
}


@pytest.mark.parametrize("hw", LAYOUT_SHAPES)
@pytest.mark.parametrize("layout", list(REFERENCES))
def test_layout_matches_official_path(layout, hw):
    size = 224
    images = np.concatenate([_images("noise", 2, 1, *hw), _images("smooth", 2, 1, *hw)])
    reference, layout_fn = REFERENCES[layout]
    expected_levels, expected = reference(_levels(images), size)

    levels = np.asarray(jax.jit(layout_fn, static_argnums=1)(_levels(images), size))
    np.testing.assert_array_equal(levels, expected_levels)

    got = np.asarray(jax.jit(pp.make_preprocess(layout, size))(images))
    assert got.shape == expected.shape == (2, size, size, 3)
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() <= NORMALIZED_TOL


def test_torchvision_and_transformers_crop_differently():
    # Both resize 207x200 to 231x224; torchvision crops from row 4, transformers from row 3.
    levels = _levels(_images("noise", 3, 1, 207, 200))
    tv_levels, _ = _torchvision_reference(levels, 224)
    hf_levels, _ = _transformers_reference(levels, 224)
    assert np.abs(tv_levels.astype(int) - hf_levels.astype(int)).max() > 0
    np.testing.assert_array_equal(tv_levels[:, :-1], hf_levels[:, 1:])


def _hpsv2_float_reference(images, size):
    """hpsv2's ``preprocess_val``: ToTensor, then ResizeMaxSize on the float tensor, then Normalize,
    rebuilt from torchvision primitives."""
    transforms = pytest.importorskip("torchvision.transforms")
    functional = transforms.functional
    outputs = []
    for im in images:
        tensor = transforms.ToTensor()(Image.fromarray(im))
        h, w = tensor.shape[1:]
        scale = size / float(max(h, w))
        new_h, new_w = round(h * scale), round(w * scale)
        tensor = functional.resize(tensor, [new_h, new_w], transforms.InterpolationMode.BICUBIC)
        pad_h, pad_w = size - new_h, size - new_w
        padding = [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2]
        tensor = functional.pad(tensor, padding, fill=0)
        outputs.append(_chw_to_hwc(transforms.Normalize(MEAN, STD)(tensor)))
    return np.stack(outputs)


@pytest.mark.parametrize("hw", [(512, 512), (300, 200), (200, 207), (64, 48), (1024, 768)])
def test_hpsv2_float_path_matches_torchvision_tensor_resize(hw):
    images = _images("smooth", 4, 2, *hw)
    expected = _hpsv2_float_reference(_levels(images), 224)
    got = np.asarray(jax.jit(pp.make_preprocess("resize_pad_hpsv2", 224))(images))
    assert np.abs(got - expected).max() <= NORMALIZED_TOL


def _hpsv2_transform_module(monkeypatch):
    """hpsv2's own ``open_clip/transform.py``, loaded without running the package's
    ``__init__`` (which needs a tokenizer vocabulary the PyPI wheel does not ship)."""
    spec = importlib.util.find_spec("hpsv2")
    if spec is None or spec.origin is None:
        pytest.skip("hpsv2 is not installed")
    folder = Path(spec.origin).parent / "src" / "open_clip"
    package = types.ModuleType("_hpsv2_open_clip")
    package.__path__ = [str(folder)]
    monkeypatch.setitem(sys.modules, "_hpsv2_open_clip", package)
    return importlib.import_module("_hpsv2_open_clip.transform")


def test_hpsv2_package_preprocess_when_installed(monkeypatch):
    pytest.importorskip("torchvision")
    hps_transform = _hpsv2_transform_module(monkeypatch)
    preprocess_val = hps_transform.image_transform(
        224, is_train=False, mean=MEAN, std=STD, resize_longest_max=True
    )
    images = _images("smooth", 5, 2, 300, 200)
    levels = _levels(images)
    expected = np.stack([_chw_to_hwc(preprocess_val(Image.fromarray(im))) for im in levels])
    got = np.asarray(jax.jit(pp.make_preprocess("resize_pad_hpsv2", 224))(images))
    assert np.abs(got - expected).max() <= NORMALIZED_TOL
    # Its ResizeMaxSize on a PIL image (before ToTensor) is the 8-bit resize_pad layout.
    resize_max = hps_transform.ResizeMaxSize(224, fill=0)
    expected_levels = np.stack([np.asarray(resize_max(Image.fromarray(im))) for im in levels])
    np.testing.assert_array_equal(
        np.asarray(pp.resize_pad(jnp.asarray(levels), 224)), expected_levels
    )


def test_batch_under_jit_and_one_channel():
    transforms = pytest.importorskip("torchvision.transforms")
    official = transforms.Compose(
        [
            transforms.Resize(224, transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    grey = _images("smooth", 6, 3, 96, 80)[..., :1]
    fn = jax.jit(pp.make_preprocess("resize_crop_torchvision", 224))
    got = np.asarray(fn(jnp.asarray(grey)))
    assert got.shape == (3, 224, 224, 3)
    for i, im in enumerate(_levels(grey)):
        expected = _chw_to_hwc(official(Image.fromarray(im[..., 0]).convert("RGB")))
        assert np.abs(got[i] - expected).max() <= NORMALIZED_TOL
    # Each batch element is processed on its own.
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(grey[1:2])))[0], got[1])


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("bilinear_squash", (1, 32, 32, 3)),
        ("resize_pad", (32, 32, 3)),
        ("resize_pad", (1, 32, 32, 4)),
        ("resize_crop_hf", (1, 1, 32, 32, 3)),
    ],
)
def test_bad_inputs_raise_one_value_error(layout, shape):
    with pytest.raises(ValueError):
        fn = pp.make_preprocess(layout, 224)
        jax.jit(fn)(jnp.zeros(shape, jnp.float32))


def test_bad_size_and_dtype():
    with pytest.raises(ValueError):
        pp.make_preprocess("resize_pad", 0)
    with pytest.raises(AssertionError):
        pp.make_preprocess("resize_pad", 8)(jnp.zeros((1, 4, 4, 3), jnp.uint8))
