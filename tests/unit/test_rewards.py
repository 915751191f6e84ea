"""Rewards: JPEG sizes against PIL directly, the registry, and the digit classifier."""

import io

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from tree_grpo_jax import rewards
from tree_grpo_jax.models.tiny import classifier
from tree_grpo_jax.models.tiny import rewards as digits
from tree_grpo_jax.models.tiny.data import digits_dataset
from tree_grpo_jax.models.tiny.grammar import DIGIT_PROMPTS


def _pil_jpeg_bytes(array_uint8: np.ndarray) -> int:
    buffer = io.BytesIO()
    Image.fromarray(array_uint8).save(buffer, "JPEG", quality=95)
    return len(buffer.getvalue())


@pytest.fixture(scope="module")
def noise_images():
    return np.random.default_rng(0).uniform(size=(3, 32, 32, 3)).astype(np.float32)


def test_jpeg_reward_is_pil_size_in_kb(noise_images):
    expected = [
        _pil_jpeg_bytes((np.round(im * 255)).astype(np.uint8)) / 1000.0 for im in noise_images
    ]
    got = rewards.get_reward("jpeg_incompressibility")(noise_images, ["x"] * 3)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    compress = rewards.get_reward("jpeg_compressibility")(noise_images, ["x"] * 3)
    np.testing.assert_allclose(compress, -np.asarray(expected), rtol=1e-6)


def test_jpeg_reward_accepts_one_channel():
    grey = np.random.default_rng(1).uniform(size=(2, 16, 16, 1)).astype(np.float32)
    expected = [_pil_jpeg_bytes(np.round(im[..., 0] * 255).astype(np.uint8)) / 1000 for im in grey]
    got = rewards.get_reward("jpeg_incompressibility")(grey, ["x", "y"])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_flat_image_is_more_compressible_than_noise(noise_images):
    flat = np.full((1, 32, 32, 3), 0.5, np.float32)
    reward = rewards.get_reward("jpeg_compressibility")
    assert reward(flat, ["x"])[0] > reward(noise_images[:1], ["x"])[0]


