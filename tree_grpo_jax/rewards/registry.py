"""The reward registry: a reward maps decoded images and their prompts to one score each.

    reward = get_reward("digit_alignment")
    scores = reward(images, prompts)          # images [B, H, W, C] float32 in [0, 1] -> [B]

Each reward says whether it runs on the host (numpy, e.g. PIL's JPEG encoder) or is
JAX-native (it can run on the accelerator, inside jit when its inputs allow), and the media
it takes (`models.media`): "image" (every built-in reward) or "video". An image reward given
videos [B, T, H, W, C] scores their B*T frames, each with its video's prompt, and gives
each video the mean over its frames; a video reward gets the videos whole and takes no
images. `with_frames` gives an image reward's frames' scores too, and a combined reward's
weighted sum frame by frame (a run logs them). Rewards that read a model (HPS-v2.1,
PickScore, ...) are registered with `register_model` and built from their folder by
`load_reward(name, path)`; a reward with settings of its own registers their defaults
(`options`), which a run's config holds in `reward_options.<name>` and which reach the
builder as keyword arguments. Several rewards combine into one weighted sum with
`combined_reward`. `load_rewards` builds what a run's config names; nothing outside a
reward's own module needs to know its name.
"""

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


def _check_media(name: str, media: str) -> None:
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

    def __post_init__(self):
        _check_media(self.name, self.media)

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
        """(scores, sub-scores): `fn`'s answer, with the metadata when the reward takes it;
        a reward giving sub-scores returns a `Scores` (an array with `.parts`)."""
        scores = (
            self.fn(images, prompts, metadata) if self.takes_metadata else self.fn(images, prompts)
        )
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
class _Entry:
    """How to build a reward: `make(path, **options) -> RewardFn`."""

    make: Callable[..., RewardFn]
    on_host: bool
    weights: str  # what folder the reward reads; "" when it needs none
    default_path: str  # used when no path is given ("" = none)
    options: Callable[[], Any] | None = None  # defaults of `reward_options.<name>`
    check_options: Callable[[Any], str | None] | None = None  # one sentence for a bad value
    moved_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)  # old -> new
    media: str = media_kinds.IMAGE  # as `Reward.media`
    per_frame: bool = True  # as `Reward.per_frame`
    takes_metadata: bool = False  # as `Reward.takes_metadata`

    def reward(self, name: str, fn: RewardFn) -> Reward:
        return Reward(name, fn, self.on_host, self.media, self.per_frame, self.takes_metadata)


@dataclasses.dataclass(frozen=True)
class _Family:
    """Rewards named `<family>:<instance>` (e.g. `remote:judge`), each built from its own
    settings `reward_options.<family>.<instance>`: `make(instance, settings) -> RewardFn`."""

    make: Callable[[str, Any], RewardFn]
    options: Callable[[], Any]  # one instance's defaults
    check_options: Callable[[str, Any], str | None]  # (instance, settings) -> one sentence
    probe: Callable[[str, Any], str | None] | None  # a sentence when it cannot score now
    on_host: bool
    takes_metadata: bool
    media_of: Callable[[Any], str]  # an instance's media, from its settings
    describe: str  # the first setting to give, `field=example` (an instance not configured)


_REGISTRY: dict[str, _Entry] = {}
_FAMILIES: dict[str, _Family] = {}
_families_added = False


def _add_family_rewards() -> None:
    """Once: the rewards model families bring (the tiny model's digit rewards)."""
    global _families_added
    if _families_added:
        return
    _families_added = True
    from tree_grpo_jax.models import registry as model_registry

    for family in model_registry.families():
        for name, (fn, on_host, *media) in (family.rewards() if family.rewards else {}).items():
            if name not in _REGISTRY:  # (fn, on_host) or (fn, on_host, media)
                register(name, fn, on_host, media=media[0] if media else media_kinds.IMAGE)


