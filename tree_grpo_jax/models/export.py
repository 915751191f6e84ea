"""Trained denoiser params -> a diffusers pipeline folder that PyTorch users can load.

A family describes its trainable component with a `Denoiser` (the folder name, `unet` or
`transformer`; the PyTorch class; the config; the parameter shapes it must have).
`export_denoiser` writes `<out>/<component>/` with `config.json`, Flax
`diffusion_flax_model.msgpack` and PyTorch-named `diffusion_pytorch_model.safetensors`
(numpy only, no torch); `export_pipeline` also copies the base folder's other components
beside it (or links them, `link_base`), so that diffusers' pipeline `from_pretrained(out)`
loads the tuned model, and writes the model card it is given as `README.md`.

Everything written gets the modes a new file or folder gets (the umask's, 0644 and 0755
with the usual 022), whatever the base folder's own modes are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import serialization
from flax.traverse_util import flatten_dict
from safetensors.numpy import save_file

from tree_grpo_jax.weights import convert, stacking
from tree_grpo_jax.weights.files import unwrap_params
from tree_grpo_jax.weights.staging import CARD_FILE, check_out_dir, new_file_mode, write_staged

EXPORT_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class Denoiser:
    """What a family exports: its trainable component and the shapes its params must have."""

    component: str  # the pipeline folder's sub-folder, e.g. "unet"
    pt_class: str  # diffusers' PyTorch class, written as the config's `_class_name`
    config: dict  # the component's config.json, as read from the base folder
    reference: dict  # flat {path: shape} of the Flax params
    list_names: frozenset = convert.DIFFUSERS_LIST_NAMES  # Flax `name_N` <-> PyTorch `name.N`


def checked_numpy(params, denoiser: Denoiser, dtype: str) -> dict:
    """`params` as numpy arrays of `dtype`, after checking them against `denoiser`.

    Raises ValueError (one sentence naming the keys) on any mismatch; writes nothing.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}.")
    what = denoiser.component
    if not isinstance(params, Mapping):
        raise ValueError(
            f"the params are a {type(params).__name__}, not a tree of named {what} arrays."
        )
    params = stacking.unstack(unwrap_params(params))  # a scanned model's blocks, one by one
    flat = flatten_dict(params)
    not_arrays = ["/".join(map(str, k)) for k, v in flat.items() if not hasattr(v, "shape")]
    if not_arrays:
        raise ValueError(
            f"the params are not all arrays (for example {', '.join(not_arrays[:3])})."
        )
    try:
        convert.check_against_reference(flat, denoiser.reference)
    except convert.ParamTreeMismatch as e:
        raise ValueError(f"the params do not fit the {what} config ({e}).") from None
    cast = EXPORT_DTYPES[dtype]
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), dtype=cast), params)


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, with the mode a new file gets: it writes its files 0600
    whatever the umask, which would keep the exported weights from other users."""
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, new_file_mode(Path(path).parent))


def _write(params: dict, denoiser: Denoiser, out_dir) -> Path:
    folder = Path(out_dir) / denoiser.component
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in denoiser.config.items() if k != "_name_or_path"}
    config["_class_name"] = denoiser.pt_class
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "diffusion_flax_model.msgpack").write_bytes(serialization.to_bytes(params))
    save_tensors(
        convert.flax_to_pytorch(params, list_names=denoiser.list_names),
        folder / "diffusion_pytorch_model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


def export_denoiser(params, denoiser: Denoiser, out_dir, dtype: str = "float32") -> Path:
    """Writes `out_dir/<component>/` (config, Flax msgpack, PyTorch safetensors); returns it.

    A mismatch between `params` and `denoiser` raises ValueError before anything is written.
    """
    return _write(checked_numpy(params, denoiser, dtype), denoiser, out_dir)


def _copy_tree(source: Path, target: Path) -> None:
    """`source` copied file by file (links followed) into a new `target`. Only the contents
    are copied, not the modes: a base folder in a private temporary directory (0700) or a
    read-only cache must not make the export private or read-only."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.is_dir():
            _copy_tree(entry, target / entry.name)
        else:
            shutil.copyfile(entry, target / entry.name)


def checked_parts(params, denoisers: Sequence[Denoiser], dtype: str) -> dict:
    """{component: numpy params} of one denoiser's params, or of several (a pipeline with
    two experts) whose params are {component: params}; ValueError naming what is missing."""
    if len(denoisers) == 1:
        return {denoisers[0].component: checked_numpy(params, denoisers[0], dtype)}
    names = [d.component for d in denoisers]
    if not isinstance(params, Mapping) or set(unwrap_params(params)) != set(names):
        held = sorted(unwrap_params(params)) if isinstance(params, Mapping) else []
        raise ValueError(
            f"the params hold {held or 'no named parts'}, but this pipeline has "
            f"{' and '.join(names)}: one tree each."
        )
    params = unwrap_params(params)
    return {d.component: checked_numpy(params[d.component], d, dtype) for d in denoisers}


def export_pipeline(
    params,
    base: Path,
    denoiser: Denoiser | Sequence[Denoiser],
    out_dir,
    dtype: str = "float32",
    overwrite: bool = False,
    sources=(),
    *,
    link_base: bool = False,
    card: str | None = None,
) -> Path:
    """A whole pipeline folder: the base model's components with the denoiser replaced
    (or the denoisers, each its own part of `params`).

    Everything is checked first (the params against the denoiser, the export folder, which
    must not overlap the base folder or any of `sources`); the folder is then built beside
    `out_dir` and moved into place, so a failure leaves no half-built folder and an
    existing one (with `overwrite`) is replaced only by a complete export. `link_base`
    makes every base entry but the denoiser a symbolic link to the base folder's own
    (resolved) entry instead of a copy; `card` is written as `README.md`, in place of the
    base folder's.
    """
    out = Path(out_dir).expanduser()
    check_out_dir(base, out, overwrite, sources)
    denoisers = (denoiser,) if isinstance(denoiser, Denoiser) else tuple(denoiser)
    parts = checked_parts(params, denoisers, dtype)

    def fill(staging: Path) -> None:
        for entry in sorted(Path(base).iterdir()):
            if entry.name in parts or entry.name.startswith("."):
                continue
            if card is not None and entry.name == CARD_FILE:
                continue  # the base model's card does not describe this model
            if link_base:
                target = entry.resolve()
                (staging / entry.name).symlink_to(target, target_is_directory=target.is_dir())
            elif entry.is_dir():
                _copy_tree(entry, staging / entry.name)
            else:
                shutil.copyfile(entry, staging / entry.name)
        for part in denoisers:
            _write(parts[part.component], part, staging)
        if card is not None:
            (staging / CARD_FILE).write_text(card, encoding="utf-8")

    return write_staged(out, fill)
