"""A config's shape and types: every shared field of the schema present, each value of its
default's type (tuples element by element), no field that is not one, no field where it
moved from; `require`, which raises the one-sentence `ConfigError` (tree_grpo_jax.errors) every
config check raises. The values themselves are checks.py's."""

from __future__ import annotations

import difflib
import functools

import ml_collections

from tree_grpo_jax.config.schema import (
    declared_settings,
    flatten,
    registered_sections,
    shared_config,
)
from tree_grpo_jax.core.settings import describe, is_int, is_number
from tree_grpo_jax.errors import ConfigError
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as reward_registry


def tuple_fields() -> dict:
    """Tuple fields: path -> their elements' type (an empty default cannot tell) and a
    command-line example (the command line reads the text as a Python literal; a bare word is
    a one-entry tuple), from their declarations."""
    return {
        path: (setting.element, setting.example)
        for path, setting in declared_settings().items()
        if isinstance(setting.default, tuple)
    }


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def moved_fields() -> dict[str, str]:
    """Config fields that moved into a model family's or a reward's own section
    (old path -> new path), from their records."""
    moved = reward_registry.moved_fields()
    for family in model_registry.families():
        moved.update(family.moved_fields)
    return moved


def _has_field(config, path: str) -> bool:
    node = config
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _check_moved(config, source: str = "the config") -> None:
    for old, new in moved_fields().items():
        require(
            not _has_field(config, old),
            f"{source} sets {old}, which moved to {new}; set that instead.",
        )


# ---------------------------------------------------------------------------------------------
# Shape and types: a config holds every shared field of the schema, each of its default's type.


@functools.lru_cache(maxsize=1)
def _shared_fields() -> dict:
    """The fields every config must hold (read only): schema.py's shared ones."""
    return flatten(shared_config())


def shared_default(path: str):
    """The schema's default of the shared field `path` (`advantage.node_mix`)."""
    return _shared_fields()[path]


def _known_fields() -> tuple[dict, dict, tuple[str, ...]]:
    """The fields a config must hold, every field it may hold (path -> default), and the
    sections whose fields no record declares (any go). The registered records' sections
    may be left out: their records' defaults apply."""
    shared, fields, open_sections = _shared_fields(), {}, []
    for path, default in registered_sections().items():
        fields[path] = ml_collections.ConfigDict() if default is None else default
        if default is None:
            open_sections.append(path)
        elif isinstance(default, ml_collections.ConfigDict):
            fields.update(flatten(default, f"{path}."))
    return shared, {**fields, **shared}, tuple(open_sections)


def check_shape(config, source: str = "the config") -> None:
    """Refuses, in one sentence, a config that is not a ConfigDict holding every shared
    section and field of the schema (`base_config()`), or that
    sets a field nothing reads (a typo). `source` names the config in the sentence (the
    command line: its file's get_config())."""
    what = "None" if config is None else f"a {type(config).__name__}"
    require(
        isinstance(config, ml_collections.ConfigDict),
        f"{source} is {what}, not an ml_collections ConfigDict; start it from "
        "tree_grpo_jax.config.base_config().",
    )
    _check_moved(config, source)
    shared, fields, open_sections = _known_fields()
    have = flatten(config)
    for path, default in shared.items():
        require(
            path in have,
            f"{source} lacks {path}; start it from tree_grpo_jax.config.base_config().",
        )
        if isinstance(default, ml_collections.ConfigDict):  # its fields are checked next
            require(
                isinstance(have[path], ml_collections.ConfigDict),
                f"{path} must be a section (a ConfigDict, as in "
                f"tree_grpo_jax.config.base_config()), got {describe(have[path])}.",
            )
    for path in have:
        if path in fields or any(path.startswith(f"{s}.") for s in open_sections):
            continue
        close = difflib.get_close_matches(path, list(fields), n=1)
        hint = (
            f"; did you mean {close[0]}?"
            if close
            else " (tree_grpo_jax.config.base_config() holds them all)."
        )
        raise ConfigError(f"{source} sets {path}, which is not a config field{hint}")


def _element_sentence(path: str, kind, example: str, value) -> str | None:
    names = {int: "ints", float: "numbers", str: "strings", bool: "bools"}
    fits = {int: is_int, float: is_number, bool: lambda v: isinstance(v, bool)}.get(
        kind, lambda v: isinstance(v, kind)
    )
    if not isinstance(value, (tuple, list)) or (
        kind is not None and not all(fits(v) for v in value)
    ):
        of = f" of {names.get(kind, kind.__name__ + 's')}" if kind is not None else ""
        return f"{path} must be a tuple{of}, e.g. --config.{path}={example}; got {describe(value)}."
    comma = next((v for v in value if isinstance(v, str) and "," in v), None)
    if comma is not None:  # `--config.x=a,b` is the one entry 'a,b'
        return f"{path} entry {comma!r} holds a comma; quote each entry: --config.{path}={example}."
    return None


def _type_sentence(path: str, default, value) -> str | None:
    """One sentence when `value` is not of the type of `default` (the schema's), else None."""
    got = describe(value)
    if isinstance(default, ml_collections.ConfigDict):
        if isinstance(value, ml_collections.ConfigDict):
            return None
        return (
            f"{path} must be a section (a ConfigDict, as in "
            f"tree_grpo_jax.config.base_config()), got {got}."
        )
    if isinstance(default, bool):
        if isinstance(value, bool):
            return None
        return f"{path} must be True or False, e.g. --config.{path}={not default}; got {got}."
    if isinstance(default, int):
        if is_int(value):
            return None
        return f"{path} must be a whole number, e.g. --config.{path}={default}; got {got}."
    if isinstance(default, float):
        if is_number(value):
            return None
        return f"{path} must be a finite number, e.g. --config.{path}={default}; got {got}."
    if isinstance(default, str):
        if isinstance(value, str):
            return None
        example = f", e.g. --config.{path}={default}" if default else ""
        return f"{path} must be a string{example}; got {got}."
    if isinstance(default, tuple):
        kind = type(default[0]) if default else None
        kind, example = tuple_fields().get(path, (kind, f"'{default!r}'"))
        return _element_sentence(path, kind, example, value)
    return None


def check_types(config) -> None:
    """Every field of the schema (the registered sections' too) has its default's type: a
    bool is True/False, an int a whole number, a float a finite number, a tuple a tuple (or
    list) of its elements' type; a field declared to take several types is its check's."""
    _, fields, _ = _known_fields()
    declared = declared_settings()
    have = flatten(config)
    for path, default in fields.items():
        if path in have and not (path in declared and declared[path].any_type):
            sentence = _type_sentence(path, default, have[path])
            require(sentence is None, sentence)


def check_ranges(config) -> None:
    """Every declared field the config holds within its declared range or choices (its type
    checked before)."""
    have = flatten(config)
    for path, setting in declared_settings().items():
        if path in have:
            sentence = setting.sentence(path, have[path])
            require(sentence is None, sentence)
