"""The preference rewards the papers train and report on, each as its official scorer computes it.

    hpsv2       HPS-v2.1: cosine of the unit image and prompt embeddings of the fine-tuned
                open_clip ViT-H-14 (no logit scale); images are resized on their longest
                side (bicubic, antialiased, in float after ToTensor) and padded to a
                square, as the hpsv2 package's scorer does.
    pickscore   PickScore_v1 (a transformers CLIP ViT-H-14): `exp(logit_scale) * cosine`,
                about 20-23 for typical images; `divisor` rescales it (Flow-GRPO divides by 26).
    aesthetic   LAION aesthetic predictor v2: the unit CLIP ViT-L/14 image embedding through
                a 768-1024-128-64-16-1 linear MLP (about 1-10); the prompt is not used.
    clip_score  `100 * max(cosine, 0)` with any transformers CLIP, as torchmetrics' CLIPScore.

Each builder takes its folder and returns `fn(images [B, H, W, C] in [0, 1], prompts)
-> [B] float32`, the image path (preprocessing, image tower, score) one jitted function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.rewards import clip, registry
from tree_grpo_jax.weights import files

CONVERT = "python -m tree_grpo_jax.rewards.convert"
HINTS = {
    "hpsv2": (
        f"convert the HPS-v2.1 release with `{CONVERT} hpsv2` and point "
        "--config.reward_models.hpsv2 at the output folder"
    ),
    "pickscore": (
        "point --config.reward_models.pickscore at a local copy of yuvalkirstain/PickScore_v1"
    ),
    "aesthetic": (
        f"convert the LAION aesthetic predictor with `{CONVERT} aesthetic` and point "
        "--config.reward_models.aesthetic at the output folder"
    ),
    "clip_score": (
        "point --config.reward_models.clip_score at a Hugging Face CLIP folder such as "
        "openai/clip-vit-large-patch14"
    ),
}
# The aesthetic MLP's linear layers, as the release names them (dropouts in between).
AESTHETIC_LAYERS = ("layers.0", "layers.2", "layers.4", "layers.6", "layers.7")
REWARD_CONFIG = "reward_config.json"
# Folders from the hub carry safetensors next to any pickle: fetch those instead.
SAFETENSORS_HINT = "fetch the folder's model.safetensors instead (the hub repositories carry one)"


def _check_converted(path: str, reward: str) -> None:
    """A converted folder says which reward it was converted for; refuse any other."""
    folder = Path(os.path.expanduser(path))
    if not os.path.isdir(folder):
        return  # load_clip says what is wrong with the path (or why it cannot be looked at)
    marker = folder / REWARD_CONFIG
    if not marker.is_file():
        raise ModelLoadError(
            f"{folder} is not a converted {reward} folder (it has no {REWARD_CONFIG}); "
            f"{HINTS[reward]}."
        )
    converted_for = files.read_json(marker, HINTS[reward]).get("reward")
    if converted_for != reward:
        raise ModelLoadError(
            f"{folder} was converted for the {converted_for!r} reward, not {reward!r}; "
            f"{HINTS[reward]}."
        )


def _image_text_reward(scorer: clip.CLIPScorer, combine: Callable) -> Callable:
    """`combine(params, image_features, prompt_features) -> [B]` behind one jitted call."""

    @jax.jit
    def score(params, images, prompt_features):
        return combine(params, scorer.image_embeddings(params, images), prompt_features)

    def reward(images, prompts: Sequence[str]) -> jax.Array:
        images = jnp.asarray(images, jnp.float32)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{len(prompts)} prompts for {images.shape[0]} images.")
        return score(scorer.params, images, scorer.prompt_embeddings(prompts))

    reward.scorer = scorer
    return reward


def _cosine(image_features, prompt_features):
    return jnp.sum(image_features * prompt_features, axis=-1)


def hpsv2(path: str, **options) -> Callable:
    """HPS-v2.1 from a folder written by `python -m tree_grpo_jax.rewards.convert hpsv2`."""
    _check_converted(path, "hpsv2")
    scorer = clip.load_clip(path, layout="resize_pad_hpsv2", hint=HINTS["hpsv2"], **options)
    return _image_text_reward(scorer, lambda params, i, t: _cosine(i, t))


def pickscore(path: str, divisor: float = 1.0, **options) -> Callable:
    """PickScore_v1 from its Hugging Face folder; `divisor` rescales (1: the authors')."""
    if not divisor or not float(divisor) > 0:
        raise ValueError(f"pickscore divisor must be a positive number, got {divisor!r}.")
    scorer = clip.load_clip(
        path,
        layout="resize_crop_hf",
        hint=HINTS["pickscore"],
        convert_hint=SAFETENSORS_HINT,
        **options,
    )

    def combine(params, image_features, prompt_features):
        scale = jnp.exp(params["logit_scale"].astype(jnp.float32))
        return scale * _cosine(image_features, prompt_features) / float(divisor)

    return _image_text_reward(scorer, combine)


def clip_score(path: str, **options) -> Callable:
    """torchmetrics' CLIPScore, `100 * max(cosine, 0)`, with any Hugging Face CLIP folder."""
    scorer = clip.load_clip(
        path,
        layout="resize_crop_hf",
        hint=HINTS["clip_score"],
        convert_hint=SAFETENSORS_HINT,
        **options,
    )
    return _image_text_reward(scorer, lambda params, i, t: 100.0 * jnp.maximum(_cosine(i, t), 0.0))


def _aesthetic_mlp(folder: Path) -> list[tuple[jax.Array, jax.Array]]:
    hint = HINTS["aesthetic"]
    path = folder / "aesthetic_mlp.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no aesthetic_mlp.safetensors; {hint}.")
    state = files.read_safetensors(path, hint)
    layers, width = [], None
    for name in AESTHETIC_LAYERS:
        weight, bias = state.get(f"{name}.weight"), state.get(f"{name}.bias")
        if weight is None or bias is None or weight.ndim != 2 or bias.shape != weight.shape[:1]:
            raise ModelLoadError(f"{path} has no valid {name} linear layer; {hint}.")
        if width is not None and weight.shape[1] != width:
            raise ModelLoadError(f"{path}: {name} takes {weight.shape[1]} inputs, not {width}.")
        width = weight.shape[0]
        layers.append((jnp.asarray(weight.T, jnp.float32), jnp.asarray(bias, jnp.float32)))
    if width != 1:
        raise ModelLoadError(f"{path} ends in {width} outputs, not one score; {hint}.")
    return layers


