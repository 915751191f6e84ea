"""A run's config: its schema (every field with its default) and the checks that turn a bad
value into one sentence.

schema   `base_config()`: the shared fields, and the sections the registered model families
         and rewards declare, each default written once (in the record that reads it);
         `saved_config` (a run's config.json read today); `flatten` (a ConfigDict as dotted
         fields)
shape    `check_shape`, `check_types` (every field present, of its default's type),
         `ConfigError`
checks   `validate` (each value), the reward string's syntax

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
    parse_rewards,
    validate,
)
from tree_grpo_jax.config.schema import (
    base_config,
    flatten,
    registered_sections,
    saved_config,
    shared_config,
)
from tree_grpo_jax.config.shape import (
    TUPLE_FIELDS,
    ConfigError,
    check_shape,
    check_types,
    moved_fields,
    tuple_fields,
)

__all__ = [
    "GUARD_ACTIONS",
    "LR_SCHEDULES",
    "SEED_LIMIT",
    "TUPLE_FIELDS",
    "WIDTH_PRUNING",
    "ConfigError",
    "base_config",
    "check_shape",
    "check_types",
    "flatten",
    "guard_on",
    "moved_fields",
    "parse_rewards",
    "registered_sections",
    "saved_config",
    "shared_config",
    "tuple_fields",
    "validate",
]
