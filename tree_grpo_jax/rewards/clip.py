"""A frozen CLIP that embeds images and prompts, the core of the preference rewards.

The towers are the package's Flax CLIP (`models.clip.CLIPModel`), read from a Hugging Face
CLIP folder (`config.json` plus `model.safetensors` or `flax_model.msgpack`; pickles are
refused). Images go through the scorer's own preprocessing (`rewards.preprocess`) and the
image tower inside one jitted function, `chunk_size` images at a time to bound activation
memory. Prompt embeddings are computed once per distinct prompt and cached on the host.
The parameters are never trained: they live outside the optimizer, replicated over the
mesh, or sharded over its `fsdp` axis when it has one (ViT-H is 1B parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax import errors, sharding
from tree_grpo_jax.models import clip as clip_model
from tree_grpo_jax.models import clip_files
from tree_grpo_jax.models.base import DTYPES, ModelLoadError, cast_floats
from tree_grpo_jax.weights import convert, files

IMAGE, TEXT = "image", "text"
# PyTorch key prefixes of each tower in a transformers CLIP safetensors file.
_TOWER_PREFIXES = {
    IMAGE: ("vision_model.", "visual_projection."),
    TEXT: ("text_model.", "text_projection."),
}
# Flax top-level names of each tower.
_TOWER_MODULES = {
    IMAGE: ("vision_model", "visual_projection"),
    TEXT: ("text_model", "text_projection"),
}
_HUB_PATTERNS = ["*.json", "*.txt", "model.safetensors", "model.safetensors.index.json"]


def _next_bucket(n: int) -> int:
    """Prompt batches are padded to 8, 16, 32, ... so new prompts rarely recompile."""
    return max(8, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True, eq=False)
class CLIPScorer:
    """L2-normalised image and prompt embeddings of one frozen CLIP."""

    path: Path | None  # the folder it was read from
    config: Any  # transformers.CLIPConfig
    module: clip_model.CLIPModel
    params: Any  # the towers loaded (see `towers`), on device
    towers: tuple[str, ...]
    tokenizer: Any  # transformers.CLIPTokenizer, or None without the text tower
    preprocess: Callable  # images [B, H, W, C] in [0, 1] -> pixels [B, S, S, 3]
    chunk_size: int
    max_length: int
    _prompt_cache: dict = dataclasses.field(default_factory=dict)

    @property
    def logit_scale(self) -> jax.Array:
        return jnp.exp(self.params["logit_scale"].astype(jnp.float32))

    def image_embeddings(self, params, images) -> jax.Array:
        """[B, H, W, C] in [0, 1] -> [B, E] float32 unit vectors; pure, call it under jit."""
        chex.assert_rank(images, 4)
        pixels = self.preprocess(images)

        def embed(pixel):  # one image; lax.map vmaps it over chunks of `chunk_size`
            return self.module.apply(
                {"params": params},
                pixel[None].astype(self.module.dtype),
                method=clip_model.CLIPModel.get_image_features,
            )[0]

        features = jax.lax.map(embed, pixels, batch_size=self.chunk_size).astype(jnp.float32)
        return features / jnp.linalg.norm(features, axis=-1, keepdims=True)

    def token_embeddings(self, params, ids, mask) -> jax.Array:
        """Token ids and attention mask [B, T] -> [B, E] float32 unit vectors; pure."""
        features = self.module.apply(
            {"params": params}, ids, mask, method=clip_model.CLIPModel.get_text_features
        )
        features = features.astype(jnp.float32)
        return features / jnp.linalg.norm(features, axis=-1, keepdims=True)

    def prompt_embeddings(self, prompts: Sequence[str]) -> jax.Array:
        """[B, E] float32 unit vectors, each distinct prompt encoded once and then cached."""
        if self.tokenizer is None:
            raise ValueError(f"the CLIP in {self.path} was loaded without its text tower.")
        new = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        if new:
            tokens = self.tokenizer(
                new,
                padding="max_length",
                max_length=self.max_length,
                truncation=True,
                return_tensors="np",
            )
            rows = _next_bucket(len(new))
            ids = np.zeros((rows, self.max_length), np.int32)
            mask = np.zeros((rows, self.max_length), np.int32)
            ids[: len(new)] = tokens.input_ids
            mask[: len(new)] = tokens.attention_mask
            mask[len(new) :, 0] = 1  # padding rows: one attended token keeps them finite
            features = np.asarray(_token_embeddings(self, self.params, ids, mask))
            self._prompt_cache.update(zip(new, features[: len(new)], strict=True))
        return jnp.asarray(np.stack([self._prompt_cache[p] for p in prompts]))


_token_embeddings = jax.jit(CLIPScorer.token_embeddings, static_argnums=0)


def _clip_config(folder: Path, hint: str):
    from transformers import CLIPConfig

    raw = files.read_json(folder / "config.json", hint)
    model_type = raw.get("model_type")
    if model_type != "clip" or "vision_config" not in raw:
        raise ModelLoadError(
            f"{folder} holds a {model_type or 'non-CLIP'} model, not a CLIP model with both "
            f"towers (its config.json has model_type={model_type!r}); {hint}."
        )
    try:
        config = CLIPConfig.from_dict(raw)
    except Exception as e:  # a malformed config
        raise ModelLoadError(
            f"{folder}/config.json is not a valid CLIP config ({errors.flat(e)}); {hint}."
        ) from None
    clip_model.check_activations(config, folder / "config.json", hint)
    return config


def _reference_shapes(config, towers) -> dict:
    shapes = clip_model.param_shapes(clip_model.init_clip, clip_model.CLIPModel(config))
    wanted = {name for t in towers for name in _TOWER_MODULES[t]} | {"logit_scale"}
    return {k: v for k, v in convert.shapes_of(shapes).items() if k[0] in wanted}


def _read_weights(folder: Path, reference: dict, towers, hint: str, convert_hint: str) -> dict:
    from flax.traverse_util import flatten_dict, unflatten_dict

    try:
        if (folder / "flax_model.msgpack").is_file():
            flat = flatten_dict(files.read_msgpack(folder / "flax_model.msgpack", hint))
            flat = {k: v for k, v in flat.items() if k in reference}
            convert.check_against_reference(flat, reference)
            return unflatten_dict(flat)
        state = files.read_safetensors_stem(folder, "model", hint)
        if state is not None:
            prefixes = tuple(p for t in towers for p in _TOWER_PREFIXES[t]) + ("logit_scale",)
            state = {k: v for k, v in state.items() if k.startswith(prefixes)}
            if TEXT not in towers and "logit_scale" not in state:
                # An image tower alone (the aesthetic converter keeps no more) never reads the
                # scale, but the Flax CLIP module declares it: any value serves.
                state["logit_scale"] = np.zeros(reference[("logit_scale",)], np.float32)
            return convert.pytorch_to_flax(state, reference, merge_indices=False)
    except convert.ParamTreeMismatch as e:
        raise ModelLoadError(
            f"the weights in {folder} do not match its config.json ({e}); {hint}."
        ) from None
    if files.has_pickles(folder):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights, which are not read at train time; "
            f"{convert_hint}."
        )
    raise ModelLoadError(
        f"{folder} has no weights (looked for model.safetensors and flax_model.msgpack); {hint}."
    )


def _tokenizer(folder: Path, hint: str):
    if clip_files.missing_tokenizer_file(folder) is not None:
        raise ModelLoadError(
            f"{folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt); {hint}."
        )
    return clip_files.load_tokenizer(folder, hint)


def check_scorer_options(dtype: str, chunk_size) -> None:
    """A scorer's compute dtype (a name in `DTYPES`) and images per forward (at least 1);
    one-sentence ValueError otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"reward dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    if int(chunk_size) < 1:
        raise ValueError(f"reward chunk_size must be at least 1, got {chunk_size}.")


