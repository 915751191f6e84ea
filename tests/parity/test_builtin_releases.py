"""The built-in release configs of the 2026 families plan the released models: diffusers
builds each transformer from the same `transformer/config.json` (on the meta device, no
memory) with exactly as many parameters as the plan's shapes hold, and transformers reads
the text encoder's config with the width the transformer takes."""

from __future__ import annotations

import importlib

import jax
import ml_collections
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tree_grpo_jax.models import registry  # noqa: E402

# The decoder-text families' conditioning: 512 prompt states and the mask; latents 16 channels
# at 1/8 of 1024 px. FLUX.2's: 512 tokens of three stacked states; 2x2 patches of 32 channels
# at 1/16 of 1024 px.
MASKED, STACKED = (512, 1, 1), (512, 0, 3)  # (tokens, mask features, states per token)
LATENTS, PATCHES = (16, 128, 128), (128, 64, 64)
RELEASES = {
    # family, diffusers class, the text encoder's width, published size (B), conditioning,
    # one latent's shape
    "qwen-image": ("qwenimage", "QwenImageTransformer2DModel", 3584, 20, MASKED, LATENTS),
    "z-image-turbo": ("zimage", "ZImageTransformer2DModel", 2560, 6, MASKED, LATENTS),
    "flux2-dev": ("flux2", "Flux2Transformer2DModel", 5120, 32, STACKED, PATCHES),
    "flux2-klein-4b": ("flux2", "Flux2Transformer2DModel", 2560, 4, STACKED, PATCHES),
    "flux2-klein-9b": ("flux2", "Flux2Transformer2DModel", 4096, 9, STACKED, PATCHES),
}


def _planned(family: str, name: str):
    section = ml_collections.ConfigDict(
        {"name": family, "path": f"builtin:{name}", "compute_dtype": "bfloat16"}
    )
    section[family] = registry.family_of(family).options()
    return registry.abstract_model(section)


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_the_plan_holds_the_released_transformer(name):
    from transformers import AutoConfig

    family, class_name, width, billions, (tokens, mask, states), latent = RELEASES[name]
    planned = _planned(family, name)
    configs = importlib.import_module(f"tree_grpo_jax.models.{family}.builtin")
    configs = configs.RELEASES[name].configs
    config = dict(configs["transformer/config.json"])
    with torch.device("meta"):
        reference = getattr(diffusers, class_name).from_config(config)
    theirs = sum(p.numel() for p in reference.parameters())
    ours = sum(x.size for x in jax.tree_util.tree_leaves(planned.params))
    assert ours == theirs and round(theirs / 1e9) == billions, (ours, theirs)
    text = dict(configs["text_encoder/config.json"])
    text_config = AutoConfig.for_model(text.pop("model_type"), **text)
    text_config = getattr(text_config, "text_config", text_config)
    assert text_config.hidden_size == width
    # the conditioning: the family's default prompt length, the text states (and the mask)
    assert planned.cond_shape == (tokens, states * width + mask)
    assert planned.sample_shape == latent  # at the default 1024 px
