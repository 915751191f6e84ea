"""Install tree_grpo_jax: `pip install -e ".[test]"`."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="tree_grpo_jax",
    version="0.1.0",
    description=(
        "Online RL post-training of text-to-image diffusion and flow models with "
        "tree-structured GRPO (TreeGRPO, BranchGRPO) and flat GRPO, in JAX/Flax."
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # The config schema is tree_grpo_jax.config's; configs/ holds experiment files, passed by
    # path (--config=configs/tiny.py), and is no package of the install (a user's own
    # `configs` stays theirs).
    # assets/ holds the tiny models' weights and no Python: a data package of its own
    # (listed, so setuptools ships it without asking whether it should).
    packages=[*find_packages(include=["tree_grpo_jax", "tree_grpo_jax.*"]), "tree_grpo_jax.assets"],
    package_data={"tree_grpo_jax.assets": ["*"]},
    include_package_data=True,
    install_requires=[
        "jax>=0.6",
        "flax>=0.10",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "ml_collections>=1.0",
        "chex>=0.1.89",
        # Tokenizers, model configs, reading diffusers folders and the PyTorch export; no
        # Flax model class of theirs is used (see README, "Dependencies").
        "diffusers>=0.40",
        "transformers>=5",
        "safetensors>=0.4",
        "numpy>=1.26",
        "pillow>=10.0",
        "scikit-learn>=1.3",
        "tqdm>=4.66",
        "matplotlib>=3.7",
        "tensorboardX>=2.6",
    ],
    extras_require={
        # .parquet prompt files (tree_grpo_jax/run/prompts.py); the other formats need nothing
        "parquet": ["pyarrow>=14"],
        # torch, torchvision and open_clip only build PyTorch reference models in the tests
        # (open_clip imports torchvision, whose wheels need this torch release beside them).
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.8",  # pyproject's addopts run the suite on two workers
            "scipy>=1.11",
            "ruff>=0.6",
            "torch==2.14.1",
            "torchvision==0.29.1",
            "open-clip-torch>=2.24",
            "peft>=0.13",
            "nbclient>=0.10",  # runs notebooks/quickstart.ipynb headless
            "ipykernel>=6",
            "pyarrow>=14",  # the .parquet prompt files' test reads a real one
            # tests/parity/test_imagereward.py compares with the image-reward package (1.5),
            # which is not listed: it pins timm==0.6.13, which open-clip-torch 3 refuses
            # (timm>=1.0.17).
            # Its model code runs with timm 1.x; install it beside the extra with
            # `pip install --no-deps image-reward==1.5 fairscale==0.4.13`, as the README's test
            # line and CI do.
        ],
    },
)
