"""Per-image metadata reaches the rewards that take it (alone, frame by frame, combined) and
no other; a reward's sub-scores come out as the combined reward's parts."""

import numpy as np
import pytest

from tree_grpo_jax import rewards
from tree_grpo_jax.rewards import registry
from tree_grpo_jax.rewards.base import Scores


@pytest.fixture
def counting():
    """A reward scoring each image by its metadata's `count` (0 where none is known)."""
    seen = []

    def fn(images, prompts, metadata):
        seen.append(metadata)
        counts = [
            0.0 if m is None else float(m["count"]) for m in (metadata or [None] * len(images))
        ]
        return Scores.of(counts, {"twice": np.asarray(counts) * 2})

    reward = rewards.register("count_meta", fn, on_host=True, takes_metadata=True)
    yield reward, seen
    registry.unregister("count_meta")


def test_metadata_reaches_a_reward_that_takes_it(counting):
    reward, seen = counting
    images = np.zeros((2, 8, 8, 3), np.float32)
    meta = [{"count": 2}, {"count": 5}]
    np.testing.assert_allclose(reward(images, ["a", "b"], meta), [2, 5])
    np.testing.assert_allclose(reward(images, ["a", "b"]), [0, 0])
    assert seen == [meta, None]


def test_metadata_goes_with_each_frame_of_a_video(counting):
    reward, seen = counting
    videos = np.zeros((2, 3, 8, 8, 3), np.float32)
    scores, frames = reward.with_frames(videos, ["a", "b"], [{"count": 1}, {"count": 4}])
    np.testing.assert_allclose(scores, [1, 4])
    np.testing.assert_allclose(frames, [[1] * 3, [4] * 3])
    assert [m["count"] for m in seen[0]] == [1, 1, 1, 4, 4, 4]


def test_combined_reward_passes_metadata_only_where_taken(counting):
    combined = rewards.combined_reward({"count_meta": 1.0, "jpeg_compressibility": 0.0})
    images = np.zeros((2, 8, 8, 3), np.float32)
    total, parts, frames = combined.with_frames(images, ["a", "b"], [{"count": 3}, {"count": 1}])
    np.testing.assert_allclose(total, [3, 1])
    np.testing.assert_allclose(parts["count_meta/twice"], [6, 2])
    assert frames is None
    # the built-in rewards are called as before: (images, prompts)
    np.testing.assert_allclose(combined(images, ["a", "b"]), [0, 0])


def test_metadata_of_the_wrong_length_is_one_sentence(counting):
    reward, _ = counting
    with pytest.raises(ValueError, match="1 metadata entries for 2 images"):
        reward(np.zeros((2, 8, 8, 3), np.float32), ["a", "b"], [{"count": 1}])
