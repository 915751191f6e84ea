"""Pictures from a trained run's checkpoint.

    python -m tree_grpo_jax.sample --workdir=<a training run>

The command lives in `tree_grpo_jax.cli.sample`; this module is its `python -m` entry point.
"""

from tree_grpo_jax.cli.sample import run

if __name__ == "__main__":
    run()