def place(params, mesh):
    """Replicated over the mesh, or sharded along `fsdp` when the mesh has that axis > 1."""
    if mesh is None:
        return jax.device_put(params)
    return jax.device_put(params, sharding.param_shardings(mesh, params))


def make_scorer(
    config,
    params,
    *,
    layout: str,
    towers: Sequence[str] = (IMAGE, TEXT),
    dtype: str = "float32",
    chunk_size: int = 16,
    mesh=None,
    tokenizer=None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    path: Path | None = None,
) -> CLIPScorer:
    """A `CLIPScorer` from a transformers `CLIPConfig` and Flax params (e.g. random ones,
    for benchmarks); `load_clip` reads both from a folder."""
    from tree_grpo_jax.rewards import preprocess

    check_scorer_options(dtype, chunk_size)
    return CLIPScorer(
        path=path,
        config=config,
        module=clip_model.CLIPModel(config, dtype=DTYPES[dtype]),
        params=place(cast_floats(params, DTYPES[dtype]), mesh),
        towers=tuple(towers),
        tokenizer=tokenizer,
        preprocess=preprocess.make_preprocess(
            layout,
            config.vision_config.image_size,
            mean=preprocess.OPENAI_CLIP_MEAN if mean is None else mean,
            std=preprocess.OPENAI_CLIP_STD if std is None else std,
        ),
        chunk_size=int(chunk_size),
        max_length=config.text_config.max_position_embeddings,
    )


def load_clip(
    path: str,
    *,
    layout: str,
    towers: Sequence[str] = (IMAGE, TEXT),
    hint: str = "point the reward at a Hugging Face CLIP folder",
    convert_hint: str = "convert the release with python -m tree_grpo_jax.rewards.convert",
    **options,
) -> CLIPScorer:
    """Loads a Hugging Face CLIP folder (or hub id) as a frozen `CLIPScorer`.

    `layout` is the scorer's image preprocessing (see `preprocess.LAYOUTS`); `towers` may
    drop the text tower (the aesthetic predictor needs images only); `options` (dtype,
    chunk_size, mesh) go to `make_scorer`.
    """
    folder = files.resolve_folder(path, "reward model path", hint, _HUB_PATTERNS)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; {hint}.")
    config = _clip_config(folder, hint)
    towers = tuple(towers)
    reference = _reference_shapes(config, towers)
    params = _read_weights(folder, reference, towers, hint, convert_hint)
    processor = _processor_config(folder, hint)
    return make_scorer(
        config,
        params,
        layout=layout,
        towers=towers,
        tokenizer=_tokenizer(folder, hint) if TEXT in towers else None,
        mean=processor.get("image_mean"),
        std=processor.get("image_std"),
        path=folder,
        **options,
    )


def _processor_config(folder: Path, hint: str) -> dict:
    """The folder's image mean and std when it ships a processor config (else OpenAI's)."""
    path = folder / "preprocessor_config.json"
    return files.read_json(path, hint) if path.is_file() else {}
