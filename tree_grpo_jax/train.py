"""Training from Python: `train(config)` runs a whole run, `setup(config)` builds one.

Both live in `tree_grpo_jax.run.loop`; this module keeps the short import path.
"""

from tree_grpo_jax.run.loop import setup, train

__all__ = ["setup", "train"]