def _add(name: str, entry: _Entry, overwrite: bool) -> None:
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a reward named {name!r} is already registered; pass overwrite=True.")
    _REGISTRY[name] = entry


def register(
    name: str,
    fn: RewardFn,
    on_host: bool,
    *,
    media: str = media_kinds.IMAGE,
    per_frame: bool = True,
    takes_metadata: bool = False,
    overwrite: bool = False,
) -> Reward:
    """Adds a reward that needs no weights; registering a taken name needs `overwrite=True`.

    `media` is what `fn` takes ("image": [B, H, W, C], "video": [B, T, H, W, C]); an image
    reward scores videos frame by frame unless `per_frame=False`; with `takes_metadata`
    it is called `fn(images, prompts, metadata)` (see `Reward`)."""

    def make(path=None):
        del path  # checked by load_reward
        return fn

    entry = _Entry(
        make,
        bool(on_host),
        "",
        "",
        media=media,
        per_frame=bool(per_frame),
        takes_metadata=bool(takes_metadata),
    )
    reward = entry.reward(name, fn)  # checks the media before the name is taken
    _add(name, entry, overwrite)
    return reward


def register_model(
    name: str,
    make: Callable[..., RewardFn],
    *,
    weights: str,
    default_path: str = "",
    on_host: bool = False,
    options: Callable[[], Any] | None = None,
    check_options: Callable[[Any], str | None] | None = None,
    moved_fields: Mapping[str, str] | None = None,
    media: str = media_kinds.IMAGE,
    per_frame: bool = True,
    overwrite: bool = False,
) -> None:
    """Adds a reward computed by a model read from a folder: `make(path, **options)`.

    `weights` says which folder that is (it ends the sentence when none is configured);
    `default_path` (a local folder or hub id) is used when no path is given. `options`
    gives the defaults of the reward's own settings (a ConfigDict: `reward_options.<name>`
    in a run's config), `check_options` one sentence for a bad one, `moved_fields` the
    config fields that moved into that section (old path -> new path); `media` and
    `per_frame` are as `register`'s.
    """
    _check_media(name, media)
    if not weights:
        raise ValueError(f"register_model({name!r}) needs `weights`: what folder it reads.")
    entry = _Entry(
        make,
        bool(on_host),
        weights,
        default_path,
        options,
        check_options,
        dict(moved_fields or {}),
        media,
        bool(per_frame),
    )
    _add(name, entry, overwrite)


def register_family(
    family: str,
    make: Callable[[str, Any], RewardFn],
    *,
    options: Callable[[], Any],
    check_options: Callable[[str, Any], str | None],
    probe: Callable[[str, Any], str | None] | None = None,
    on_host: bool = True,
    takes_metadata: bool = True,
    media_of: Callable[[Any], str] = lambda settings: media_kinds.IMAGE,
    describe: str = "",
) -> None:
    """Adds a family of rewards named `<family>:<instance>` in a run's `rewards`, each built
    by `make(instance, settings)` from `reward_options.<family>.<instance>` (the defaults
    `options()`, the checks `check_options(instance, settings)`); `probe` says in one
    sentence why an instance cannot score now (its server down), before a run writes
    anything."""
    if ":" in family or family in _REGISTRY:
        raise ValueError(f"reward family {family!r} would shadow a reward name.")
    _FAMILIES[family] = _Family(
        make,
        options,
        check_options,
        probe,
        bool(on_host),
        bool(takes_metadata),
        media_of,
        describe,
    )


def reward_families() -> tuple[str, ...]:
    """The registered families (`remote`): their rewards are `<family>:<instance>`."""
    return tuple(sorted(_FAMILIES))


def split_name(name: str) -> tuple[str, str] | None:
    """(family, instance) of a family's reward name (`remote:judge`), else None."""
    family, sep, instance = name.partition(":")
    return (family, instance) if sep and family in _FAMILIES else None


def is_known(name: str) -> bool:
    """A registered reward's name, or a registered family's `<family>:<instance>`."""
    return name in available_rewards() or split_name(name) is not None


