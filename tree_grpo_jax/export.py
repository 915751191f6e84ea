"""Export a run's denoiser as a diffusers folder.

    python -m tree_grpo_jax.export --workdir=<a training run> --out=<folder>

The command lives in `tree_grpo_jax.cli.export`; this module is its `python -m` entry point.
"""

from tree_grpo_jax.cli.export import run

if __name__ == "__main__":
    run()
