"""A run's config: its schema (every field with its default) and the checks that turn a bad
value into one sentence. Each setting is declared once, a `Setting` (tree_grpo_jax.core.
settings: default, type, range or choices, meaning), in the record that reads it; the
defaults, the type checks and the range sentences come from the declarations.

schema   `base_config()`: the shared fields' declarations, and the sections the registered
         model families, objectives and rewards declare, each in the record that reads it;
         `saved_config` (a run's config.json read today); `flatten` (a ConfigDict as dotted
         fields)
shape    `check_shape`, `check_types` (every field present, of its default's type),
         `check_ranges` (each declared value within its range or choices)
checks   `validate` (every check, and the rules spanning fields)
reference `markdown()`: docs/settings.md, every setting's table row from its declaration

A bad value is a `ConfigError` (tree_grpo_jax.errors), one sentence; the reward string's
syntax is the rewards package's (`rewards.registry.parse_rewards`).

An experiment file starts from the schema:

    from tree_grpo_jax.config import base_config

    def get_config():
        c = base_config()
        c.train.iterations = 50
        return c
"""

from tree_grpo_jax.config.checks import (
    GUARD_ACTIONS,
    LR_SCHEDULES,
    SEED_LIMIT,
    WIDTH_PRUNING,
    guard_on,
    validate,
)
from tree_grpo_jax.config.schema import (
    base_config,
    declared_settings,
    flatten,
    registered_sections,
    saved_config,
    shared_config,
)
from tree_grpo_jax.config.shape import (
    check_ranges,
    check_shape,
    check_types,
    moved_fields,
    tuple_fields,
)
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.errors import ConfigError

__all__ = [
    "GUARD_ACTIONS",
    "LR_SCHEDULES",
    "SEED_LIMIT",
    "WIDTH_PRUNING",
    "ConfigError",
    "Setting",
    "base_config",
    "check_ranges",
    "check_shape",
    "check_types",
    "declared_settings",
    "flatten",
    "guard_on",
    "moved_fields",
    "registered_sections",
    "saved_config",
    "shared_config",
    "tuple_fields",
    "validate",
]