def test_combined_reward_is_weighted_sum():
    images, labels = digits_dataset("test")
    images = jnp.asarray(images[:6])
    prompts = [DIGIT_PROMPTS[(int(y) + 1) % 10] for y in labels[:6]]
    combined = rewards.combined_reward({"digit_alignment": 2.0, "jpeg_compressibility": -0.5})
    assert combined.on_host
    total, parts = combined(images, prompts, return_components=True)
    alignment = np.asarray(digits.digit_alignment(images, prompts))
    size = np.asarray(rewards.jpeg.jpeg_size_kb(images))
    np.testing.assert_allclose(parts["digit_alignment"], alignment, rtol=1e-6)
    np.testing.assert_allclose(total, 2.0 * alignment + 0.5 * size, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(combined(images, prompts), total)


def test_jax_only_combination_stays_on_device():
    combined = rewards.combined_reward({"digit_alignment": 1.0, "digit_probability": 1.0})
    assert not combined.on_host


def test_the_reward_string_reads_names_weights_and_family_members():
    assert rewards.parse_rewards(" a , b:0.1,remote:judge:-2") == {
        "a": 1.0,
        "b": 0.1,
        "remote:judge": -2.0,
    }
    assert rewards.parse_rewards("remote:judge") == {"remote:judge": 1.0}


@pytest.mark.parametrize(
    "text, sentence",
    [
        ("a,,b", "rewards 'a,,b' has an empty entry; write name[:weight],..."),
        (":2", "rewards ':2' has an empty entry; write name[:weight],..."),
        ("a:x", "reward weight 'x' of 'a' is not a number; write name:weight."),
        ("remote:j:x", "reward weight 'x' of 'remote:j' is not a number; write name:weight."),
        (
            "a, remote",
            "rewards entry 'remote' names no remote reward; write remote:<name>[:weight] with "
            "its settings in reward_options.remote.<name>.",
        ),
        (
            "remote::1",
            "rewards entry 'remote::1' names no remote reward; write remote:<name>[:weight] "
            "with its settings in reward_options.remote.<name>.",
        ),
    ],
)
def test_a_bad_reward_string_is_one_config_error(text, sentence):
    from tree_grpo_jax import config as cfg

    with pytest.raises(cfg.ConfigError) as caught:
        rewards.parse_rewards(text)
    assert str(caught.value) == sentence


def test_unknown_reward_names_known_ones():
    with pytest.raises(ValueError, match="unknown reward 'beauty'.*digit_alignment.*jpeg_"):
        rewards.get_reward("beauty")
    with pytest.raises(ValueError, match="reward 'hpsv2' needs a converted HPS-v2.1 folder"):
        rewards.load_reward("hpsv2")
    with pytest.raises(ValueError, match="reads no model folder and takes no path"):
        rewards.load_reward("digit_alignment", "/some/folder")
    with pytest.raises(ValueError, match="known rewards"):
        rewards.combined_reward({"digit_alignment": 1.0, "nope": 1.0})


def test_register_refuses_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("digit_alignment", lambda im, p: jnp.zeros(im.shape[0]), on_host=False)


def test_digit_alignment_prefers_the_prompted_digit():
    images, labels = digits_dataset("test")
    images, labels = jnp.asarray(images[:40]), labels[:40]
    right = [DIGIT_PROMPTS[int(y)] for y in labels]
    wrong = [DIGIT_PROMPTS[(int(y) + 3) % 10] for y in labels]
    reward = rewards.get_reward("digit_alignment")
    assert not reward.on_host
    aligned, misaligned = np.asarray(reward(images, right)), np.asarray(reward(images, wrong))
    assert np.all(aligned <= 0.0)
    assert np.mean(aligned > misaligned) >= 0.95
    # The probability is the exponent of the alignment; accuracy is its argmax.
    prob = np.asarray(rewards.get_reward("digit_probability")(images, right))
    np.testing.assert_allclose(prob, np.exp(aligned), rtol=1e-5)
    assert np.mean(np.asarray(rewards.get_reward("digit_accuracy")(images, right))) >= 0.95


def test_digit_log_odds_is_the_prompted_digits_log_odds_in_float64():
    """log(p / (1 - p)) against float64 numpy from the classifier's logits: one sign where the
    prompt is right and the other where it is wrong, and values far above the ceiling of
    `digit_alignment`'s 0 (the room a run climbs into)."""
    images, labels = digits_dataset("test")
    images, labels = jnp.asarray(images[:40]), labels[:40]
    right = [DIGIT_PROMPTS[int(y)] for y in labels]
    wrong = [DIGIT_PROMPTS[(int(y) + 3) % 10] for y in labels]
    logits = np.asarray(classifier.digit_log_probs(images), np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    reward = rewards.get_reward("digit_log_odds")
    assert not reward.on_host
    for prompts, digit in ((right, labels), (wrong, (labels + 3) % 10)):
        p_y = p[np.arange(40), digit]
        expected = np.log(p_y) - np.log1p(-p_y)
        got = np.asarray(reward(images, prompts), np.float64)
        finite = p_y < 1 - 1e-6  # where float32's 1 - p still has digits
        assert finite.sum() >= 20
        np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-3)
    assert np.ptp(got) > 1.0
    aligned = np.asarray(reward(images, right))
    assert np.mean(aligned > 0) >= 0.95 and np.mean(np.asarray(reward(images, wrong)) < 0) >= 0.95
    assert np.median(aligned) > 3.0


def test_classifier_takes_rgb_and_larger_images():
    images, labels = digits_dataset("test")
    images = jnp.asarray(images[:20])
    rgb = jnp.repeat(images, 3, axis=-1)
    np.testing.assert_allclose(
        classifier.digit_log_probs(rgb), classifier.digit_log_probs(images), rtol=1e-5, atol=1e-5
    )
    big = jnp.repeat(jnp.repeat(images, 4, axis=1), 4, axis=2)  # 32x32 nearest upsample
    predicted = np.argmax(np.asarray(classifier.digit_log_probs(big)), -1)
    assert np.mean(predicted == labels[:20]) >= 0.8


def test_prompt_count_must_match_images():
    images = jnp.zeros((2, 8, 8, 1))
    with pytest.raises(ValueError, match="one per image"):
        rewards.get_reward("digit_alignment")(images, [DIGIT_PROMPTS[0]])
