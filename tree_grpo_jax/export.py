"""Export trained denoiser params as a diffusers pipeline folder that PyTorch users can load.

    python -m tree_grpo_jax.export --workdir=<a training run> --out=<new folder>
    python -m tree_grpo_jax.export --params=<params .msgpack or orbax dir> \\
        --model_path=<the base SD folder> --out=<new folder>

From a training run it takes the latest readable checkpoint's params (opened read-only:
the run is never written to) and, unless `--model_path` is given, the base model path
recorded in the run's config.json. Everything is checked (the checkpoint, the params against
the base model's UNet, the export folder) before anything is written, and the folder is
built beside `--out` and moved into place, so a failure leaves no half-built export; every
failure is one `error:` line and exit status 2.

It writes the trained component (`<out>/unet/` for Stable Diffusion 1.x, `<out>/transformer/`
for SD3 / 3.5) with `config.json`, Flax `diffusion_flax_model.msgpack` and PyTorch-named
`diffusion_pytorch_model.safetensors` (numpy only, no torch), and copies the base folder's
other components beside it, so that diffusers' `StableDiffusionPipeline` or
`StableDiffusion3Pipeline.from_pretrained(out)` loads it. The family is the run's
`model.name`, or, with `--params`, the base folder's layout. The writing itself is
`models.export`; this module is the command line.

A LoRA run (`lora.rank > 0`) exports `<out>/pytorch_lora_weights.safetensors` in the PEFT
key format diffusers' `pipe.load_lora_weights(out)` reads, with its rank and alpha; with
`--merge` it writes the whole pipeline with the factors merged into the base weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flax import serialization

from tree_grpo_jax import lora
from tree_grpo_jax.checkpoint import Checkpointer, CheckpointError
from tree_grpo_jax.models import export as pipeline_export
from tree_grpo_jax.models.export import EXPORT_DTYPES
from tree_grpo_jax.models.registry import ModelFamily, families, family_of_folder
from tree_grpo_jax.weights.files import unwrap_params


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0].rstrip(".")[:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_params(path) -> dict:
    """UNet params from a msgpack file or an orbax checkpoint folder (its `params` item)."""
    path = Path(path).expanduser()
    if path.is_file():
        try:
            restored = serialization.msgpack_restore(path.read_bytes())
        except OSError as e:
            raise ValueError(f"could not read the params file {path}: {e.strerror or e}.") from None
        except Exception as e:  # msgpack's FormatError, ExtraData, ValueError, ...
            raise ValueError(
                f"the params file {path} is damaged, truncated or not Flax msgpack ({_reason(e)})."
            ) from None
        if not isinstance(restored, dict):
            raise ValueError(f"the params file {path} does not hold a tree of named arrays.")
        return unwrap_params(restored)
    if path.is_dir():
        import orbax.checkpoint as ocp

        if (path / "state").is_dir():  # one step of a run's checkpoints/: its train state
            path = path / "state"

        try:
            restored = ocp.PyTreeCheckpointer().restore(str(path.resolve()))
        except Exception as e:  # any unreadable or foreign folder
            raise ValueError(
                f"the params folder {path} is not a readable orbax checkpoint ({_reason(e)})."
            ) from None
        restored = restored.get("params", restored) if isinstance(restored, dict) else restored
        if not isinstance(restored, dict):
            raise ValueError(f"the params folder {path} does not hold a tree of named arrays.")
        return unwrap_params(restored)
    raise ValueError(f"params path {path} does not exist; pass a .msgpack file or an orbax folder.")


def _run_model(workdir: Path) -> tuple[ModelFamily, str, dict]:
    """The model family, base folder and LoRA settings in a run's config.json (read only)."""
    config_file = workdir / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{workdir} has no config.json, so it is not a training run; "
            "pass --model_path, the base pipeline folder it was trained from."
        )
    try:
        run_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {config_file} ({_reason(e)}).") from None
    model = run_config.get("model") if isinstance(run_config, dict) else None
    family = None
    if isinstance(model, dict) and model.get("path"):
        family = next((f for f in families() if model.get("name") in f.model_names), None)
    if family is None or family.export is None:
        raise ValueError(
            f"the run in {workdir} did not train a model from a pipeline folder that can be "
            "exported; pass --model_path."
        )
    adapter = run_config.get("lora") or {}
    return family, str(model["path"]), adapter if adapter.get("rank") else {}


def _source(args) -> tuple[dict, ModelFamily, str, Path, dict]:
    """(params, family, base model path, source path, LoRA settings or {}) from --workdir or
    --params and --model_path.

    Nothing is written: a run's checkpoints are opened read-only.
    """
    if bool(args.workdir) == bool(args.params):
        raise ValueError("give exactly one of --workdir (a training run) and --params.")
    if args.params:
        if not args.model_path:
            raise ValueError(
                "--params needs --model_path, the base pipeline folder it was trained from."
            )
        family = family_of_folder(args.model_path)
        source = Path(args.params).expanduser()
        return load_params(args.params), family, args.model_path, source, {}
    workdir = Path(args.workdir).expanduser()
    if not workdir.is_dir():
        raise ValueError(f"there is no training run at {workdir}; pass the --workdir of a run.")
    family, run_path, adapter = _run_model(workdir)
    model_path = args.model_path or run_path
    params = Checkpointer(str(workdir / "checkpoints"), read_only=True).restore_params()
    return params, family, model_path, workdir, adapter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_grpo_jax.export", description=__doc__)
    parser.add_argument("--workdir", help="a training run: its latest checkpoint is exported")
    parser.add_argument("--params", help="denoiser params: .msgpack or orbax folder")
    parser.add_argument(
        "--model_path", help="the base pipeline folder (default: the run's model.path)"
    )
    parser.add_argument("--out", required=True, help="the new pipeline folder")
    parser.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES))
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write full merged weights instead of pytorch_lora_weights.safetensors",
    )
    args = parser.parse_args(argv)
    try:
        params, family, model_path, source, adapter = _source(args)
        if adapter and not args.merge:
            out = lora.export_lora(
                params,
                family.export.component,
                adapter["rank"],
                adapter.get("alpha") or adapter["rank"],
                args.out,
                args.overwrite,
                sources=[source],
            )
            print(f"exported {out} (load it with pipe.load_lora_weights)")
            return 0
        if adapter:  # --merge: the base weights with the factors added, as full weights
            params = lora.merge(
                family.export.base_params(model_path),
                params,
                adapter.get("alpha") or adapter["rank"],
                adapter["rank"],
            )
        base, denoiser = family.export.base_denoiser(model_path)
        out = pipeline_export.export_pipeline(
            params, base, denoiser, args.out, args.dtype, args.overwrite, sources=[source]
        )
    except (ValueError, CheckpointError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be read or written (permissions, disk full)
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not read or write{where}: {e.strerror or e}.", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
