"""A model as shapes only, for planning a run's memory before any weight is downloaded.

A family's `abstract` builder (its `ModelFamily.abstract`) reads nothing but the JSON configs
of a model folder, or the same configs of a public release kept as data in the family's
sub-package (`model.path=builtin:<name>`), and returns an `AbstractModel`: the denoiser
function a loaded model would have, its params as `jax.ShapeDtypeStruct`s, and the shapes of
what the trainer feeds it. `python -m tree_grpo_jax.plan` compiles the run's programs from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.models.base import DenoiseFn, PyTree, SamplingOptions
from tree_grpo_jax.weights import files
from tree_grpo_jax.weights.files import ModelLoadError

BUILTIN_PREFIX = "builtin:"  # model.path=builtin:<name> plans a release from its configs as data
HUB_CONFIG_PATTERNS = ["model_index.json", "*/*.json"]  # a hub folder's JSON files only


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class AbstractModel:
    """What planning needs from a model; nothing here holds a weight."""

    name: str
    source: str  # where the shapes came from: a folder, or `builtin:<name>` (and its hub id)
    sample_shape: tuple[int, ...]  # one sample, as `TextToImageModel.sample_shape`
    params: PyTree  # the denoiser's params as ShapeDtypeStructs, in the compute dtype
    denoise: DenoiseFn  # the same function a loaded model's `denoise` is
    cond_shape: tuple[int, int]  # [L, D]: one prompt's conditioning (float32)
    schedule_config: Any  # has `make_schedule(num_steps, sampling)`
    # (decoder params, latents [B, *sample_shape]) -> images [B, H, W, C] (videos
    # [B, T, H, W, C]); None: not planned
    decode: Callable[[PyTree, Any], Any] | None = None
    decode_params: PyTree = None  # ShapeDtypeStructs of what `decode` reads
    remat: str = "none"  # as `TextToImageModel.remat`
    media: str = media_kinds.IMAGE  # as `TextToImageModel.media`
    # What the plan compiles in place of an attention kernel this platform lacks ("": the
    # run's own); see `models.attention.plan_backend`
    attention_note: str = ""

    def __post_init__(self):
        media_kinds.check_media(self.media, f"model {self.name!r}")

    def make_schedule(self, num_steps: int, sampling: SamplingOptions):
        return self.schedule_config.make_schedule(num_steps, sampling)


@dataclasses.dataclass(frozen=True)
class BuiltinRelease:
    """A public release's JSON configs, as data: {"unet/config.json": {...}, ...}."""

    hub_id: str  # its hub repository; a model.path equal to it plans from these configs
    configs: Mapping[str, Mapping[str, Any]]


def builtin_release(
    path: str, releases: Mapping[str, BuiltinRelease]
) -> tuple[str, BuiltinRelease] | None:
    """(name, release) for `builtin:<name>`, or for the hub id of a known release when no local
    folder has that name; None for any other path. An unknown name is one sentence."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in releases:
            known = ", ".join(BUILTIN_PREFIX + n for n in releases) or "none"
            raise ModelLoadError(f"unknown built-in model {path!r}; this family knows {known}.")
        return name, releases[name]
    if not Path(path).expanduser().exists():
        for name, release in releases.items():
            if path == release.hub_id:
                return name, release
    return None


@dataclasses.dataclass(frozen=True)
class ModelConfigs:
    """A model's JSON configs by their path in the folder, and where they came from."""

    files: dict[str, dict]
    where: str  # the folder, or `builtin:<name>`
    source: str  # the same, with the release's hub id for a built-in

    def path(self, relative: str) -> Path:
        """One config file, as a sentence names it."""
        return Path(self.where) / relative

    def check_width(self, file: str, field: str, expected: int, name: str, hint: str) -> None:
        """The loader's check that a text encoder's width (`field` of `file`, when that config
        is here) is the transformer's `name`, `expected`."""
        value = self.files.get(file, {}).get(field, expected)
        if value != expected:
            raise ModelLoadError(
                f"{self.path(file)} has {field} {value}, but the transformer's {name} is "
                f"{expected}; {hint}."
            )


def read_configs(
    path: str,
    needed: Sequence[str],
    optional: Sequence[str],
    releases: Mapping[str, BuiltinRelease],
    hint: str,
) -> ModelConfigs:
    """The JSON configs `needed` (and those of `optional` that exist) of a model. `path` is a
    local folder, a hub id (only its JSON files are downloaded) or a built-in release; a
    missing needed file is one sentence ending in `hint`."""
    found = builtin_release(path, releases)
    if found is not None:
        name, release = found
        missing = [f for f in needed if f not in release.configs]
        if missing:  # a gap in the family's own table
            raise ModelLoadError(f"built-in model {name!r} lacks {missing[0]}.")
        wanted = [f for f in (*needed, *optional) if f in release.configs]
        where = BUILTIN_PREFIX + name
        return ModelConfigs(
            {f: dict(release.configs[f]) for f in wanted}, where, f"{where} ({release.hub_id})"
        )
    root = files.resolve_folder(path, "model path", hint, HUB_CONFIG_PATTERNS)
    found_files = {}
    for relative in (*needed, *optional):
        file = root / relative
        if file.is_file():
            found_files[relative] = files.read_json(file, hint)
        elif relative in needed:
            raise ModelLoadError(f"model folder {root} has no {relative}; {hint}.")
    return ModelConfigs(found_files, str(root), str(root))


def clip_prompt_shape(text_config: Mapping, tokenizer_config: Mapping | None) -> tuple[int, int]:
    """(tokens, features) of a CLIP text tower's hidden states as the loaders pad prompts: to
    the tokenizer's `model_max_length`, at most the tower's positions (transformers' defaults
    fill what the config leaves out)."""
    from transformers import CLIPTextConfig

    config = CLIPTextConfig.from_dict(dict(text_config))
    positions = config.max_position_embeddings
    limit = (tokenizer_config or {}).get("model_max_length") or positions
    return min(int(limit), positions), config.hidden_size
