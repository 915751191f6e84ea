"""ImageReward (THUDM, v1.0): a BLIP image-text model fine-tuned on human preference ranks.

    reward = load_reward("imagereward", "/models/imagereward")   # a converted folder
    scores = reward(images, prompts)   # [B, H, W, 3] in [0, 1], B prompts -> [B] float32

The model, as the release's `ImageReward.score` runs it:

* images: quantized to 8 bits, bicubic resize of the short side to 224 and a centre crop
  (torchvision on a PIL image), OpenAI CLIP's mean and std (`preprocess`);
* BLIP's ViT (ViT-L/16 in the release: pre-norm blocks, LayerNorm eps 1e-6, exact GELU) turns
  them into `[B, 1 + (224/16)^2, width]` image tokens;
* the prompt, tokenized by bert-base-uncased's WordPiece (with BLIP's added `[DEC]` and
  `[ENC]` tokens) and padded or truncated to 35 tokens, goes through BLIP's BERT, whose every
  layer self-attends over the prompt (padding masked with -10000) and cross-attends to all
  image tokens; the first token's (`[CLS]`) last hidden state is the text feature;
* an MLP head, five linear layers 768-1024-128-64-16-1 with dropouts and no activation,
  and the published normalisation `(r - 0.16717) / 1.03334`.

Folders come from `python -m tree_grpo_jax.rewards.convert imagereward` (`config.json`, the
release's tensors in `model.safetensors`, the tokenizer files, `reward_config.json`). The
parameters are frozen: replicated over the mesh, or sharded over its `fsdp` axis.

model     the Flax network and its config (`ImageRewardConfig`, `ImageRewardModel`)
here      the scorer (tokens, preprocessing, chunked scoring), the loader, the registration
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import DTYPES, ModelLoadError, cast_floats
from tree_grpo_jax.rewards import preprocess, registry
from tree_grpo_jax.rewards.imagereward.model import (
    HINT,
    MAX_LENGTH,
    NAME,
    SCORE_MEAN,
    SCORE_STD,
    ImageRewardConfig,
    ImageRewardModel,
    TextEncoder,
    VisionTransformer,
    reference_shapes,
)
from tree_grpo_jax.weights import convert, files

REWARD_CONFIG = "reward_config.json"
# The release's tensors the score reads (its BLIP also holds contrastive projections).
WEIGHT_PREFIXES = ("blip.visual_encoder.", "blip.text_encoder.", "mlp.")
# The WordPiece vocabulary (hub folders, transformers 4), or all transformers 5 saves.
BERT_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageRewardScorer:
    """A frozen ImageReward: its module, parameters, tokenizer and preprocessing."""

    path: Path | None
    config: ImageRewardConfig
    module: ImageRewardModel
    params: Any
    tokenizer: Any  # transformers.BertTokenizer with BLIP's added tokens
    chunk_size: int
    _token_cache: dict = dataclasses.field(default_factory=dict)

    def preprocess(self, images) -> jax.Array:
        """[B, H, W, C] in [0, 1] -> pixels [B, S, S, 3], as the release's transform."""
        size = self.config.image_size
        return preprocess.make_preprocess("resize_crop_torchvision", size)(images)

    def tokens(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention masks [B, max_length] int32, each prompt tokenized once."""
        new = list(dict.fromkeys(p for p in prompts if p not in self._token_cache))
        if new:
            enc = self.tokenizer(
                new,
                padding="max_length",
                truncation=True,
                max_length=self.config.max_length,
                return_tensors="np",
            )
            rows = zip(enc.input_ids.astype(np.int32), enc.attention_mask.astype(np.int32))
            self._token_cache.update(zip(new, rows, strict=True))
        ids, mask = zip(*(self._token_cache[p] for p in prompts), strict=True)
        return np.stack(ids), np.stack(mask)

    def features(self, params, images, ids, mask):
        """(image tokens [B, N, Wv], text features [B, Wt], rewards [B]), float32; pure,
        `chunk_size` pairs at a time."""
        pixels = self.preprocess(images)

        def one(pair):
            pixel, i, m = pair
            out = self.module.apply({"params": params}, pixel[None], i[None], m[None])
            return tuple(o[0].astype(jnp.float32) for o in out)

        return jax.lax.map(one, (pixels, ids, mask), batch_size=self.chunk_size)

    def rewards(self, params, images, ids, mask) -> jax.Array:
        return self.features(params, images, ids, mask)[2]

    def _inputs(self, images, prompts: Sequence[str]):
        images = jnp.asarray(images, jnp.float32)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{len(prompts)} prompts for {images.shape[0]} images.")
        return (images, *self.tokens(prompts))

    def __call__(self, images, prompts: Sequence[str]) -> jax.Array:
        """Rewards [B] float32 of images [B, H, W, C] in [0, 1] and their prompts."""
        return _rewards(self, self.params, *self._inputs(images, prompts))

    def image_text_features(self, images, prompts: Sequence[str]):
        """`features` of images and prompts: image tokens, text features and rewards."""
        return _features(self, self.params, *self._inputs(images, prompts))


_rewards = jax.jit(ImageRewardScorer.rewards, static_argnums=0)
_features = jax.jit(ImageRewardScorer.features, static_argnums=0)


def make_scorer(
    config: ImageRewardConfig,
    params,
    tokenizer,
    *,
    dtype: str = "float32",
    chunk_size: int = 16,
    mesh=None,
    path: Path | None = None,
) -> ImageRewardScorer:
    """A scorer from a config, Flax params and a tokenizer (`load` reads all three)."""
    from tree_grpo_jax.rewards import clip

    clip.check_scorer_options(dtype, chunk_size)
    return ImageRewardScorer(
        path=path,
        config=config,
        module=ImageRewardModel(config, DTYPES[dtype]),
        params=clip.place(cast_floats(params, DTYPES[dtype]), mesh),
        tokenizer=tokenizer,
        chunk_size=int(chunk_size),
    )


def _tokenizer(folder: Path, config: ImageRewardConfig):
    from transformers import BertTokenizer, BertTokenizerFast

    if not any((folder / name).is_file() for name in BERT_TOKENIZER_FILES):
        raise ModelLoadError(f"{folder} has no tokenizer (vocab.txt or tokenizer.json); {HINT}.")
    tokenizer_class = files.tokenizer_class(
        folder, BERT_TOKENIZER_FILES[:1], BertTokenizer, BertTokenizerFast
    )
    try:
        tokenizer = tokenizer_class.from_pretrained(str(folder))
    except Exception as e:  # a broken tokenizer is a load error
        raise ModelLoadError(f"could not read the tokenizer in {folder}: {e}; {HINT}.") from None
    if len(tokenizer) > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {folder} has {len(tokenizer)} tokens but the text encoder embeds "
            f"only {config.vocab_size}; {HINT}."
        )
    return tokenizer


def load(path: str, **options) -> ImageRewardScorer:
    """The scorer in a converted folder; `options` (dtype, chunk_size, mesh) go to
    `make_scorer`. Every problem with the folder is one ModelLoadError sentence."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"ImageReward folder {folder} does not exist; {HINT}.")
    marker = folder / REWARD_CONFIG
    if not marker.is_file():
        raise ModelLoadError(
            f"{folder} is not a converted ImageReward folder (it has no {REWARD_CONFIG}); {HINT}."
        )
    converted_for = files.read_json(marker, HINT).get("reward")
    if converted_for != NAME:
        raise ModelLoadError(
            f"{folder} was converted for the {converted_for!r} reward, not {NAME!r}; {HINT}."
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; {HINT}.")
    raw = files.read_json(folder / "config.json", HINT)
    config = ImageRewardConfig.from_dict(raw, f"{folder}/config.json")
    state = files.read_safetensors_stem(folder, "model", HINT)
    if state is None:
        raise ModelLoadError(f"{folder} has no model.safetensors; {HINT}.")
    state = {k: v for k, v in state.items() if k.startswith(WEIGHT_PREFIXES)}
    try:
        params = convert.pytorch_to_flax(state, reference_shapes(config), merge_indices=True)
    except convert.ParamTreeMismatch as e:
        raise ModelLoadError(
            f"the weights in {folder} do not match its config.json ({e}); {HINT}."
        ) from None
    return make_scorer(config, params, _tokenizer(folder, config), path=folder, **options)


def imagereward(path: str, **options):
    """The reward function of a converted folder: (images, prompts) -> [B] float32."""
    scorer = load(path, **options)

    def reward(images, prompts: Sequence[str]) -> jax.Array:
        return scorer(images, prompts)

    reward.scorer = scorer
    return reward


def register() -> None:
    registry.register_model(NAME, imagereward, weights="a converted ImageReward folder")


__all__ = [
    "HINT",
    "MAX_LENGTH",
    "SCORE_MEAN",
    "SCORE_STD",
    "ImageRewardConfig",
    "ImageRewardModel",
    "ImageRewardScorer",
    "TextEncoder",
    "VisionTransformer",
    "imagereward",
    "load",
    "make_scorer",
    "reference_shapes",
    "register",
]
