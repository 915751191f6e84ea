"""Every setting of a training run, with its default: the package's schema
(`tree_grpo_jax.config.base_config`, tree_grpo_jax/config/schema.py, documents each field).

Kept for experiment files that start with `from configs import base` (run from the
repository's root); a file of your own, anywhere, starts from the package instead:
`from tree_grpo_jax.config import base_config`.
"""

from tree_grpo_jax.config import base_config


def get_config():
    return base_config()
