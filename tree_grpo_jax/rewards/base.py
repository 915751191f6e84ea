"""A reward as the run calls it: decoded images (or videos) and their prompts in, one score
each out, with the media it takes and where it runs; the errors a reward raises; and
`CombinedReward`, the weighted sum of several. The registry (`registry.py`) makes them by
name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import media as media_kinds

# (images [B, H, W, C] in [0, 1] (videos [B, T, H, W, C] for a video reward), prompts: one
# per image) -> scores [B]
RewardFn = Callable[[object, Sequence[str]], object]


# One mapping per image (its prompt's metadata: GenEval's objects, a category ...), or None.
Metadata = Sequence[Mapping[str, Any] | None] | None


def input_images(metadata: Metadata, count: int) -> list[list[np.ndarray]]:
    """Each of `count` images' input images, [H, W, 3] uint8 each (an empty list where its
    prompt names none): what a reward that takes input images receives. They ride on the
    metadata (a prompt file's row carries them as `input_images`, references whose pixels
    load here)."""
    if metadata is None:
        return [[] for _ in range(count)]
    return [[np.asarray(ref) for ref in getattr(m, "input_images", ())] for m in metadata]


class Scores(np.ndarray):
    """Scores [B] with the reward's named sub-scores `parts` {name: [B]} beside them:
    what a reward that gives sub-scores returns (they are logged as the reward's parts)."""

    parts: Mapping[str, np.ndarray] = {}

    @classmethod
    def of(cls, scores, parts: Mapping[str, Any] | None = None) -> Scores:
        out = np.asarray(scores, np.float32).view(cls)
        out.parts = {n: np.asarray(v, np.float32) for n, v in (parts or {}).items()}
        return out


class RewardUnavailable(RuntimeError):
    """A reward that could not score at all (its server down, stalled or answering
    nonsense after its retries); one sentence for the user."""


class RewardShapeError(ValueError):
    """A reward whose output is not one score per image; one sentence for the user."""


class RewardMediaError(ValueError):
    """A reward given media it does not take; one sentence for the user."""


def check_media(name: str, media: str) -> None:
    if media not in media_kinds.RANKS:
        raise ValueError(
            f"reward {name!r} takes media {media!r}; a reward takes "
            f"{' or '.join(media_kinds.RANKS)}."
        )


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    on_host: bool  # True: numpy on the host; False: JAX-native
    media: str = media_kinds.IMAGE  # what `fn` takes: "image" or "video"
    # an image reward scores a video frame by frame (the mean over its frames); False: the
    # reward means a still image only and refuses videos
    per_frame: bool = True
    # True: `fn(images, prompts, metadata)` gets each image's prompt metadata (a mapping,
    # or None where none is known); False: `fn(images, prompts)`, as every built-in reward
    takes_metadata: bool = False
    # True: `fn` also gets `input_images=`, one list per image of its prompt's input images
    # ([H, W, 3] uint8 each; empty where the prompt names none): a reward comparing the
    # output with what an editing or image-to-video model started from
    takes_input_images: bool = False

    def __post_init__(self):
        check_media(self.name, self.media)

    def takes(self, media: str) -> bool:
        """Whether the reward can score a batch of `media` ("image" or "video")."""
        if media == self.media:
            return True
        return self.media == media_kinds.IMAGE and media == media_kinds.VIDEO and self.per_frame

    def refusal(self, media: str) -> str:
        """The sentence saying why the reward cannot score `media`."""
        if self.media == media_kinds.VIDEO:
            takes = f"scores whole videos {media_kinds.LAYOUTS[media_kinds.VIDEO]}"
        else:
            takes = f"scores still images only {media_kinds.LAYOUTS[media_kinds.IMAGE]}"
        return f"reward {self.name!r} {takes}, not {media}s; choose a reward for {media}s."

    def __call__(self, images, prompts: Sequence[str], metadata: Metadata = None):
        return self.with_frames(images, prompts, metadata)[0]

    def with_frames(self, images, prompts: Sequence[str], metadata: Metadata = None):
        """(scores [B], each frame's score [B, T] or None): an image reward given videos
        also gives the scores of their frames (whose mean over T is the video's score);
        None for images, and for a video reward (it scores the videos whole). `metadata`
        (one mapping per image, its prompt's; None: none known) reaches only a reward that
        takes it."""
        scores, frames, _ = self.scored(images, prompts, metadata)
        return scores, frames

    def scored(self, images, prompts: Sequence[str], metadata: Metadata = None):
        """`with_frames` and the reward's named sub-scores {name: [B]} ({} for a reward
        that gives none; a reward served over HTTP may)."""
        media = media_kinds.of_rank(np.ndim(images))
        if media is None:
            raise RewardMediaError(
                f"reward {self.name!r} was given an array of shape {tuple(np.shape(images))}; "
                f"rewards score images {media_kinds.LAYOUTS[media_kinds.IMAGE]} or videos "
                f"{media_kinds.LAYOUTS[media_kinds.VIDEO]}."
            )
        if not self.takes(media):
            raise RewardMediaError(self.refusal(media))
        count = images.shape[0]
        if metadata is not None and len(metadata) != count:
            raise ValueError(
                f"reward {self.name!r} was given {len(metadata)} metadata entries for {count} "
                f"{media}s; it needs one per {media} (or none)."
            )
        if media == self.media:
            scores, parts = self._call(images, prompts, metadata)
            return self._checked(scores, count, media), None, parts
        # an image reward on videos: every frame with its video's prompt, then each video's
        # mean over its frames
        if len(prompts) != count:
            raise ValueError(
                f"reward {self.name!r} was given {len(prompts)} prompts for {count} videos; "
                "it needs one per video."
            )
        frames = images.shape[1]
        stills = images.reshape(count * frames, *images.shape[2:])
        per_frame = [p for p in prompts for _ in range(frames)]
        if metadata is not None:
            metadata = [m for m in metadata for _ in range(frames)]
        scores, parts = self._call(stills, per_frame, metadata)
        scores = self._checked(scores, count * frames, media_kinds.IMAGE)
        xp = np if isinstance(scores, np.ndarray) else jnp
        scores = scores.reshape(count, frames)
        parts = {n: np.asarray(v).reshape(count, frames).mean(axis=1) for n, v in parts.items()}
        return xp.mean(scores, axis=1), scores, parts

    def _call(self, images, prompts, metadata):
        """(scores, sub-scores): `fn`'s answer, with the metadata and the input images when
        the reward takes them; a reward giving sub-scores returns a `Scores` (an array with
        `.parts`)."""
        args = (images, prompts, metadata) if self.takes_metadata else (images, prompts)
        if self.takes_input_images:
            scores = self.fn(*args, input_images=input_images(metadata, len(images)))
        else:
            scores = self.fn(*args)
        if isinstance(scores, Scores):
            return np.asarray(scores), dict(scores.parts)
        return scores, {}

    def _checked(self, scores, count: int, media: str):
        shape = tuple(getattr(scores, "shape", ()))
        if shape != (count,):
            raise RewardShapeError(
                f"reward {self.name!r} returned scores of shape {shape} for {count} {media}s; "
                f"a reward gives one score per {media}, shape [{count}]."
            )
        return scores


@dataclasses.dataclass(frozen=True)
class CombinedReward:
    """The weighted sum of registered rewards; on the host if any component is."""

    weights: Mapping[str, float]
    rewards: Mapping[str, Reward]

    @property
    def name(self) -> str:
        return "+".join(f"{w:g}*{n}" for n, w in self.weights.items())

    @property
    def on_host(self) -> bool:
        return any(r.on_host for r in self.rewards.values())

    def __call__(
        self,
        images,
        prompts: Sequence[str],
        return_components: bool = False,
        metadata: Metadata = None,
    ):
        """The weighted sum `[B]`; with `return_components`, also `{name: scores [B]}`."""
        total, components, _ = self.with_frames(images, prompts, metadata)
        return (total, components) if return_components else total

    def with_frames(self, images, prompts: Sequence[str], metadata: Metadata = None):
        """(the weighted sum [B], {name: scores [B]}, the weighted sum frame by frame
        [B, T] or None). The frames' sum is given for videos that some reward scores frame
        by frame; a reward that scores videos whole counts its score at every frame, so the
        mean over T of a video's frames is its total. None for images, and for videos that
        no reward scores frame by frame (their frames' sums would all be the total). A
        reward's named sub-scores are components too, `<reward>/<name>`, outside the sum;
        `metadata` reaches the rewards that take it."""
        xp = np if self.on_host else jnp
        components, frames, subs = {}, {}, {}
        for n, r in self.rewards.items():
            scores, by_frame, parts = r.scored(images, prompts, metadata)
            components[n] = xp.asarray(scores)
            subs.update({f"{n}/{part}": np.asarray(v) for part, v in parts.items()})
            if by_frame is not None:
                frames[n] = xp.asarray(by_frame)
        total = sum(w * components[n] for n, w in self.weights.items())
        components.update(subs)
        if not frames:
            return total, components, None
        count = next(iter(frames.values())).shape[1]
        per_frame = sum(
            w * (frames[n] if n in frames else xp.repeat(components[n][:, None], count, axis=1))
            for n, w in self.weights.items()
        )
        return total, components, per_frame
