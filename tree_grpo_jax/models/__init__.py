"""Model families behind one interface (`base.TextToImageModel`), found through their records.

base           the interface, the schedule configs, the dtypes, `cast_floats`
media          what `decode` gives: images [B, H, W, C] or videos [B, T, H, W, C]
registry       `ModelFamily` records and `load_model`: every family registers one
abstract       a model as shapes, for the memory plan
export         trained denoiser params -> a diffusers pipeline folder (shared by the families)
clip           CLIP's text and vision towers in Flax (the rewards' and text encoders' CLIP)
text_encoders  the text side the T5 families share (Flax T5, CLIP and T5 loading, caching)
decoder_text   decoder-only language models (Qwen2 / 2.5-VL, Qwen3, Mistral) as prompt encoders
autoencoder    the 16-channel VAE decoder the flow families share
tiny           the embedded tiny digits model
sd15           Stable Diffusion 1.x from a diffusers folder
sd3            Stable Diffusion 3 / 3.5 (MMDiT, flow matching) from a diffusers folder
flux           FLUX.1 dev and schnell (flow matching) from a diffusers folder
wan            Wan2.1 text-to-video (flow matching; videos) from a diffusers folder

A new family is one sub-package with a `family.py` that registers its `ModelFamily`
(`registry.register`); nothing outside its sub-package names it.
"""

from __future__ import annotations

from tree_grpo_jax.models.base import TextToImageModel
from tree_grpo_jax.models.registry import ModelFamily, family_of, load_model, register

__all__ = ["ModelFamily", "TextToImageModel", "family_of", "load_model", "register"]
