"""`python -m tree_grpo_jax.rewards.convert`: the converter's command line (`commands.main`)."""

from tree_grpo_jax import interrupts
from tree_grpo_jax.rewards import starting_converter

if __name__ == "__main__":
    starting_converter()  # done already while `python -m` imported the parent packages
    from tree_grpo_jax.rewards.convert.commands import main

    interrupts.finish(main())
