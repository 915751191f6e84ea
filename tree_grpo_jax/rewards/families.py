"""Reward families: rewards named `<family>:<instance>` (`remote:judge`), each built from its
own settings `reward_options.<family>.<instance>`. A family is registered with
`registry.register_family`; this module holds the families and reads, checks, probes and
builds their instances from a run's config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tree_grpo_jax.rewards.base import Reward, RewardFn


@dataclasses.dataclass(frozen=True)
class Family:
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
    # whether an instance takes input images, from its settings
    input_images_of: Callable[[Any], bool] = lambda settings: False


_FAMILIES: dict[str, Family] = {}


def add(family: str, record: Family) -> None:
    """Adds (or replaces) the family `family` (`registry.register_family` checks the name)."""
    _FAMILIES[family] = record


def reward_families() -> tuple[str, ...]:
    """The registered families (`remote`): their rewards are `<family>:<instance>`."""
    return tuple(sorted(_FAMILIES))


def split_name(name: str) -> tuple[str, str] | None:
    """(family, instance) of a family's reward name (`remote:judge`), else None."""
    family, sep, instance = name.partition(":")
    return (family, instance) if sep and family in _FAMILIES else None


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
        takes_input_images=bool(entry.input_images_of(settings)),
    )
