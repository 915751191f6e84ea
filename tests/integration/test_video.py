"""The model contract for videos, end to end: a toy video family registered from here (a tiny
3-D convolutional denoiser on samples [T, H, W, C], channels last as every video's latents,
decoding to [B, T, H, W, C]) trains through the real loop with an image reward applied frame
by frame and a reward declared for videos; the per-frame mean is checked against scoring the
frames by hand (PIL's JPEG sizes, a prompt-reading reward), the pictures a run writes (a PNG
strip of each video's frames and an animated GIF) are read back frame by frame, and a reward
that cannot take the model's media is one sentence at build."""

import dataclasses
import io
import json
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from tree_grpo_jax import config as cfg
from tree_grpo_jax.config import base_config
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import DDIMScheduleConfig, TextToImageModel
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.rewards.base import RewardMediaError
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run import reporting

FRAMES, SIDE, TOKENS, WIDTH = 4, 8, 2, 8
SAMPLE_SHAPE = (FRAMES, SIDE, SIDE, 1)  # channels last: [T, H, W, C], as the frames
PROMPTS = ("a calm sea", "a flickering candle")


class ToyVideoDenoiser(nn.Module):
    """Two 3-D convolutions over (T, H, W), the prompt and the timestep added between them."""

    @nn.compact
    def __call__(self, x, t, cond):
        h = nn.Conv(8, (3, 3, 3), padding="SAME")(x)
        h = h + nn.Dense(8)(jnp.mean(cond, axis=1))[:, None, None, None]
        h = h + nn.Dense(8)(t.astype(jnp.float32)[:, None] / 1000.0)[:, None, None, None]
        return nn.Conv(1, (3, 3, 3), padding="SAME")(nn.silu(h))


_NET = ToyVideoDenoiser()


def toy_denoise(params, x, t, cond):
    return _NET.apply({"params": params}, x, t, cond)


def toy_encode(prompts):
    """Each prompt a fixed random [TOKENS, WIDTH] drawn from its text's checksum."""
    rows = [
        np.random.default_rng(zlib.crc32(p.encode())).standard_normal((TOKENS, WIDTH))
        for p in prompts
    ]
    return jnp.asarray(np.stack(rows), jnp.float32)


