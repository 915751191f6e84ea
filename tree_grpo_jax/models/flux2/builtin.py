"""FLUX.2's JSON configs as data: `model.path=builtin:flux2-dev`, `builtin:flux2-klein-4b` and
`builtin:flux2-klein-9b` plan a run on the public releases (black-forest-labs/FLUX.2-dev,
FLUX.2-klein-4B, FLUX.2-klein-9B) without any of their files.

The values are the releases' `transformer/config.json` (`transformer.RELEASED_CONFIGS`, as
diffusers' converter writes them), `vae/config.json` (`vae.FLUX2_DEV_VAE`, the one VAE all
three ship), `scheduler/scheduler_config.json` and the text encoder's `config.json` (dev:
Mistral Small 3.1 24B; klein: Qwen3-4B and Qwen3-8B). The scheduler is FLUX.1-dev's:
diffusers' converter (huggingface/diffusers, scripts/convert_flux2_to_diffusers.py, `main`)
saves `FlowMatchEulerDiscreteScheduler.from_pretrained("black-forest-labs/FLUX.1-dev",
subfolder="scheduler")` with every FLUX.2 pipeline: dynamic shifting, base and max shift 0.5
and 1.15 over 256 to 4096 tokens, which the pipelines override by passing their own mu.
"""

from __future__ import annotations

from tree_grpo_jax.models import builtin_configs
from tree_grpo_jax.models.abstract import BuiltinRelease
from tree_grpo_jax.models.flux2 import transformer, vae

SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def _release(hub_id: str, name: str, text_encoder: dict) -> BuiltinRelease:
    return BuiltinRelease(
        hub_id=hub_id,
        configs={
            "transformer/config.json": transformer.builtin_config(name),
            "vae/config.json": dict(vae.FLUX2_DEV_VAE),
            "scheduler/scheduler_config.json": SCHEDULER,
            "text_encoder/config.json": text_encoder,
        },
    )


RELEASES = {
    "flux2-dev": _release(
        "black-forest-labs/FLUX.2-dev", "flux2-dev", builtin_configs.MISTRAL_SMALL_31_24B
    ),
    "flux2-klein-4b": _release(
        "black-forest-labs/FLUX.2-klein-4B", "flux2-klein-4b", builtin_configs.QWEN3_4B
    ),
    "flux2-klein-9b": _release(
        "black-forest-labs/FLUX.2-klein-9B", "flux2-klein-9b", builtin_configs.QWEN3_8B
    ),
}
