"""A toy video model (tests/video_fixtures.py: the tiny digits model whose frames are its
image shifted one pixel a frame) through the command lines: `tree_grpo_jax.main` logs the
reward frame by frame (metrics.jsonl and TensorBoard; their mean is the logged reward) and
the temporal distance beside the diversity; `evaluate` reports both (the temporal distance
checked against the digit classifier's features of the grid's frames, one frame at a time);
`sample` writes a strip and an animated GIF per prompt. An image run's metrics keep their
names; a reward that cannot take the model's media is one sentence, nothing written."""

import json
import os
import struct

import numpy as np
import pytest
from in_process import one_error_line, run_in_process, run_main
from PIL import Image
from small_configs import small_config
from video_fixtures import FRAMES, MODEL, toy_video_family

from tree_grpo_jax.rewards import registry as reward_registry

SIDE = 8  # the tiny model's images are 8x8, grey
PROMPTS = 4  # prompts.eval_count
K = 2  # eval.samples_per_prompt, and evaluate's
# test_sample's one-iteration run of small_config("grpo") (its rollout and train step come
# from the session's compile cache) on the toy video model, two samples per eval prompt
RUN = [
    "--config=tests/defaults_config.py",
    f"--config.model.name={MODEL}",
    "--config.prompts.source=digits",
    "--config.prompts.batch_size=2",
    f"--config.prompts.eval_count={PROMPTS}",
    "--config.sampling.num_steps=4",
    "--config.sampling.guidance_scale=2.0",
    "--config.tree.method=grpo",
    "--config.tree.group_size=4",
    "--config.tree.window=2",
    "--config.tree.k=2",
    "--config.tree.split_steps=(0, 2)",
    "--config.train.iterations=1",
    "--config.train.learning_rate=1e-3",
    "--config.train.clip_range=0.2",
    "--config.train.rows_per_minibatch=8",
    "--config.rewards=jpeg_compressibility",
    "--config.eval.every=0",
    f"--config.eval.samples_per_prompt={K}",
    "--config.checkpoint.every=1",
    "--config.log.progress=True",
    "--config.log.tensorboard=True",
]


def _main():
    from tree_grpo_jax.cli import main

    return main


def _evaluate():
    from tree_grpo_jax.cli import evaluate

    return evaluate


@pytest.fixture(scope="module")
def family():
    with toy_video_family():
        yield


