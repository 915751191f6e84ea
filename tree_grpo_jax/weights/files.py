"""Reading weight and config files from local folders, each failure one `ModelLoadError`.

Shared by every model family, the reward models and export. Only safetensors, Flax msgpack and
JSON are read (no pickle, so torch is never needed). `hint` is the sentence's ending: what
the user should do instead (e.g. "point --config.model.path at ...").
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from flax import serialization
from safetensors.numpy import load_file

from tree_grpo_jax.errors import UserError, first_line


class ModelLoadError(UserError):
    """A model folder or weights file is missing, incomplete, or not what the loader supports."""


def unwrap_params(params) -> dict:
    """Accepts a bare params tree or one wrapped as {"params": tree}."""
    params = dict(params)
    if set(params) == {"params"}:
        params = dict(params["params"])
    return params


def read_json(path: Path, hint: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"could not read {path}: {e}; {hint}.") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object; {hint}.")
    return data


def damaged(path: Path, error: Exception, hint: str) -> ModelLoadError:
    reason = first_line(error, default="").rstrip(".")
    name = type(error).__name__
    reason = f" ({name}: {reason[:200]})" if reason else f" ({name})"
    return ModelLoadError(
        f"weights file {path} is damaged or truncated and cannot be read{reason}; "
        f"download it again or {hint}."
    )


def read_safetensors(path: Path, hint: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; a damaged or truncated file is one ModelLoadError."""
    try:
        return load_file(path)
    except OSError as e:
        raise ModelLoadError(f"could not read weights file {path}: {e.strerror or e}.") from None
    except Exception as e:  # SafetensorError, or anything a garbage header makes numpy raise
        raise damaged(path, e, hint) from None


