"""Export trained UNet params as a diffusers pipeline folder that PyTorch users can load.

    python -m tree_grpo_jax.export --workdir=<a training run> --out=<new folder>
    python -m tree_grpo_jax.export --params=<unet params .msgpack or orbax dir> \\
        --model_path=<the base SD folder> --out=<new folder>

From a training run it takes the latest checkpoint's params and, unless `--model_path` is
given, the base model path recorded in the run's config.json.

writes `<out>/unet/` with `config.json`, Flax `diffusion_flax_model.msgpack` and PyTorch-named
`diffusion_pytorch_model.safetensors` (numpy only, no torch), and copies the base folder's
other components (text_encoder, vae, tokenizer, scheduler, model_index.json) beside it, so
that `diffusers.StableDiffusionPipeline.from_pretrained(out)` and
`UNet2DConditionModel.from_pretrained(out / "unet")` load it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from flax import serialization
from flax.traverse_util import flatten_dict
from safetensors.numpy import save_file

from tree_grpo_jax.checkpoint import Checkpointer, CheckpointError
from tree_grpo_jax.models import convert, sd

_PT_CLASS = "UNet2DConditionModel"
_DTYPES = {"float32": np.float32, "float16": np.float16}


def _to_numpy(params, dtype) -> dict:
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), dtype=dtype), params)


def _unwrap(params) -> dict:
    """Accepts a bare UNet tree or one wrapped as {"params": tree}."""
    params = dict(params)
    if set(params) == {"params"}:
        params = dict(params["params"])
    return params


def export_unet(params, unet_config: dict, out_dir, dtype: str = "float32") -> Path:
    """Writes `out_dir/unet/` (config, Flax msgpack, PyTorch safetensors); returns that folder.

    `params` must match `unet_config`; a mismatch raises ValueError naming the keys.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    params = _to_numpy(_unwrap(params), _DTYPES[dtype])
    reference = convert.shapes_of(
        jax.eval_shape(sd.unet_module(unet_config).init_weights, jax.random.PRNGKey(0))
    )
    try:
        convert.check_against_reference(flatten_dict(params), reference)
    except convert.ParamTreeMismatch as e:
        raise ValueError(f"the params do not fit the UNet config ({e}).") from None

    folder = Path(out_dir) / "unet"
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in unet_config.items() if k != "_name_or_path"}
    config["_class_name"] = _PT_CLASS
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "diffusion_flax_model.msgpack").write_bytes(serialization.to_bytes(params))
    save_file(
        convert.flax_to_pytorch(params),
        folder / "diffusion_pytorch_model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


def _check_out_dir(base: Path, out: Path, overwrite: bool) -> None:
    base, out = base.resolve(), out.resolve()
    if out == base or base in out.parents:
        raise ValueError(
            f"the export folder {out} must not be inside the base model folder {base}."
        )
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(
                f"the export folder {out} is not empty; pass --overwrite or choose another."
            )
        shutil.rmtree(out)


def export_from_params(
    params, base_model_path: str, out_dir, dtype: str = "float32", overwrite: bool = False
) -> Path:
    """A whole pipeline folder: the base model's components with the UNet replaced."""
    base = sd.resolve_model_path(base_model_path)
    unet_config_file = base / "unet" / "config.json"
    if not unet_config_file.is_file():
        raise sd.ModelLoadError(f"model folder {base} has no unet/config.json to export against.")
    out = Path(out_dir)
    _check_out_dir(base, out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    for entry in base.iterdir():
        if entry.name == "unet" or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name)
        else:
            shutil.copy2(entry, out / entry.name)
    export_unet(params, json.loads(unet_config_file.read_text()), out, dtype)
    return out


def load_params(path) -> dict:
    """UNet params from a msgpack file or an orbax checkpoint folder (its `params` item)."""
    path = Path(path)
    if path.is_file():
        return _unwrap(serialization.msgpack_restore(path.read_bytes()))
    if path.is_dir():
        import orbax.checkpoint as ocp

        restored = ocp.PyTreeCheckpointer().restore(str(path.resolve()))
        return _unwrap(restored.get("params", restored) if isinstance(restored, dict) else restored)
    raise ValueError(f"params path {path} does not exist; pass a .msgpack file or an orbax folder.")


def _source(args) -> tuple[dict, str]:
    """(params, base model path) from --workdir or from --params and --model_path."""
    if bool(args.workdir) == bool(args.params):
        raise ValueError("give exactly one of --workdir (a training run) and --params.")
    if args.params:
        if not args.model_path:
            raise ValueError("--params needs --model_path, the base SD folder it was trained from.")
        return load_params(args.params), args.model_path
    workdir = Path(args.workdir)
    params = Checkpointer(str(workdir / "checkpoints")).restore_params()
    model_path = args.model_path
    if not model_path:
        run_config = json.loads((workdir / "config.json").read_text())
        model_path = run_config["model"]["path"]
        if run_config["model"]["name"] != "sd" or not model_path:
            raise ValueError(
                f"the run in {workdir} did not train an SD model from a folder; pass --model_path."
            )
    return params, model_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_grpo_jax.export", description=__doc__)
    parser.add_argument("--workdir", help="a training run: its latest checkpoint is exported")
    parser.add_argument("--params", help="UNet params: .msgpack or orbax folder")
    parser.add_argument("--model_path", help="the base SD folder (default: the run's model.path)")
    parser.add_argument("--out", required=True, help="the new pipeline folder")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        params, model_path = _source(args)
        out = export_from_params(params, model_path, args.out, args.dtype, args.overwrite)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
