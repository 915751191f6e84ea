"""Sample diversity: how far apart a prompt's samples are, in an image embedding.

Per prompt, the mean Euclidean distance over the K(K-1)/2 pairs of its K samples'
embeddings (`per_group`); averaged over prompts. During training a prompt's samples are
every eval row with its text (`groups_by_text`): its repeats in the eval list (the tiny
model's 100 eval rows are its 10 digit prompts, 10 noises each) times
`eval.samples_per_prompt`; the evaluate command takes each prompt of its list apart, with
its `--samples_per_prompt` noises. A reward that collapses the samples of a prompt onto one
image drives it towards 0. The embedding is, in order of preference: CLIP's image features
(unit vectors, so a distance lies in [0, 2]) when a CLIP reward folder is configured, the
model family's own image features (the tiny model: its digit classifier's hidden layer), or
the pixels themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# CLIP reward folders whose image tower embeds for diversity, in order, with their layouts
CLIP_FOLDERS = (
    ("clip_score", "resize_crop_hf"),
    ("pickscore", "resize_crop_hf"),
    ("hpsv2", "resize_pad_hpsv2"),
)

Embed = Callable[[object], np.ndarray]  # images [B, H, W, C] in [0, 1] -> [B, D]


def pairwise_distances(embeddings) -> np.ndarray:
    """[..., K, D] -> [..., K, K] Euclidean distances."""
    e = np.asarray(embeddings, np.float64)
    sq = np.sum(e**2, axis=-1)
    gram = e @ np.swapaxes(e, -1, -2)
    # the expansion can go slightly negative for equal rows
    return np.sqrt(np.maximum(sq[..., :, None] + sq[..., None, :] - 2.0 * gram, 0.0))


def per_prompt(embeddings) -> np.ndarray:
    """[P, K, D] -> [P]: each prompt's mean distance over its sample pairs (K >= 2)."""
    e = np.asarray(embeddings, np.float64)
    if e.ndim != 3 or e.shape[1] < 2:
        raise ValueError(f"diversity needs [prompts, K >= 2, features], got {e.shape}.")
    k = e.shape[1]
    upper = np.triu(np.ones((k, k), bool), 1)
    return pairwise_distances(e)[:, upper].mean(axis=-1)


def per_group(embeddings, groups) -> np.ndarray:
    """[N, D] rows and groups of row indices (two or more each) -> [G]: each group's mean
    distance over its sample pairs. A group is measured on its own, so its value does not
    depend on which other groups share the call (the evaluate command's chunks)."""
    e = np.asarray(embeddings, np.float64)
    return np.asarray([per_prompt(e[np.asarray(rows)][None])[0] for rows in groups], np.float64)


def groups_by_text(prompts) -> list[np.ndarray]:
    """The rows of each prompt text that has two or more, in order of first appearance (a
    prompt repeated in the eval list, or sampled with several noises, has several rows)."""
    groups: dict[str, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(row)
    return [np.asarray(rows) for rows in groups.values() if len(rows) >= 2]


def repeats(prompts) -> bool:
    """Whether some prompt occurs twice, so that the diversity has samples to compare."""
    return len(set(prompts)) < len(prompts)


def by_prompt(values, num_prompts: int, samples_per_prompt: int) -> np.ndarray:
    """Rows laid out sample-major ([k * P + p]) -> [P, K, ...]."""
    v = np.asarray(values)
    v = v.reshape(samples_per_prompt, num_prompts, *v.shape[1:])
    return np.swapaxes(v, 0, 1)


def per_frame(embed: Embed) -> Callable[[object], np.ndarray]:
    """An image embedding applied to each frame of videos: [B, T, H, W, C] -> [B, T, D]
    (the temporal distance's input, `evaluation.temporal`)."""

    def embed_frames(videos) -> np.ndarray:
        b, t = np.shape(videos)[:2]
        frames = np.asarray(videos).reshape(b * t, *np.shape(videos)[2:])
        return np.asarray(embed(frames)).reshape(b, t, -1)

    return embed_frames


def over_frames(embed: Embed) -> Embed:
    """An image embedding as a video one: videos [B, T, H, W, C] -> their B*T frames'
    features, each video's concatenated in frame order -> [B, T * D] (so two videos' distance
    compares them frame by frame): `per_frame`'s output with its frames laid end to end."""
    frames = per_frame(embed)

    def embed_video(videos) -> np.ndarray:
        return flat_frames(frames(videos))

    return embed_video


def flat_frames(frame_embeddings) -> np.ndarray:
    """[B, T, D] -> [B, T * D], as `over_frames` embeds a video."""
    e = np.asarray(frame_embeddings)
    return e.reshape(e.shape[0], -1)


def pixels(images) -> np.ndarray:
    return np.asarray(images, np.float32).reshape(np.shape(images)[0], -1)


def _clip_embed(path: str, layout: str, mesh, chunk_size: int) -> tuple[Embed, str]:
    from tree_grpo_jax.rewards import clip

    scorer = clip.load_clip(
        path, layout=layout, towers=(clip.IMAGE,), mesh=mesh, chunk_size=chunk_size
    )
    features = jax.jit(scorer.image_embeddings)
    return (lambda images: np.asarray(features(scorer.params, jnp.asarray(images)))), "clip"


def make_embed(config, mesh=None) -> tuple[Embed, str]:
    """The run's diversity embedding and its name ("clip", "features" or "pixels")."""
    from tree_grpo_jax.models import registry

    folders = config.reward_models
    for name, layout in CLIP_FOLDERS:
        if folders.get(name):
            return _clip_embed(folders[name], layout, mesh, config.reward_options.chunk_size)
    family = registry.family_of(config.model.name)
    if family.image_features is not None:
        features = family.image_features()
        return (lambda images: np.asarray(features(jnp.asarray(images)))), "features"
    return pixels, "pixels"