def read_msgpack(path: Path, hint: str):
    """A Flax msgpack file's tree; a damaged or truncated file is one ModelLoadError."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ModelLoadError(f"could not read weights file {path}: {e.strerror or e}.") from None
    try:
        restored = serialization.msgpack_restore(data)
    except Exception as e:  # msgpack's ExtraData, UnpackValueError, ValueError, ...
        raise damaged(path, e, hint) from None
    if not isinstance(restored, dict):
        raise ModelLoadError(
            f"weights file {path} does not hold a tree of named arrays "
            f"(it decodes to a {type(restored).__name__}); download it again or {hint}."
        )
    return restored


def read_safetensors_stem(
    folder: Path, stem: str, hint: str, variant: str | None = None
) -> dict[str, np.ndarray] | None:
    """`stem[.variant].safetensors`, or the shards its `.index.json` names; None if absent."""
    names = [f"{stem}.{variant}.safetensors"] if variant else []
    names += [f"{stem}.safetensors", f"{stem}.fp16.safetensors"]
    for name in names:
        if (folder / name).is_file():
            return read_safetensors(folder / name, hint)
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():  # sharded: {"weight_map": {tensor: shard file}}
        weight_map = read_json(index, hint).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ModelLoadError(f"{index} has no valid weight_map; {hint}.")
        state = {}
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise ModelLoadError(f"{index} names the shard {shard}, which is missing; {hint}.")
            state.update(read_safetensors(folder / shard, hint))
        return state
    return None


def read_weights(folder: Path, stem: str, hint: str) -> dict[str, np.ndarray]:
    """`stem.safetensors` of a component folder, or its shards; one sentence when there is
    none (or only PyTorch pickles, which would need torch to read)."""
    state = read_safetensors_stem(folder, stem, hint)
    if state is not None:
        return state
    if has_pickles(folder):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights, which need torch to read; save them "
            f"as {stem}.safetensors or {hint} that has them."
        )
    raise ModelLoadError(f"{folder} has no {stem}.safetensors (or its index); {hint}.")


def tokenizer_class(folder: Path, vocab_files, slow_class, fast_class):
    """The transformers tokenizer class that reads `folder`: `slow_class` when it holds every
    one of `vocab_files` (what transformers 4's slow classes read, and what hub folders
    carry), else `fast_class`, which reads `tokenizer.json`, all that transformers 5 saves
    (there both names are one class)."""
    has_vocab = all((Path(folder) / name).is_file() for name in vocab_files)
    return slow_class if has_vocab else fast_class


def component_dir(root: Path, name: str, needed, hint: str) -> Path:
    """`root/name`, which must be a folder holding the files `needed`; else one sentence."""
    folder = Path(root) / name
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {root} has no {name}/ folder; {hint}.")
    for filename in needed:
        if not (folder / filename).is_file():
            raise ModelLoadError(f"model folder {root} has no {name}/{filename}; {hint}.")
    return folder


def check_fixed(config: dict, fixed: dict, where: Path) -> None:
    """Refuses config fields set to a value other than the one our module implements."""
    for key, supported in fixed.items():
        if key in config and config[key] != supported:
            raise ModelLoadError(
                f"{where} sets {key}={config[key]!r}, but only {key}={supported!r} is supported."
            )


def _kind(default) -> tuple[str, object] | None:
    """(what a field with this default must be, a test of a value), or None (unchecked)."""

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if isinstance(default, bool):
        return "true or false", lambda v: isinstance(v, bool)
    if isinstance(default, int):  # diffusers' head counts may be one per block
        return (
            "a whole number (or a list of them)",
            lambda v: whole(v) or (isinstance(v, (list, tuple)) and all(whole(x) for x in v)),
        )
    if isinstance(default, float):
        return "a number", number
    if isinstance(default, str):
        return "a string", lambda v: isinstance(v, str)
    if isinstance(default, (list, tuple)) and default:
        inner = _kind(default[0])
        if inner is not None:
            what, test = inner
            return (
                f"a list of {what.split(' (')[0].removeprefix('a ')}s",
                lambda v: isinstance(v, (list, tuple)) and all(test(x) for x in v),
            )
    return None


def check_field_types(config: dict, cls, where: Path) -> None:
    """Refuses a config value whose type differs from the default of the dataclass field
    (a Flax module's) of that name, before the module is built from it ("two" layers)."""
    for field in dataclasses.fields(cls):
        if field.name not in config or field.default is dataclasses.MISSING:
            continue
        kind = _kind(field.default)
        value = config[field.name]
        if kind is not None and value is not None and not kind[1](value):
            raise ModelLoadError(f"{where} sets {field.name}={value!r}, but it must be {kind[0]}.")


def has_pickles(folder: Path) -> bool:
    """True when the folder holds PyTorch pickle weights (which need torch to read)."""
    return any(list(Path(folder).glob(p)) for p in ("*.bin", "*.pt", "*.pth", "*.ckpt"))


def looks_local(path: str) -> bool:
    """A path that no hub id ('name' or 'owner/name') can be: absolute, relative to home or
    to `.`, or with more than one `/` (or a backslash)."""
    return path.startswith(("/", "~", ".")) or path.count("/") > 1 or "\\" in path


def resolve_folder(path: str, what: str, hint: str, hub_patterns: list[str]) -> Path:
    """A local folder as is; anything else is tried as a hub id (one sentence on failure).

    `what` names the path in the sentence ("model path", "reward model path").
    """
    local = Path(os.path.expanduser(path))  # `~nosuchuser` stays as written
    try:
        if local.is_dir():
            return local
        exists = local.exists()
    except OSError as e:  # a name over 255 bytes, a folder that may not be looked into
        raise ModelLoadError(
            f"{what} {path} cannot be looked up ({e.strerror or e}); {hint}."
        ) from None
    if exists:
        raise ModelLoadError(f"{what} {path} is a file, not a folder; {hint}.")
    if looks_local(str(path)):
        raise ModelLoadError(f"{what} {path} does not exist (no such folder); {hint}.")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=hub_patterns))
    except Exception as e:  # any hub failure becomes the same sentence
        reason = first_line(e, default="").rstrip(".") or type(e).__name__
        raise ModelLoadError(
            f"{what} {path} is not a folder and could not be downloaded: {reason}; {hint}."
        ) from None
