"""Trained UNet params -> a diffusers pipeline folder that PyTorch users can load.

`export_unet` writes `<out>/unet/` with `config.json`, Flax `diffusion_flax_model.msgpack`
and PyTorch-named `diffusion_pytorch_model.safetensors` (numpy only, no torch);
`export_pipeline` also copies the base folder's other components (text_encoder, vae,
tokenizer, scheduler, model_index.json) beside it, so that
`diffusers.StableDiffusionPipeline.from_pretrained(out)` and
`UNet2DConditionModel.from_pretrained(out / "unet")` load it.
"""

from __future__ import annotations

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
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.sd15.load import (
    check_unet_config,
    read_json,
    resolve_model_path,
    unet_reference_shapes,
)
from tree_grpo_jax.models.sd15.unet import unet_module

PT_CLASS = "UNet2DConditionModel"
EXPORT_DTYPES = {"float32": np.float32, "float16": np.float16}


def _to_numpy(params, dtype) -> dict:
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), dtype=dtype), params)


def unwrap_params(params) -> dict:
    """Accepts a bare UNet tree or one wrapped as {"params": tree}."""
    params = dict(params)
    if set(params) == {"params"}:
        params = dict(params["params"])
    return params


def _checked_numpy(params, unet_config: dict, dtype: str) -> dict:
    """`params` as numpy arrays of `dtype`, after checking them against `unet_config`.

    Raises ValueError (one sentence naming the keys) on any mismatch; writes nothing.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}.")
    if not isinstance(params, Mapping):
        raise ValueError(
            f"the params are a {type(params).__name__}, not a tree of named UNet arrays."
        )
    params = unwrap_params(params)
    flat = flatten_dict(params)
    not_arrays = ["/".join(map(str, k)) for k, v in flat.items() if not hasattr(v, "shape")]
    if not_arrays:
        raise ValueError(
            f"the params are not all arrays (for example {', '.join(not_arrays[:3])})."
        )
    reference = unet_reference_shapes(unet_module(unet_config))
    try:
        convert.check_against_reference(flat, reference)
    except convert.ParamTreeMismatch as e:
        raise ValueError(f"the params do not fit the UNet config ({e}).") from None
    return _to_numpy(params, EXPORT_DTYPES[dtype])


def _write_unet(params: dict, unet_config: dict, out_dir) -> Path:
    folder = Path(out_dir) / "unet"
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in unet_config.items() if k != "_name_or_path"}
    config["_class_name"] = PT_CLASS
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "diffusion_flax_model.msgpack").write_bytes(serialization.to_bytes(params))
    save_file(
        convert.flax_to_pytorch(params),
        folder / "diffusion_pytorch_model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


def export_unet(params, unet_config: dict, out_dir, dtype: str = "float32") -> Path:
    """Writes `out_dir/unet/` (config, Flax msgpack, PyTorch safetensors); returns that folder.

    `params` must match `unet_config`; a mismatch raises ValueError naming the keys, before
    anything is written.
    """
    return _write_unet(_checked_numpy(params, unet_config, dtype), unet_config, out_dir)


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _check_out_dir(base: Path, out: Path, overwrite: bool, sources=()) -> None:
    """Refuses an export folder that would overwrite work or a source; changes nothing."""
    out = out.resolve()
    for source, what in [(base.resolve(), "the base model folder")] + [
        (Path(s).resolve(), "the exported source") for s in sources
    ]:
        if _overlaps(out, source):
            raise ValueError(
                f"the export folder {out} must be neither inside nor around {what} {source}."
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"the export folder {out} is an existing file; choose a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"the export folder {out} is not empty; pass --overwrite or choose another."
        )


def export_pipeline(
    params,
    base_model_path: str,
    out_dir,
    dtype: str = "float32",
    overwrite: bool = False,
    sources=(),
) -> Path:
    """A whole pipeline folder: the base model's components with the UNet replaced.

    Everything is checked first (the base folder, its UNet config, the params against it, the
    export folder, which must not overlap the base folder or any of `sources`); the folder
    is then built beside `out_dir` and moved into place, so a failure leaves no half-built
    folder and an existing one (with `overwrite`) is replaced only by a complete export.
    """
    base = resolve_model_path(base_model_path)
    unet_config_file = base / "unet" / "config.json"
    if not unet_config_file.is_file():
        raise ModelLoadError(f"model folder {base} has no unet/config.json to export against.")
    unet_config = read_json(unet_config_file)
    check_unet_config(unet_config, unet_config_file)
    out = Path(out_dir).expanduser()
    _check_out_dir(base, out, overwrite, sources)
    params = _checked_numpy(params, unet_config, dtype)

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():  # left by an earlier, killed export of this process id
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        for entry in base.iterdir():
            if entry.name == "unet" or entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, staging / entry.name)
            else:
                shutil.copy2(entry, staging / entry.name)
        _write_unet(params, unet_config, staging)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
