"""ImageReward in JAX against the `image-reward` package's PyTorch model, on a tiny release.

The reference is the package's own `ImageReward` (tests/imagereward_fixtures.py builds it
small and random) and its `score(prompt, PIL image)`; the release file it saves goes through
the converter command and `load_reward`, so every comparison crosses the whole path:
torch state dict -> safetensors folder -> Flax parameters.

The package pins timm 0.6.13, which open_clip 3 (the test extra's) refuses, so it is not in
the test extra: install it beside it with `pip install --no-deps image-reward==1.5
fairscale==0.4.13` (the README's test line and CI do). Without it these tests skip;
tests/parity/test_imagereward_convert.py covers the converter and the loader without it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("timm")
pytest.importorskip("fairscale")
# The package's own __init__ imports more than its model code needs (openai's clip,
# datasets): the fixture loads only the model modules, so only its presence is asked here
# (absent: a skip, which fails a CI run as every missing test dependency does).
if importlib.util.find_spec("ImageReward") is None:
    pytest.importorskip("ImageReward")

import imagereward_fixtures as fixtures  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from tree_grpo_jax import rewards  # noqa: E402
from tree_grpo_jax.rewards import convert  # noqa: E402

TOLERANCE = 1e-4
PROMPTS = [
    "a photo of a cat",
    "Two RED dogs under the tree at sunset, painting",
    "a photo of a cat",  # a repeated prompt is tokenized once
    "a big old house " * 12,  # longer than 35 tokens: truncated
    "[ENC] a car in the city [DEC] xyz",  # BLIP's added tokens stay single tokens
]


def _images(shape, seed):
    """uint8 levels (what the release's PIL images hold) and the same images in [0, 1]."""
    levels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return levels, levels.astype(np.float32) / 255.0


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(release file, tokenizer folder, PyTorch model, converted folder)."""
    root = tmp_path_factory.mktemp("imagereward")
    checkpoint, tokenizer, model = fixtures.make_release(root / "release")
    out = root / "converted"
    argv = ["imagereward", f"--checkpoint={checkpoint}", f"--tokenizer={tokenizer}", f"--out={out}"]
    assert convert.main([str(a) for a in argv]) == 0
    return checkpoint, tokenizer, model, out


@pytest.fixture(scope="module")
def reward(release):
    # chunk_size 2 over 5 pairs: two full chunks and a remainder
    return rewards.load_reward("imagereward", str(release[3]), chunk_size=2)


def test_scores_and_features_match_the_release(release, reward):
    model = release[2]
    levels, images = _images((len(PROMPTS), 40, 56, 3), seed=0)
    want_scores, want_image, want_text = fixtures.release_scores(model, levels, PROMPTS)
    features = reward.fn.scorer.image_text_features(images, PROMPTS)
    got_image, got_text, got_scores = (np.asarray(a) for a in features)
    diffs = {
        "image tokens": np.abs(got_image - want_image).max(),
        "text features": np.abs(got_text - want_text).max(),
        "scores": np.abs(got_scores - want_scores).max(),
    }
    print("max abs differences:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert got_image.shape == want_image.shape == (len(PROMPTS), 1 + 14 * 14, 128)
    assert max(diffs.values()) <= TOLERANCE, diffs
    assert np.ptp(want_scores) > 0.1  # the scores differ, so agreeing means something

    scores = reward(images, PROMPTS)  # the registered reward: one jitted call
    assert scores.dtype == np.float32 and scores.shape == (len(PROMPTS),)
    np.testing.assert_allclose(np.asarray(scores), want_scores, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("shape", [(2, 40, 56, 3), (2, 301, 257, 3)])
def test_preprocessing_matches_the_release_transform(release, reward, shape):
    model = release[2]
    levels, images = _images(shape, seed=1)
    want = np.stack([model.preprocess(Image.fromarray(x)).numpy() for x in levels])
    got = np.asarray(reward.fn.scorer.preprocess(images)).transpose(0, 3, 1, 2)
    assert got.shape == want.shape == (2, 3, 224, 224)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_tokens_match_the_release_tokenizer(release, reward):
    want = release[2].blip.tokenizer(
        PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="np"
    )
    ids, mask = reward.fn.scorer.tokens(PROMPTS)
    np.testing.assert_array_equal(ids, want.input_ids)
    np.testing.assert_array_equal(mask, want.attention_mask)
    assert mask[3].all() and not mask[0].all()  # truncated, and padded
    tokenizer = release[2].blip.tokenizer
    assert tokenizer.enc_token_id in ids[4] and tokenizer.bos_token_id in ids[4]


def test_the_converter_keeps_the_packages_tensors(release):
    checkpoint, _, model, out = release
    source = {k: v.numpy() for k, v in model.state_dict().items()}
    vocab = len(fixtures.SPECIALS + fixtures.WORDS + fixtures.PIECES) + 2
    # the layout tests/parity/test_imagereward_convert.py builds without the package
    assert fixtures.release_shapes(vocab) == {k: v.shape for k, v in source.items()}
    written = load_file(out / "model.safetensors")
    unused = [k for k in source if "_proj." in k or k.endswith("position_ids")]
    assert len(unused) == 5 and written.keys() == source.keys() - set(unused)
    for key, value in written.items():
        assert value.dtype == np.float32, key
        np.testing.assert_array_equal(value, source[key], err_msg=key)


def test_bfloat16_scores_stay_near_the_release(release, tmp_path):
    checkpoint, tokenizer, _, _ = release
    out = tmp_path / "bf16"
    argv = ["imagereward", f"--checkpoint={checkpoint}", f"--tokenizer={tokenizer}"]
    assert convert.main([*argv, f"--out={out}", "--dtype=bfloat16"]) == 0
    levels, images = _images((2, 40, 56, 3), seed=2)
    want = fixtures.release_scores(release[2], levels, PROMPTS[:2])[0]
    got = rewards.load_reward("imagereward", str(out), dtype="bfloat16")(images, PROMPTS[:2])
    assert got.dtype == np.float32
    print("bfloat16 max abs difference:", np.abs(np.asarray(got) - want).max())
    np.testing.assert_allclose(np.asarray(got), want, atol=0.1, rtol=0)
