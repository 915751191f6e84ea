"""Train.

    python -m tree_grpo_jax.main --config=configs/tiny.py [--config.a.b=value]

The command lives in `tree_grpo_jax.cli.main`; this module is its `python -m` entry point.
"""

from tree_grpo_jax.cli.main import run

if __name__ == "__main__":
    run()
