"""Model families behind one interface (`base.TextToImageModel`), loaded by name.

base    the interface, the schedule configs, `ModelLoadError`, `cast_floats`
tiny    the embedded tiny digits model (names "tiny", "tiny_flow", "random_tiny",
        "random_tiny_flow")
sd15    Stable Diffusion 1.x from a diffusers folder (name "sd")
convert PyTorch-named weights <-> Flax param trees (numpy only)
files   reading safetensors, msgpack and JSON files, each failure one sentence
"""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models.base import TextToImageModel

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TINY_NAMES = ("tiny", "tiny_flow", "random_tiny", "random_tiny_flow")
MODEL_NAMES = (*TINY_NAMES, "sd")


def load_model(model_config, seed: int = 0) -> TextToImageModel:
    """`model_config` has `name`, `path` and `compute_dtype` (see configs/base.py)."""
    dtype = DTYPES[model_config.compute_dtype]
    name = model_config.name
    if name in TINY_NAMES:
        from tree_grpo_jax.models import tiny

        kind = "flow" if name.endswith("flow") else "ddim"
        if name.startswith("random_"):
            return tiny.build_tiny(kind, seed=seed, dtype=dtype)
        return tiny.load_tiny(kind, dtype=dtype)
    if name == "sd":
        from tree_grpo_jax.models import sd15

        return sd15.load_sd(model_config.path, dtype=dtype)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}.")