def instance_settings(name: str, reward_options):
    """The settings of a family's reward (`reward_options.<family>.<instance>`), or None
    when the config holds none."""
    family, instance = split_name(name)
    section = reward_options.get(family) if hasattr(reward_options, "get") else None
    return section.get(instance) if hasattr(section, "get") else None


def instance_defaults(family: str):
    """The defaults of one instance's settings in `family` (None for no such family)."""
    return _FAMILIES[family].options() if family in _FAMILIES else None


def check_instances(used: Sequence[str], reward_options) -> str | None:
    """The sentence for the first family reward in `used` that has no settings, or for the
    first bad setting of any instance in the config (the used ones first); else None."""
    for name in used:
        if split_name(name) and instance_settings(name, reward_options) is None:
            family, instance = split_name(name)
            return (
                f"reward {name!r} has no settings: set "
                f"--config.reward_options.{family}.{instance}.{_FAMILIES[family].describe} "
                "(see docs/prompts-and-rewards.md)."
            )
    for family, entry in _FAMILIES.items():
        section = reward_options.get(family) if hasattr(reward_options, "get") else None
        if section is None:
            continue
        if not hasattr(section, "items"):
            return f"reward_options.{family} must be a section of named {family} rewards."
        names = sorted(section, key=lambda n: f"{family}:{n}" not in used)
        for instance in names:
            sentence = entry.check_options(instance, section[instance])
            if sentence:
                return sentence
    return None


def unreachable(used: Sequence[str], reward_options) -> str | None:
    """One sentence for the first family reward in `used` that cannot score now (its
    server does not answer), else None: a run asks before it writes anything."""
    for name in dict.fromkeys(used):
        split = split_name(name)
        if split is None or _FAMILIES[split[0]].probe is None:
            continue
        settings = instance_settings(name, reward_options)
        if settings is None:  # the config's checks say so
            continue
        sentence = _FAMILIES[split[0]].probe(split[1], settings)
        if sentence:
            return sentence
    return None


def load_instance(name: str, reward_options) -> Reward:
    """The family reward `name` (`remote:judge`) built from its settings."""
    family, instance = split_name(name)
    settings = instance_settings(name, reward_options)
    entry = _FAMILIES[family]
    if settings is None:
        raise ValueError(check_instances([name], reward_options))
    sentence = entry.check_options(instance, settings)
    if sentence:
        raise ValueError(sentence)
    media = entry.media_of(settings)
    return Reward(
        name,
        entry.make(instance, settings),
        entry.on_host,
        media,
        takes_metadata=entry.takes_metadata,
    )


def unregister(name: str) -> None:
    """Removes a reward (tests that register toys clean up with this)."""
    _REGISTRY.pop(name, None)


def available_rewards() -> tuple[str, ...]:
    _add_family_rewards()
    return tuple(sorted(_REGISTRY))


def _entry(name: str) -> _Entry:
    _add_family_rewards()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward {name!r}; known rewards are: {', '.join(available_rewards())}."
        )
    return _REGISTRY[name]


def needs_weights(name: str) -> bool:
    """True when the reward reads a model folder (a path, or its default, must be given)."""
    return split_name(name) is None and bool(_entry(name).weights)


def reads_model(name: str) -> bool:
    """Whether a reward of that name reads a model (False for one not registered)."""
    return name in _REGISTRY and bool(_REGISTRY[name].weights)


def missing_weights(name: str, path: str | None) -> str | None:
    """The sentence saying why `name` cannot load without a path, or None if it can."""
    if split_name(name):
        return None
    entry = _entry(name)
    if entry.weights and not path and not entry.default_path:
        return (
            f"reward {name!r} needs {entry.weights}: set --config.reward_models.{name}=/path "
            "(see docs/prompts-and-rewards.md)."
        )
    return None