def aesthetic(path: str, **options) -> Callable:
    """The LAION aesthetic predictor v2 from a folder written by `... convert aesthetic`."""
    _check_converted(path, "aesthetic")
    scorer = clip.load_clip(
        path,
        layout="resize_crop_torchvision",
        towers=(clip.IMAGE,),
        hint=HINTS["aesthetic"],
        **options,
    )
    layers = _aesthetic_mlp(scorer.path)
    if layers[0][0].shape[0] != scorer.config.projection_dim:
        raise ModelLoadError(
            f"the aesthetic MLP in {scorer.path} takes {layers[0][0].shape[0]} inputs but its "
            f"CLIP embeds images in {scorer.config.projection_dim}; {HINTS['aesthetic']}."
        )

    @jax.jit
    def score(params, layers, images):
        # The release's MLP has dropouts but no nonlinearity: a chain of affine maps.
        x = scorer.image_embeddings(params, images)
        for kernel, bias in layers:
            x = jnp.dot(x, kernel, precision=jax.lax.Precision.HIGHEST) + bias
        return x[:, 0]

    def reward(images, prompts: Sequence[str]) -> jax.Array:
        del prompts  # the predictor scores the image alone
        return score(scorer.params, layers, jnp.asarray(images, jnp.float32))

    reward.scorer = scorer
    return reward


# `reward_options.pickscore`: PickScore's own settings.
PICKSCORE_SETTINGS = {
    "divisor": Setting(
        1.0,
        "the score is divided by it: 1, the authors' scale; Flow-GRPO uses 26",
        low=0,
        open_low=True,
    ),
}
pickscore_options = defaults_of(PICKSCORE_SETTINGS)


def register_all() -> None:
    """Registers the four preference rewards."""
    registry.register_model("hpsv2", hpsv2, weights="a converted HPS-v2.1 folder")
    registry.register_model(
        "pickscore",
        pickscore,
        weights="a PickScore_v1 folder",
        options=pickscore_options,
        moved_fields={"reward_options.pickscore_divisor": "reward_options.pickscore.divisor"},
    )
    registry.register_model(
        "aesthetic", aesthetic, weights="a converted LAION aesthetic predictor folder"
    )
    registry.register_model(
        "clip_score",
        clip_score,
        weights="a Hugging Face CLIP folder",
        default_path="openai/clip-vit-large-patch14",
    )
