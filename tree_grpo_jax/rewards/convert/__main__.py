"""`python -m tree_grpo_jax.rewards.convert`: the converter's command line (`commands.main`)."""

import sys

from tree_grpo_jax.rewards.convert.commands import main

if __name__ == "__main__":
    sys.exit(main())
