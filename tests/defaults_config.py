"""The schema at its defaults as a config file: the `--config` of the tests that set every
field they need on the command line."""

from tree_grpo_jax.config import base_config


def get_config():
    return base_config()