def toy_decode(x):
    """[B, T, H, W, C] in [-1, 1] -> videos [B, T, H, W, C] in [0, 1]."""
    return jnp.clip((x.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)


def load_toy_video(request: model_registry.LoadRequest) -> TextToImageModel:
    x = jnp.zeros((1, *SAMPLE_SHAPE))
    cond = jnp.zeros((1, TOKENS, WIDTH))
    params = _NET.init(jax.random.key(request.seed), x, jnp.zeros((1,), jnp.int32), cond)
    return TextToImageModel(
        name="toy_video",
        sample_shape=SAMPLE_SHAPE,
        params=params["params"],
        denoise=toy_denoise,
        encode_prompts=toy_encode,
        decode=toy_decode,
        schedule_config=DDIMScheduleConfig(),
        media="video",
    )


def frame_brightness(images, prompts):
    """An image reward: each image's mean pixel."""
    del prompts
    return jnp.mean(jnp.asarray(images), axis=(1, 2, 3))


def steadiness(videos, prompts):
    """A video reward: minus the mean change between consecutive frames."""
    del prompts
    videos = jnp.asarray(videos)
    return -jnp.mean(jnp.abs(videos[:, 1:] - videos[:, :-1]), axis=(1, 2, 3, 4))


def prompt_length(images, prompts):
    """An image reward that reads its prompts: the prompt's length times the mean pixel."""
    lengths = np.asarray([len(p) for p in prompts], np.float32)
    return lengths * np.asarray(images).mean(axis=(1, 2, 3))


def still_only(images, prompts):
    del prompts
    return jnp.zeros(images.shape[0])


@pytest.fixture
def toy_video():
    family = model_registry.register(
        model_registry.ModelFamily(
            name="toy_video",
            model_names=("toy_video",),
            load=load_toy_video,
            prompt_sets={"toy_video_prompts": PROMPTS},
        )
    )
    reward_registry.register("frame_brightness", frame_brightness, on_host=False)
    reward_registry.register("steadiness", steadiness, on_host=False, media="video")
    reward_registry.register("prompt_length", prompt_length, on_host=True)
    reward_registry.register("still_only", still_only, on_host=False, per_frame=False)
    yield family
    model_registry.unregister("toy_video")
    for name in ("frame_brightness", "steadiness", "prompt_length", "still_only"):
        reward_registry.unregister(name)


def video_config(rewards: str = "frame_brightness:1.0,steadiness:0.5") -> ml_collections.ConfigDict:
    c = base_config()
    c.name = "toy_video"
    c.model.name = "toy_video"
    c.prompts.source = "toy_video_prompts"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.tree.method = "treegrpo"
    c.tree.window = 2
    c.train.iterations = 2
    c.train.learning_rate = 1e-3
    c.train.rows_per_minibatch = 8
    c.rewards = rewards
    c.eval.every = 1
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    return c


def random_videos(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (count, FRAMES, SIDE, SIDE, 1))


def jpeg_kb(frame: np.ndarray) -> float:
    """A frame's quality-95 JPEG size in kB, straight from PIL."""
    pixels = np.clip(np.round(frame[..., 0] * 255.0), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000.0


def test_an_image_reward_scores_a_video_as_the_mean_over_its_frames():
    videos = random_videos(3)
    scores = reward_registry.get_reward("jpeg_compressibility")(videos, ["x", "y", "z"])
    by_hand = [np.mean([-jpeg_kb(frame) for frame in video]) for video in videos]
    np.testing.assert_allclose(scores, by_hand, rtol=1e-6)
    assert scores.shape == (3,)


def test_each_frame_is_scored_with_its_video_prompt(toy_video):
    videos = random_videos(2, seed=1)
    scores = reward_registry.get_reward("prompt_length")(videos, list(PROMPTS))
    by_hand = [
        np.mean([len(prompt) * frame.mean() for frame in video])
        for video, prompt in zip(videos, PROMPTS)
    ]
    np.testing.assert_allclose(scores, by_hand, rtol=1e-6)


def test_a_video_reward_gets_the_videos_whole_and_combines_with_frame_rewards(toy_video):
    videos = random_videos(2, seed=2)
    combined = reward_registry.combined_reward({"frame_brightness": 1.0, "steadiness": 0.5})
    total, parts = combined(videos, list(PROMPTS), return_components=True)
    change = [np.mean(np.abs(np.diff(v, axis=0))) for v in videos]
    np.testing.assert_allclose(parts["steadiness"], -np.asarray(change), rtol=1e-5)
    np.testing.assert_allclose(parts["frame_brightness"], videos.mean(axis=(1, 2, 3, 4)), rtol=1e-5)
    np.testing.assert_allclose(
        total, videos.mean(axis=(1, 2, 3, 4)) - 0.5 * np.asarray(change), rtol=1e-5
    )


def test_rewards_refuse_what_they_do_not_take_in_one_sentence(toy_video):
    images = np.zeros((2, SIDE, SIDE, 1), np.float32)
    with pytest.raises(RewardMediaError) as info:
        reward_registry.get_reward("steadiness")(images, list(PROMPTS))
    assert str(info.value) == (
        "reward 'steadiness' scores whole videos [B, T, H, W, C], not images; choose a reward "
        "for images."
    )
    with pytest.raises(RewardMediaError, match="still images only"):
        reward_registry.get_reward("still_only")(random_videos(2), list(PROMPTS))
    with pytest.raises(RewardMediaError, match=r"shape \(2, 8\)"):
        reward_registry.get_reward("frame_brightness")(np.zeros((2, 8)), list(PROMPTS))


def test_a_toy_video_family_trains_through_the_loop_and_writes_its_pictures(toy_video, tmp_path):
    workdir = tmp_path / "run"
    summary = train.train(video_config(), str(workdir))
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [1, 2]
    assert all(np.isfinite(m["train/loss"]) for m in trained)
    rows = [m for m in metrics if "train/reward_steadiness" in m]
    assert rows and all(m["train/reward_steadiness"] <= 0 for m in rows)
    assert np.isfinite(summary["first_eval_reward"])

    # The eval pictures: a PNG of strips and an animated GIF, read back frame by frame against
    # the eval's own videos, decoded again from the initial weights.
    trainer, state = train.setup(video_config(), str(tmp_path / "again"))
    _, videos, _, _ = trainer.evaluator.evaluate_samples(state.params)
    assert videos.shape == (2, FRAMES, SIDE, SIDE, 1)
    png, gif = workdir / "eval_00000.png", workdir / "eval_00000.gif"
    assert png.is_file() and gif.is_file()
    scale = 256 // (SIDE * 8)
    expected = (np.clip(np.asarray(videos), 0, 1) * 255).round()
    strip = np.asarray(Image.open(png), np.float32)
    # each cell of the grid (1-pixel borders) holds one video's frames, left to right
    cell_w = FRAMES * (SIDE + 1) - 1
    assert strip.shape == (scale * (SIDE + 2), scale * (2 * (cell_w + 1) + 1))
    with Image.open(gif) as animation:
        assert animation.n_frames == FRAMES
        for t in range(FRAMES):
            animation.seek(t)
            moving = np.asarray(animation.convert("L"), np.float32)
            for i in range(2):
                top = scale * 1
                left = scale * (1 + i * (cell_w + 1) + t * (SIDE + 1))
                frame = strip[top : top + scale * SIDE : scale, left : left + scale * SIDE : scale]
                np.testing.assert_allclose(frame, expected[i, t, ..., 0], atol=1)
                left = scale * (1 + i * (SIDE + 1))
                shown = moving[top : top + scale * SIDE : scale, left : left + scale * SIDE : scale]
                np.testing.assert_allclose(shown, expected[i, t, ..., 0], atol=1)


def test_a_reward_that_cannot_take_the_model_media_is_one_sentence_at_build(toy_video, tmp_path):
    with pytest.raises(cfg.ConfigError) as info:
        train.setup(video_config("frame_brightness,still_only"), str(tmp_path / "a"))
    assert str(info.value) == (
        "reward 'still_only' scores still images only [B, H, W, C], not videos; choose a reward "
        "for videos."
    )
    tiny = base_config()
    tiny.model.name = "random_tiny"
    tiny.rewards = "steadiness"
    tiny.prompts.batch_size = 2
    tiny.prompts.eval_count = 2
    with pytest.raises(cfg.ConfigError) as info:
        train.setup(tiny, str(tmp_path / "b"))
    assert str(info.value) == (
        "reward 'steadiness' scores whole videos [B, T, H, W, C], not images; choose a reward "
        "for images."
    )


def test_a_model_whose_decode_is_not_its_media_is_one_sentence(toy_video, tmp_path):
    def as_images(request):  # a video model that says it decodes images
        return dataclasses.replace(load_toy_video(request), media="image")

    model_registry.register(dataclasses.replace(toy_video, load=as_images), overwrite=True)
    with pytest.raises(cfg.ConfigError) as info:
        train.setup(video_config("frame_brightness"), str(tmp_path))
    assert str(info.value) == (
        "model 'toy_video' says it decodes images but gives images of shape (1, 4, 8, 8, 1); "
        "images are [B, H, W, C] with C = 1 or 3."
    )


def test_a_video_sample_is_a_strip_and_an_animation(tmp_path):
    video = np.stack([np.full((3, 5, 1), t / 3) for t in range(4)])  # frames 0, 1/3, 2/3, 1
    png, gif = reporting.save_sample(str(tmp_path / "000_a_video.png"), video)
    strip = np.asarray(Image.open(png), np.float32)
    assert strip.shape == (3, 4 * 6 - 1)
    levels = [round(255 * t / 3) for t in range(4)]
    for t, level in enumerate(levels):
        assert np.all(strip[:, t * 6 : t * 6 + 5] == level)
        if t < 3:
            assert np.all(strip[:, t * 6 + 5] == 255)  # the white line between two frames
    with Image.open(gif) as animation:
        assert gif.endswith("000_a_video.gif") and animation.n_frames == 4
        for t, level in enumerate(levels):
            animation.seek(t)
            assert np.all(np.asarray(animation.convert("L")) == level)


def test_sample_writes_a_strip_and_an_animation_per_prompt_and_for_the_grid(tmp_path):
    from tree_grpo_jax.cli import sample

    videos = (random_videos(2, seed=3) * 255).round().astype(np.uint8)
    images, grid, animations = sample._write(str(tmp_path), list(PROMPTS), videos)
    assert [p.rsplit("/", 1)[1] for p in images] == [
        "000_a_calm_sea.png",
        "001_a_flickering_candle.png",
    ]
    assert animations == [p[: -len(".png")] + ".gif" for p in (*images, grid)]
    for path, video in zip(images, videos):
        strip = np.asarray(Image.open(path))
        for t in range(FRAMES):
            np.testing.assert_array_equal(
                strip[:, t * (SIDE + 1) : t * (SIDE + 1) + SIDE], video[t, ..., 0]
            )
    with Image.open(animations[0]) as animation:
        assert animation.n_frames == FRAMES
        animation.seek(FRAMES - 1)
        np.testing.assert_array_equal(np.asarray(animation.convert("L")), videos[0, -1, ..., 0])


def test_tensorboard_shows_videos_as_strips(tmp_path):
    writer = reporting.MetricsWriter(str(tmp_path), tensorboard=True)
    writer.write_image(0, "eval/samples", random_videos(2), ["a\n1", "b\n2"], columns=2)
    writer.close()
    assert list((tmp_path / "tensorboard").iterdir())


def test_tensorboard_gets_the_videos_moving_where_it_can_encode_them(tmp_path, monkeypatch):
    """With moviepy (which tensorboardX's video summaries need) the videos also go to
    `add_video` as [N, T, C, H, W] at the GIFs' frame rate; without it, the strips alone."""
    videos = random_videos(2, seed=4)
    for can in (True, False):
        monkeypatch.setattr(reporting, "can_write_video", lambda can=can: can)
        writer = reporting.MetricsWriter(str(tmp_path / str(can)), tensorboard=True)
        calls = []
        record = calls.append
        monkeypatch.setattr(writer._tb, "add_video", lambda *a, _r=record, **k: _r((a, k)))
        writer.write_image(3, "eval/samples", videos, ["a", "b"], columns=2)
        writer.close()
        if not can:
            assert calls == []
            continue
        [((tag, frames, step), options)] = calls
        assert (tag, step, options) == ("eval/samples_video", 3, {"fps": 8.0})
        assert frames.shape == (2, FRAMES, 1, SIDE, SIDE)
        np.testing.assert_allclose(frames[1, 2, 0], videos[1, 2, ..., 0], rtol=1e-6)