@pytest.fixture(scope="module")
def video_run(family, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("video") / "run"
    result = run_main(*RUN, f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


@pytest.fixture(scope="module")
def evaluated(video_run, tmp_path_factory):
    workdir, _ = video_run
    out = tmp_path_factory.mktemp("video_eval") / "evaluation"
    result = run_in_process(
        _evaluate(), f"--workdir={workdir}", f"--samples_per_prompt={K}", f"--out={out}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads((out / "evaluation.json").read_text())


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _frames(row: dict, prefix: str) -> list[float]:
    names = sorted(k for k in row if k.startswith(f"{prefix}reward_frame_"))
    assert names == [f"{prefix}reward_frame_{t}" for t in range(FRAMES)]
    return [row[n] for n in names]


def _tensorboard(workdir) -> dict[str, set]:
    """The tags of the run's TensorBoard events (scalars and images), read from the record
    files as TensorBoard reads them: length, its CRC, the Event proto, its CRC."""
    from tensorboardX.proto import event_pb2

    tags = {"scalars": set(), "images": set()}
    folder = workdir / "tensorboard"
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                kind = "images" if value.HasField("image") else "scalars"
                tags[kind].add(value.tag)
    return tags


def test_a_video_run_logs_its_reward_frame_by_frame(video_run):
    workdir, result = video_run
    rows = _metrics(workdir)
    trained = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in trained] == [1] and [r["step"] for r in evals] == [0, 1]
    for row, prefix in [*((r, "train/") for r in trained), *((r, "eval/") for r in evals)]:
        frames = _frames(row, prefix)
        assert np.mean(frames) == pytest.approx(row[f"{prefix}reward_mean"], rel=1e-6)
        assert np.ptp(frames) > 0  # the shifted frames score differently
    for row in evals:  # shifted frames move; beside the diversity
        assert row["eval/temporal_distance"] > 0 and row["eval/diversity"] > 0
    # the progress lines and the run's record keep to one figure a metric
    assert "reward_frame" not in result.stdout and "temporal_distance=" in result.stdout
    summary = json.loads((workdir / "summary.json").read_text())
    assert all(not any("frame" in k for k in e) for e in summary["evals"])
    assert all("temporal_distance" in e and "diversity" in e for e in summary["evals"])
    tags = _tensorboard(workdir)
    assert {f"train/reward_frame_{t}" for t in range(FRAMES)} <= tags["scalars"]
    assert {"eval/reward_frame_0", "eval/temporal_distance"} <= tags["scalars"]
    assert "eval/samples" in tags["images"]  # the strips (moviepy is not a dependency)
    assert (workdir / "eval_00000.png").is_file() and (workdir / "eval_00000.gif").is_file()


def _grid_videos(path) -> np.ndarray:
    """evaluate's grid read back: a cell per sample (K rows of PROMPTS columns, one-pixel
    borders, scaled up), each a strip of FRAMES frames -> [K * PROMPTS, T, H, W] in [0, 1]."""
    grid = np.asarray(Image.open(path), np.float32) / 255.0
    strip = FRAMES * (SIDE + 1) - 1
    scale = grid.shape[0] // (K * (SIDE + 1) + 1)
    assert grid.shape == (scale * (K * (SIDE + 1) + 1), scale * (PROMPTS * (strip + 1) + 1))
    videos = []
    for k in range(K):
        for p in range(PROMPTS):
            top, left = scale * (1 + k * (SIDE + 1)), scale * (1 + p * (strip + 1))
            cell = grid[top : top + scale * SIDE : scale, left : left + scale * strip : scale]
            videos.append([cell[:, t * (SIDE + 1) : t * (SIDE + 1) + SIDE] for t in range(FRAMES)])
    return np.asarray(videos)


def test_evaluate_reports_the_temporal_distance_of_its_samples(video_run, evaluated):
    workdir, _ = video_run
    out, result = evaluated
    base, trained = result["rows"]
    assert base["label"] == "base" and trained["label"] == "step 1"
    # the base row is the run's first evaluation, the trained one its last, sample for sample
    evals = {r["step"]: r for r in _metrics(workdir) if "eval/reward_mean" in r}
    for row, step in ((base, 0), (trained, 1)):
        for name in ("temporal_distance", "diversity"):
            assert row[name]["mean"] == pytest.approx(evals[step][f"eval/{name}"], rel=1e-6)
    assert "temporal_distance" in (out / "evaluation.md").read_text() and "diversity" in base
    # by hand from the grid's pixels: each frame through the digit classifier's features
    # alone, then the mean distance between consecutive frames, pair by pair
    from tree_grpo_jax.models.tiny.classifier import digit_features

    videos = _grid_videos(base["grid"])
    for video in videos:  # the toy's frames: the first shifted one pixel a frame
        for t in range(FRAMES):
            np.testing.assert_array_equal(video[t], np.roll(video[0], t, axis=1))
    by_hand = []
    for video in videos:
        features = [np.asarray(digit_features(f[None, :, :, None]))[0] for f in video]
        steps = [np.linalg.norm(features[t + 1] - features[t]) for t in range(FRAMES - 1)]
        by_hand.append(np.mean(steps))
    # the grid holds 8-bit pixels: a small difference from the float samples
    assert base["temporal_distance"]["mean"] == pytest.approx(np.mean(by_hand), rel=2e-2)
    assert base["temporal_distance"]["std"] == pytest.approx(np.std(by_hand), rel=0.1, abs=1e-3)
    assert base["animation"].endswith(".gif") and os.path.isfile(base["animation"])


def test_sample_writes_a_strip_and_an_animation_per_prompt(video_run, tmp_path):
    from tree_grpo_jax.cli import sample

    workdir, _ = video_run
    out = tmp_path / "drawn"
    assert sample.main([f"--workdir={workdir}", f"--out={out}"]) == 0
    stems = [
        f"00{i}_a_handwritten_digit_{n}" for i, n in enumerate(("zero", "one", "two", "three"))
    ]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{s}.{e}" for s in (*stems, "grid") for e in ("png", "gif"))
    for stem in stems:
        strip = np.asarray(Image.open(out / f"{stem}.png"))
        assert strip.shape == (SIDE, FRAMES * (SIDE + 1) - 1)
        frames = [strip[:, t * (SIDE + 1) : t * (SIDE + 1) + SIDE] for t in range(FRAMES)]
        assert np.all(strip[:, SIDE :: SIDE + 1] == 255)  # white lines between the frames
        with Image.open(out / f"{stem}.gif") as animation:
            assert animation.n_frames == FRAMES and animation.size == (SIDE, SIDE)
            for t in range(FRAMES):
                animation.seek(t)
                np.testing.assert_array_equal(np.asarray(animation.convert("L")), frames[t])
                np.testing.assert_array_equal(frames[t], np.roll(frames[0], t, axis=1))


def test_an_image_runs_metrics_keep_their_names(tmp_path):
    """test_sample's one-iteration image run (its programs come from the session's compile
    cache): the keys it logged before videos were logged frame by frame."""
    from tree_grpo_jax.run import loop as train

    c = small_config("grpo")
    c.train.iterations = 1
    c.eval.every = 0
    train.train(c, str(tmp_path / "run"))
    keys = [sorted(r) for r in _metrics(tmp_path / "run")]
    evaluation = ["eval/reward_mean", "eval/reward_std", "step"]
    trained = [
        "step",
        *(
            f"train/{k}"
            for k in [
                *("approx_kl", "clip_fraction", "grad_norm", "kl", "learning_rate", "loss"),
                *("minibatches", "ratio_max", "ratio_mean", "ratio_min", "reward_mean"),
                *("reward_std", "time_iteration", "time_reward", "time_rollout", "time_update"),
                *("train_rows", "trained_edges", "window_start"),
            ]
        ),
    ]
    assert keys == [evaluation, trained, evaluation]


def _still(images, prompts):
    del prompts
    return np.asarray(images).mean(axis=(1, 2, 3))


def _steadiness(videos, prompts):
    del prompts
    return -np.abs(np.diff(np.asarray(videos), axis=1)).mean(axis=(1, 2, 3, 4))


@pytest.mark.parametrize(
    "model, reward, sentence",
    [
        (
            "random_tiny",
            "t_steadiness",
            "reward 't_steadiness' scores whole videos [B, T, H, W, C], not images; choose a "
            "reward for images.",
        ),
        (
            MODEL,
            "t_still",
            "reward 't_still' scores still images only [B, H, W, C], not videos; choose a "
            "reward for videos.",
        ),
    ],
)
def test_a_reward_for_other_media_is_one_sentence_and_writes_nothing(
    family, tmp_path, model, reward, sentence
):
    reward_registry.register("t_steadiness", _steadiness, on_host=True, media="video")
    reward_registry.register("t_still", _still, on_host=True, per_frame=False)
    try:
        workdir = tmp_path / "run"
        args = [a for a in RUN if not a.startswith(("--config.model.name", "--config.rewards"))]
        result = run_main(
            *args,
            f"--config.model.name={model}",
            f"--config.rewards={reward}",
            f"--workdir={workdir}",
        )
    finally:
        reward_registry.unregister("t_steadiness")
        reward_registry.unregister("t_still")
    assert one_error_line(result) == f"error: {sentence}"
    assert not workdir.exists()
