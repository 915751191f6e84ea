"""Model families behind one interface (`base.TextToImageModel`), loaded by name.

base    the interface, the schedule configs, `ModelLoadError`, `cast_floats`
tiny    the embedded tiny digits model (names "tiny", "tiny_flow", "random_tiny",
        "random_tiny_flow")
sd15    Stable Diffusion 1.x from a diffusers folder (name "sd")
sd3     Stable Diffusion 3 / 3.5 (MMDiT, flow matching) from a diffusers folder (name "sd3")
convert PyTorch-named weights <-> Flax param trees (numpy only)
files   reading safetensors, msgpack and JSON files, each failure one sentence
"""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models.base import TextToImageModel

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TINY_NAMES = ("tiny", "tiny_flow", "random_tiny", "random_tiny_flow")
MODEL_NAMES = (*TINY_NAMES, "sd", "sd3")


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
    if name == "sd3":
        from tree_grpo_jax.models.sd3.load import load_sd3

        return load_sd3(
            model_config.path,
            dtype=dtype,
            use_t5=model_config.use_t5,
            t5_max_length=model_config.t5_max_length,
            sample_size=model_config.sample_size or None,
        )
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}.")