def load_reward(name: str, path: str | None = None, **options) -> Reward:
    """The reward `name`, built from its folder `path` when it reads one.

        reward = load_reward("hpsv2", "/models/hpsv2.1")
        scores = reward(images, prompts)   # [B, H, W, 3] in [0, 1], B prompts -> [B] float32

    `options` go to the reward's builder (for the CLIP rewards: dtype, chunk_size, mesh,
    and pickscore's divisor). Raises ValueError (ModelLoadError for a bad folder) with one
    sentence.
    """
    entry = _entry(name)
    if not entry.weights:
        if path or options:
            given = "path" if path else f"options ({', '.join(sorted(options))})"
            raise ValueError(f"reward {name!r} reads no model folder and takes no {given}.")
        return entry.reward(name, entry.make())
    sentence = missing_weights(name, path)
    if sentence:
        raise ValueError(sentence)
    from tree_grpo_jax.models.registry import BUILD_ERRORS, config_error
    from tree_grpo_jax.weights.files import ModelLoadError

    folder = path or entry.default_path
    try:
        fn = entry.make(folder, **options)
    except ModelLoadError:
        raise
    except BUILD_ERRORS as e:  # a folder whose config.json does not build the model
        raise ModelLoadError(
            f"reward {name!r} could not build its model from {folder} ({config_error(e)}); "
            "check the folder's config.json."
        ) from e
    return entry.reward(name, fn)


def options_function(name: str) -> Callable[[], Any] | None:
    """The reward's `options` (() -> its section's defaults), or None."""
    return _entry(name).options


def options_of(name: str, reward_options) -> Any:
    """The reward's own section of a config's `reward_options` (its defaults when absent);
    None for a reward without settings of its own."""
    entry = _entry(name)
    if entry.options is None:
        return None
    section = reward_options.get(name) if hasattr(reward_options, "get") else None
    return entry.options() if section is None else section


def check_options(name: str, reward_options) -> str | None:
    """The sentence for the first bad value of the reward's own section, or None."""
    entry = _entry(name)
    section = options_of(name, reward_options)
    if section is None or entry.check_options is None:
        return None
    return entry.check_options(section)


def moved_fields() -> dict[str, str]:
    """Config fields that moved into some reward's own section (old path -> new path)."""
    return {old: new for e in _REGISTRY.values() for old, new in e.moved_fields.items()}


def load_rewards(
    names: Sequence[str],
    folders: Mapping[str, str],
    reward_options,
    mesh=None,
) -> dict[str, Reward]:
    """Each named reward built once: the model-based ones from their folder in `folders`
    (a config's `reward_models`), with the shared settings of `reward_options` (dtype,
    chunk_size), their own section `reward_options.<name>` and `mesh`."""
    loaded = {}
    for name in dict.fromkeys(names):
        if split_name(name):
            loaded[name] = load_instance(name, reward_options)
            continue
        if not needs_weights(name):
            loaded[name] = load_reward(name)
            continue
        section = options_of(name, reward_options)
        own = section.to_dict() if hasattr(section, "to_dict") else dict(section or {})
        common = dict(dtype=reward_options.dtype, chunk_size=reward_options.chunk_size, mesh=mesh)
        loaded[name] = load_reward(name, folders.get(name) or None, **common, **own)
    return loaded


def get_reward(name: str) -> Reward:
    """A reward that needs no weights (see `load_reward` for the others)."""
    return load_reward(name)


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


def combined_reward(
    weights: Mapping[str, float], loaded: Mapping[str, Reward] | None = None
) -> CombinedReward:
    """`combined_reward({"digit_alignment": 1.0, "jpeg_compressibility": 0.1})`.

    `loaded` holds rewards already built (e.g. by `load_reward` with a path); the others
    are built by name.
    """
    if not weights:
        raise ValueError("combined_reward needs at least one {name: weight} entry.")
    loaded = loaded or {}
    rewards = {name: loaded.get(name) or load_reward(name) for name in weights}
    return CombinedReward({n: float(w) for n, w in weights.items()}, rewards)
