"""Models behind one interface (`TextToImageModel`), loaded by name from the config."""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models.base import TextToImageModel

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def load_model(model_config, seed: int = 0) -> TextToImageModel:
    """`model_config` has `name`, `path` and `compute_dtype` (see configs/base.py)."""
    dtype = DTYPES[model_config.compute_dtype]
    name = model_config.name
    if name in ("tiny", "tiny_flow", "random_tiny", "random_tiny_flow"):
        from tree_grpo_jax.models import tiny

        kind = "flow" if name.endswith("flow") else "ddim"
        if name.startswith("random_"):
            return tiny.build_tiny(kind, seed=seed, dtype=dtype)
        return tiny.load_tiny(kind, dtype=dtype)
    if name == "sd":
        from tree_grpo_jax.models import sd

        return sd.load_sd(model_config.path, dtype=dtype)
    raise ValueError(f"unknown model {name!r}.")
