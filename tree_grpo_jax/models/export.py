"""Trained denoiser params -> a diffusers pipeline folder that PyTorch users can load.

A family describes its trainable component with a `Denoiser` (the folder name, `unet` or
`transformer`; the PyTorch class; the config; the parameter shapes it must have).
`export_denoiser` writes `<out>/<component>/` with `config.json`, Flax
`diffusion_flax_model.msgpack` and PyTorch-named `diffusion_pytorch_model.safetensors`
(numpy only, no torch); `export_pipeline` also copies the base folder's other components
beside it, so that diffusers' pipeline `from_pretrained(out)` loads the tuned model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import serialization
from flax.traverse_util import flatten_dict
from safetensors.numpy import save_file

from tree_grpo_jax.models import convert

EXPORT_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class Denoiser:
    """What a family exports: its trainable component and the shapes its params must have."""

    component: str  # the pipeline folder's sub-folder, e.g. "unet"
    pt_class: str  # diffusers' PyTorch class, written as the config's `_class_name`
    config: dict  # the component's config.json, as read from the base folder
    reference: dict  # flat {path: shape} of the Flax params
    list_names: frozenset = convert.DIFFUSERS_LIST_NAMES  # Flax `name_N` <-> PyTorch `name.N`


def unwrap_params(params) -> dict:
    """Accepts a bare params tree or one wrapped as {"params": tree}."""
    params = dict(params)
    if set(params) == {"params"}:
        params = dict(params["params"])
    return params


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
    params = unwrap_params(params)
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


def _write(params: dict, denoiser: Denoiser, out_dir) -> Path:
    folder = Path(out_dir) / denoiser.component
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in denoiser.config.items() if k != "_name_or_path"}
    config["_class_name"] = denoiser.pt_class
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "diffusion_flax_model.msgpack").write_bytes(serialization.to_bytes(params))
    save_file(
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


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_out_dir(
    base: Path | None, out: Path, overwrite: bool, sources=(), what: str = "the export folder"
) -> None:
    """Refuses an output folder that would overwrite work or a source; changes nothing."""
    out = Path(out).expanduser().resolve()
    protected = [(base.resolve(), "the base model folder")] if base is not None else []
    protected += [(Path(s).expanduser().resolve(), "the source") for s in sources]
    for source, kind in protected:
        if _overlaps(out, source):
            raise ValueError(f"{what} {out} must be neither inside nor around {kind} {source}.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is an existing file; choose a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{what} {out} is not empty; pass --overwrite or choose another.")


def export_pipeline(
    params,
    base: Path,
    denoiser: Denoiser,
    out_dir,
    dtype: str = "float32",
    overwrite: bool = False,
    sources=(),
) -> Path:
    """A whole pipeline folder: the base model's components with the denoiser replaced.

    Everything is checked first (the params against the denoiser, the export folder, which
    must not overlap the base folder or any of `sources`); the folder is then built beside
    `out_dir` and moved into place, so a failure leaves no half-built folder and an
    existing one (with `overwrite`) is replaced only by a complete export.
    """
    out = Path(out_dir).expanduser()
    check_out_dir(base, out, overwrite, sources)
    params = checked_numpy(params, denoiser, dtype)

    def fill(staging: Path) -> None:
        for entry in base.iterdir():
            if entry.name == denoiser.component or entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, staging / entry.name)
            else:
                shutil.copy2(entry, staging / entry.name)
        _write(params, denoiser, staging)

    return write_staged(out, fill)


def write_staged(out: Path, fill) -> Path:
    """Builds a folder with `fill(staging)` beside `out`, then moves it into place: a failure
    (or a kill) leaves no half-built `out`, and an existing `out` is replaced only whole."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():  # left by an earlier, killed export of this process id
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        fill(staging)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def export_lora(
    factors, prefix: str, rank: int, alpha: float, out_dir, overwrite=False, sources=()
) -> Path:
    """`<out>/pytorch_lora_weights.safetensors` from LoRA factors, in the key format
    diffusers' `load_lora_weights` reads (`prefix`: "unet" or "transformer"); written to a
    staging folder and moved into place."""
    from tree_grpo_jax import lora

    out = Path(out_dir).expanduser()
    check_out_dir(None, out, overwrite, sources)
    state = lora.to_peft_state_dict(jax.device_get(unwrap_params(factors)), alpha, rank, prefix)
    return write_staged(
        out, lambda staging: lora.save_peft(staging / lora.LORA_FILE, state, alpha, rank)
    )
