"""Evaluate like the papers: base model against trained checkpoint.

    python -m tree_grpo_jax.evaluate --workdir=<a training run>

The command lives in `tree_grpo_jax.cli.evaluate`; this module is its `python -m` entry point.
"""

from tree_grpo_jax.cli.evaluate import run

if __name__ == "__main__":
    run()
