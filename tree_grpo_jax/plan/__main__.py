"""Will a run fit? Its programs' per-device memory, before any weight is read.

    python -m tree_grpo_jax.plan --config=configs/sd35m.py

The command lives in `tree_grpo_jax.plan.command`; this module is its `python -m` entry point.
"""

from tree_grpo_jax.plan.command import run

if __name__ == "__main__":
    run()
