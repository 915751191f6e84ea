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
builder as keyword arguments. A config's reward string (`"a,b:0.1,remote:judge:0.5"`) is
read by `parse_rewards`; several rewards combine into one weighted sum with
`combined_reward`. `load_rewards` builds what a run's config names; nothing outside a
reward's own module needs to know its name. A reward family (`register_family`) names its
rewards `<family>:<instance>`, each with its own settings (`families.py`); the `Reward`
record and the errors a reward raises are `base.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tree_grpo_jax.errors import ConfigError
from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.rewards import families
from tree_grpo_jax.rewards.base import CombinedReward, Reward, RewardFn, check_media

# The family readers the config package asks this module for.
from tree_grpo_jax.rewards.families import check_instances as check_instances
from tree_grpo_jax.rewards.families import reward_families as reward_families
from tree_grpo_jax.rewards.families import split_name as split_name


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
    takes_input_images: bool = False  # as `Reward.takes_input_images`

    def reward(self, name: str, fn: RewardFn) -> Reward:
        return Reward(
            name,
            fn,
            self.on_host,
            self.media,
            self.per_frame,
            self.takes_metadata,
            self.takes_input_images,
        )


_REGISTRY: dict[str, _Entry] = {}

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
    takes_input_images: bool = False,
    overwrite: bool = False,
) -> Reward:
    """Adds a reward that needs no weights; registering a taken name needs `overwrite=True`.

    `media` is what `fn` takes ("image": [B, H, W, C], "video": [B, T, H, W, C]); an image
    reward scores videos frame by frame unless `per_frame=False`; with `takes_metadata`
    it is called `fn(images, prompts, metadata)`, and with `takes_input_images` it also
    gets `input_images=` (see `Reward`)."""

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
        takes_input_images=bool(takes_input_images),
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
    check_media(name, media)
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
    input_images_of: Callable[[Any], bool] = lambda settings: False,
) -> None:
    """Adds a family of rewards named `<family>:<instance>` in a run's `rewards`, each built
    by `make(instance, settings)` from `reward_options.<family>.<instance>` (the defaults
    `options()`, the checks `check_options(instance, settings)`); `probe` says in one
    sentence why an instance cannot score now (its server down), before a run writes
    anything; `input_images_of(settings)` says whether an instance takes input images."""
    if ":" in family or family in _REGISTRY:
        raise ValueError(f"reward family {family!r} would shadow a reward name.")
    record = families.Family(
        make,
        options,
        check_options,
        probe,
        bool(on_host),
        bool(takes_metadata),
        media_of,
        describe,
        input_images_of,
    )
    families.add(family, record)


def is_known(name: str) -> bool:
    """A registered reward's name, or a registered family's `<family>:<instance>`."""
    return name in available_rewards() or split_name(name) is not None


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


def parse_rewards(text: str) -> dict[str, float]:
    """A config's reward string as weights: `"a"` -> {a: 1.0}; `"a:1,b:0.1"` -> {a: 1.0,
    b: 0.1}; a reward family's member is `family:name[:weight]` (`"remote:judge:0.5"` ->
    {remote:judge: 0.5}). The one reader of that syntax; ConfigError with one sentence."""
    weights = {}
    for part in str(text).split(","):
        name, _, weight = part.strip().partition(":")
        if not name:
            raise ConfigError(f"rewards {text!r} has an empty entry; write name[:weight],...")
        if name in reward_families():
            member, _, weight = weight.partition(":")
            if not member:
                raise ConfigError(
                    f"rewards entry {part.strip()!r} names no {name} reward; write "
                    f"{name}:<name>[:weight] with its settings in reward_options.{name}.<name>."
                )
            name = f"{name}:{member}"
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(
                f"reward weight {weight!r} of {name!r} is not a number; write name:weight."
            ) from None
    return weights


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
            loaded[name] = families.load_instance(name, reward_options)
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
