"""Export a run's denoiser as a diffusers folder.

    python -m tree_grpo_jax.export --workdir=<a training run> --out=<folder>

The command lives in `tree_grpo_jax.cli.export`; this module is its `python -m` entry point.
"""

if __name__ == "__main__":  # the first line, and Ctrl-C, before the slow imports below
    from tree_grpo_jax.cli.common import starting

    starting("export")

from tree_grpo_jax.cli.export import run  # noqa: E402

if __name__ == "__main__":
    run()
