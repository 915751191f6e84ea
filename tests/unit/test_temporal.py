"""The temporal distance against a loop over consecutive frames written from its formula, and
a video's rewards frame by frame: each reward's frames against scoring the frames one at a
time, the weighted frames' mean against the total, and their names in the log."""

import numpy as np
import pytest

from tree_grpo_jax.evaluation import diversity, temporal
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import reporting


def _brute_force(video_embeddings):
    """Each video: the mean over t of the Euclidean norm of e[t + 1] - e[t], one pair at a
    time."""
    out = []
    for video in video_embeddings:
        steps = [
            np.sqrt(sum((a - b) ** 2 for a, b in zip(video[t + 1], video[t])))
            for t in range(len(video) - 1)
        ]
        out.append(sum(steps) / len(steps))
    return np.asarray(out)


def test_temporal_distance_matches_a_loop_over_consecutive_frames():
    e = np.random.default_rng(0).normal(size=(4, 5, 6)) * 2.0
    np.testing.assert_allclose(temporal.distances(e), _brute_force(e), rtol=1e-12)


def test_known_steps_give_the_known_values_and_ranking():
    # three videos of 4 frames in 3 features: still; moving one unit a frame along an axis;
    # steps of 3, 5 (a 3-4-5 triangle's hypotenuse) and 0 -> (3 + 5 + 0) / 3
    still = np.tile(np.asarray([1.0, -2.0, 0.5]), (4, 1))
    steady = still + np.arange(4)[:, None] * np.asarray([0.0, 1.0, 0.0])
    jumpy = np.asarray([[0, 0, 0], [3, 0, 0], [0, 4, 0], [0, 4, 0]], np.float64) + 7.0
    videos = np.stack([still, steady, jumpy])
    values = temporal.distances(videos)
    np.testing.assert_allclose(values, [0.0, 1.0, 8.0 / 3.0], atol=1e-12)
    assert list(np.argsort(values)) == [0, 1, 2]
    assert temporal.distances(videos[:1])[0] == 0.0  # a static video does not move


def test_temporal_distance_needs_two_frames():
    with pytest.raises(ValueError, match=r"T >= 2"):
        temporal.distances(np.zeros((2, 1, 3)))


def test_frame_embeddings_are_the_image_embedding_of_each_frame():
    rng = np.random.default_rng(1)
    videos = rng.uniform(size=(2, 3, 4, 5, 1))
    weights = rng.normal(size=(4 * 5, 6))

    def embed(images):  # a linear map of each image's pixels
        return np.asarray(images).reshape(len(images), -1) @ weights

    frames = diversity.per_frame(embed)(videos)
    assert frames.shape == (2, 3, 6)
    for b in range(2):
        for t in range(3):
            np.testing.assert_allclose(frames[b, t], videos[b, t].reshape(-1) @ weights)
    # the diversity's video embedding is the same frames laid end to end
    np.testing.assert_array_equal(diversity.over_frames(embed)(videos), frames.reshape(2, -1))


def _brightness(images, prompts):
    del prompts
    return np.asarray(images).mean(axis=(1, 2, 3))


def _first_pixel(images, prompts):
    del prompts
    return np.asarray(images)[:, 0, 0, 0] * 3.0


def _change(videos, prompts):  # a video reward: the mean step between frames
    del prompts
    return np.abs(np.diff(np.asarray(videos), axis=1)).mean(axis=(1, 2, 3, 4))


@pytest.fixture
def frame_rewards():
    reward_registry.register("t_brightness", _brightness, on_host=True)
    reward_registry.register("t_first_pixel", _first_pixel, on_host=True)
    reward_registry.register("t_change", _change, on_host=True, media="video")
    yield
    for name in ("t_brightness", "t_first_pixel", "t_change"):
        reward_registry.unregister(name)


def test_a_combined_reward_gives_the_videos_frames_and_their_mean_is_the_total(frame_rewards):
    videos = np.random.default_rng(2).uniform(size=(3, 4, 2, 2, 1))
    prompts = ["a", "b", "c"]
    weights = {"t_brightness": 1.0, "t_first_pixel": -0.5, "t_change": 2.0}
    total, parts, frames = reward_registry.combined_reward(weights).with_frames(videos, prompts)
    assert frames.shape == (3, 4)
    for b in range(3):
        for t in range(4):
            frame = videos[b, t]
            # a whole-video reward counts its score at every frame
            expected = frame.mean() - 0.5 * 3.0 * frame[0, 0, 0] + 2.0 * _change(videos, 0)[b]
            assert frames[b, t] == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(frames.mean(axis=1), total, rtol=1e-12)
    np.testing.assert_allclose(parts["t_brightness"], videos.mean(axis=(1, 2, 3, 4)))
    # images, and videos that no reward scores frame by frame, have no frames
    still = reward_registry.combined_reward({"t_brightness": 1.0})
    assert still.with_frames(videos[:, 0], prompts)[2] is None
    assert (
        reward_registry.combined_reward({"t_change": 1.0}).with_frames(videos, prompts)[2] is None
    )


def test_frame_rewards_are_named_in_frame_order_and_average_to_the_mean():
    frames = np.arange(24, dtype=np.float64).reshape(2, 12) ** 1.5
    logged = reporting.frame_rewards(frames)
    names = list(logged)
    assert names[0] == "reward_frame_00" and names[-1] == "reward_frame_11"
    assert names == sorted(names)  # zero-padded: TensorBoard lists them in frame order
    np.testing.assert_allclose(list(logged.values()), frames.mean(axis=0))
    assert np.mean(list(logged.values())) == pytest.approx(frames.mean())
    assert reporting.frame_rewards(None) == {}
    assert reporting.is_frame_reward("eval/reward_frame_03")
    assert not reporting.is_frame_reward("train/reward_mean")
    assert not reporting.is_frame_reward("reward_jpeg_compressibility")
