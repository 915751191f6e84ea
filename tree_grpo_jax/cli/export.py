"""Export trained denoiser params as a diffusers pipeline folder that PyTorch users can load.

    python -m tree_grpo_jax.export --workdir=<a training run> --out=<new folder> [--step=N]
        [--link_base] [--merge] [--dtype=float16]
    python -m tree_grpo_jax.export --params=<params .msgpack or orbax dir> \\
        --model_path=<the base SD folder> --out=<new folder>

From a training run it takes the newest readable checkpoint's params (or `--step`'s; opened
read-only: the run is never written to) and, unless `--model_path` is given, the base model
path recorded in the run's config.json, and says in one line which checkpoint it exported
(and, when the newest cannot be read, which one it exported instead and why). Everything is
checked (the checkpoint, the params against the base model's denoiser, the export folder)
before anything is written, and the folder is built beside `--out` and moved into place, so
a failure leaves no half-built export; every failure is one `error:` line and exit status 2.

It writes the trained component (`<out>/unet/` for Stable Diffusion 1.x, `<out>/transformer/`
for SD3 / 3.5 and FLUX) with `config.json`, Flax `diffusion_flax_model.msgpack` and
PyTorch-named `diffusion_pytorch_model.safetensors` (numpy only, no torch), and copies the
base folder's other components beside it (`--link_base`: symbolic links to them instead),
so that diffusers' `DiffusionPipeline.from_pretrained(out)` loads it. The family is the
run's `model.name`, or, with `--params`, the base folder's layout. The writing itself is
`models.export`; this module is the command line.

A LoRA run (`lora.rank > 0`) exports `<out>/pytorch_lora_weights.safetensors` in the PEFT
key format diffusers' `pipe.load_lora_weights(out)` reads, with its rank and alpha; with
`--merge` it writes the whole pipeline with the factors merged into the base weights.

An export of a run carries a model card, `<out>/README.md`: the base model, the method, the
reward, the iterations done, LoRA or full fine-tuning, the eval reward at the exported
checkpoint (from the run's metrics.jsonl or summary.json), which checkpoint it is and
whether the base components are copies or links. A run of the built-in tiny model has no
diffusers form; `python -m tree_grpo_jax.sample` draws pictures from any run.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import sys
from pathlib import Path

from flax import serialization

from tree_grpo_jax import interrupts, lora
from tree_grpo_jax.cli import common
from tree_grpo_jax.errors import first_line, reason
from tree_grpo_jax.models import export as pipeline_export
from tree_grpo_jax.models.export import EXPORT_DTYPES
from tree_grpo_jax.models.registry import ModelFamily, families, family_of_folder
from tree_grpo_jax.run import identity
from tree_grpo_jax.run.checkpoint import CheckpointError, quiet_orbax_reads
from tree_grpo_jax.weights import staging
from tree_grpo_jax.weights.files import read_json, unwrap_params

DESCRIPTION = """\
Export a training run's trained denoiser (or a params file) as a diffusers pipeline folder
that PyTorch loads, with a model card (README.md) that says what was trained and how."""
EPILOG = """\
examples:
  python -m tree_grpo_jax.export --workdir=runs/sd15/20250101-120000 --out=sd15_tuned
      the run's newest readable checkpoint, the base model's other components copied
  python -m tree_grpo_jax.export --workdir=RUN --out=OUT --link_base
      the same with the unchanged base components as symbolic links into the base folder
  python -m tree_grpo_jax.export --workdir=RUN --out=OUT --step=40
      an older checkpoint of the run
  python -m tree_grpo_jax.export --workdir=LORA_RUN --out=OUT [--merge]
      pytorch_lora_weights.safetensors for pipe.load_lora_weights(OUT); --merge writes the
      whole pipeline with the factors merged into the base weights
  python -m tree_grpo_jax.export --params=params.msgpack --model_path=BASE --out=OUT

load it:  diffusers.DiffusionPipeline.from_pretrained("OUT")
A run of the built-in tiny model has nothing to export; draw pictures from it (or any run)
with:  python -m tree_grpo_jax.sample --workdir=RUN
Every failure is one "error:" line and exit status 2, with nothing written.
"""


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
                f"the params file {path} is damaged, truncated or not Flax msgpack ({reason(e)})."
            ) from None
        if not isinstance(restored, dict):
            raise ValueError(f"the params file {path} does not hold a tree of named arrays.")
        return unwrap_params(restored)
    if path.is_dir():
        import orbax.checkpoint as ocp

        if (path / "state").is_dir():  # one step of a run's checkpoints/: its train state
            path = path / "state"

        try:
            with quiet_orbax_reads():
                restored = ocp.PyTreeCheckpointer().restore(str(path.resolve()))
        except Exception as e:  # any unreadable or foreign folder
            raise ValueError(
                f"the params folder {path} is not a readable orbax checkpoint ({reason(e)})."
            ) from None
        restored = restored.get("params", restored) if isinstance(restored, dict) else restored
        if not isinstance(restored, dict):
            raise ValueError(f"the params folder {path} does not hold a tree of named arrays.")
        return unwrap_params(restored)
    raise ValueError(f"params path {path} does not exist; pass a .msgpack file or an orbax folder.")


# ---------------------------------------------------------------------------------------------
# Reading a run's checkpoint quietly, and saying which one was read.


# ---------------------------------------------------------------------------------------------
# Where the params come from.


@dataclasses.dataclass(frozen=True)
class _Run:
    """What a run's export says about it."""

    workdir: Path
    config: dict  # its config.json
    step: int  # the checkpoint exported
    skipped: str  # why newer checkpoints were not exported ('' when the newest was)
    other_base: str = ""  # how the base differs from the run's (--allow_other_base), or ''


@dataclasses.dataclass(frozen=True)
class _Source:
    params: dict
    family: ModelFamily
    model_path: str
    path: Path  # the run's workdir or the params file: never written into
    adapter: dict  # the run's LoRA settings, {} for full fine-tuning
    run: _Run | None  # None for --params


def _built_in_sentence(workdir: Path, name: str) -> str:
    return (
        f"the run in {workdir} did not train a model from a pipeline folder (model.name "
        f"{name!r} is a built-in model, which diffusers has no form for); draw "
        f"pictures from it instead with `python -m tree_grpo_jax.sample --workdir={workdir}`."
    )


def _run_model(workdir: Path) -> tuple[ModelFamily, str, dict, dict]:
    """The model family, base folder, LoRA settings and whole config.json of a run."""
    config_file = workdir / "config.json"
    point = "pass --model_path, the base pipeline folder it was trained from"
    if not config_file.is_file():
        raise ValueError(f"{workdir} has no config.json, so it is not a training run; {point}.")
    run_config = read_json(config_file, point)
    model = run_config.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    family = next((f for f in families() if name in f.model_names), None)
    if family is not None and family.export is None and not family.needs_path:
        raise ValueError(_built_in_sentence(workdir, name))
    if family is None or family.export is None or not model.get("path"):
        raise ValueError(
            f"the run in {workdir} did not train a model from a pipeline folder that can be "
            "exported; pass --model_path."
        )
    _check_sections(run_config, config_file)
    adapter = run_config.get("lora") or {}
    return family, str(model["path"]), adapter if adapter.get("rank") else {}, run_config


# The sections of config.json an export reads, and the fields it reads in them with their type.
_READ = {"lora": {"rank": int, "alpha": (int, float)}, "checkpoint": {"dir": str}}
_READ |= {"tree": {"method": str}, "train": {"iterations": int}}


def _check_sections(run_config: dict, config_file: Path) -> None:
    """A config.json edited by hand (or cut short and mended): one sentence for a section
    or a field of another type than training writes, instead of a traceback later."""
    common.check_sections(run_config, config_file)
    for section, fields in _READ.items():
        values = run_config.get(section) or {}
        for field, kind in fields.items():
            value = values.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(
                    f"{config_file} is not a run's config as training writes it: its "
                    f"{section}.{field} is {common.shown_json(value)}."
                )
    rank = (run_config.get("lora") or {}).get("rank") or 0
    if rank < 0:
        raise ValueError(f"{config_file} holds lora.rank {rank}; a rank is at least 0.")


def _checkpoint_dir(workdir: Path, run_config: dict) -> str:
    """The run's `checkpoint.dir`, or `<workdir>/checkpoints` (as training chose it)."""
    configured = (run_config.get("checkpoint") or {}).get("dir")
    return configured or str(workdir / "checkpoints")


def _check_same_family(family: ModelFamily, model_path: str, workdir: Path, run_path: str):
    """A local base folder of another family than the run's is no base of it at all, which
    --allow_other_base cannot mend: one sentence naming both (a hub id is not looked at)."""
    if not Path(model_path).expanduser().is_dir():
        return
    found = family_of_folder(model_path)
    if found is not family:
        raise ValueError(
            f"{model_path} is a folder of the {found.name!r} model family (it has "
            f"{found.export.component}/), but the run in {workdir} trained one of the "
            f"{family.name!r} family ({family.export.component}/); pass a {family.name!r} "
            f"folder as --model_path, or leave it out for the run's own base, {run_path}."
        )


def _source(args) -> _Source:
    """The params and what they are, from --workdir or --params and --model_path.

    Nothing is written: a run's checkpoints are opened read-only.
    """
    if bool(args.workdir) == bool(args.params):
        raise ValueError("give exactly one of --workdir (a training run) and --params.")
    if args.params:
        if not args.model_path:
            raise ValueError(
                "--params needs --model_path, the base pipeline folder it was trained from."
            )
        if args.step is not None:
            raise ValueError("--step chooses a checkpoint of a run: give it with --workdir.")
        family = family_of_folder(args.model_path)
        source = Path(args.params).expanduser()
        return _Source(load_params(args.params), family, args.model_path, source, {}, None)
    workdir = Path(args.workdir).expanduser()
    if not workdir.is_dir():
        raise ValueError(f"there is no training run at {workdir}; pass the --workdir of a run.")
    family, run_path, adapter, run_config = _run_model(workdir)
    state, meta, step, skipped = common.restore_run_state(
        _checkpoint_dir(workdir, run_config), args.step
    )
    model_path = args.model_path or run_path
    _check_same_family(family, model_path, workdir, run_path)
    differs = identity.other_base(meta.get("identity"), model_path)
    if differs and not args.allow_other_base:
        raise ValueError(
            f"{model_path} is not the base the run in {workdir} was trained on: {differs}; "
            "export onto it anyway with --allow_other_base."
        )
    run = _Run(workdir, run_config, step, skipped, differs or "")
    return _Source(state["params"], family, model_path, workdir, adapter, run)


# ---------------------------------------------------------------------------------------------
# The model card.


def _evals(workdir: Path) -> dict[int, dict]:
    """step -> the run's eval metrics (names without `eval/`), from metrics.jsonl, with
    summary.json's evaluations where metrics.jsonl lacks them."""
    from tree_grpo_jax.run import reporting

    evals: dict[int, dict] = {}
    try:
        summary = json.loads((workdir / "summary.json").read_text(encoding="utf-8"))
        for entry in summary.get("evals") or []:
            metrics = {k: v for k, v in entry.items() if k != "iteration"}
            evals[int(entry["iteration"])] = metrics
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # no summary (a run still going, or stopped): metrics.jsonl alone
    for row in reporting.read_metrics(str(workdir)):
        metrics = {k[len("eval/") :]: v for k, v in row.items() if k.startswith("eval/")}
        if metrics and "step" in row:
            evals.setdefault(int(row["step"]), {}).update(metrics)
    return evals


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def _iterations(count: int) -> str:
    return "before training" if count == 0 else f"after {count} iteration{'s' * (count != 1)}"


def _eval_text(run: _Run) -> str:
    """The eval reward at the exported checkpoint (mean ± std over the eval samples), the
    first one beside it, and the other eval metrics then (a video's per-frame rewards
    left out)."""
    from tree_grpo_jax.run import reporting

    evals = _evals(run.workdir)
    done = [s for s in sorted(evals) if s <= run.step and "reward_mean" in evals[s]]
    if not done:
        return "not recorded (no evaluation in the run's metrics.jsonl or summary.json)"
    step, first = done[-1], done[0]
    at = evals[step]
    text = _number(at["reward_mean"])
    if "reward_std" in at:
        text += f" ± {_number(at['reward_std'])}"
    text += f" {_iterations(step)}"
    if first != step:
        text += f" ({_number(evals[first]['reward_mean'])} {_iterations(first)})"
    others = [
        f"{k} {_number(v)}"
        for k, v in at.items()
        if k not in ("reward_mean", "reward_std")
        and isinstance(v, (int, float))
        and not reporting.is_frame_reward(k)
    ]
    return text + (f"; {', '.join(others)}" if others else "")


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


def model_card(source: _Source, out: Path, args, base: Path | None) -> str:
    """README.md of a run's export: what was trained, how, and how to load it."""
    run = source.run
    config = run.config
    tree = config.get("tree") or {}
    method = tree.get("method", "?")
    total = (config.get("train") or {}).get("iterations", "?")
    rank = source.adapter.get("rank")
    alpha = source.adapter.get("alpha") or rank
    component = source.family.export.component
    lora_file = not args.merge and bool(rank)
    if not rank:
        weights = f"full fine-tuning: `{component}/` holds all of the denoiser's weights"
    elif lora_file:
        weights = f"LoRA rank {rank}, alpha {_number(alpha)}: `{lora.LORA_FILE}`"
    else:
        weights = f"LoRA rank {rank}, alpha {_number(alpha)}, merged into `{component}/`"
    checkpoint = f"{run.step} (of `{run.workdir}`)"
    if run.skipped:
        checkpoint += f", {run.skipped}"
    base_model = f"`{source.model_path}`"
    if run.other_base:
        base_model += f" (not the run's own base, --allow_other_base: {run.other_base})"
    rows = [
        ("base model", base_model),
        ("method", method),
        ("reward", f"`{config.get('rewards', '?')}`"),
        ("iterations done", f"{run.step} of {total}"),
        ("weights", weights + ("" if lora_file else f", {args.dtype}")),
        ("eval reward", _eval_text(run)),
        ("checkpoint exported", checkpoint),
    ]
    if not lora_file:
        where = base or source.model_path
        if args.link_base:
            rows.append(
                (
                    "base components",
                    f"symbolic links into `{where}` (copy them with `cp -rL` before moving "
                    "this folder to another machine)",
                )
            )
        else:
            rows.append(("base components", f"copied from `{where}`"))
    front = ["---", "library_name: diffusers", "tags:", "- text-to-image", "- tree_grpo_jax"]
    front += [f"- {method}"] + (
        [] if _is_local(source.model_path) else [f"base_model: {source.model_path}"]
    )
    front += ["---", ""]
    name = config.get("name") or run.workdir.name
    lines = [
        *front,
        f"# {name}: {method} on {Path(source.model_path).name}",
        "",
        f"Trained by reinforcement learning with tree_grpo_jax ({method}, reward "
        f"`{config.get('rewards', '?')}`) from `{source.model_path}`.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "## Use",
        "",
        "```python",
        "from diffusers import DiffusionPipeline",
        "",
    ]
    if lora_file:
        lines += [
            f'pipe = DiffusionPipeline.from_pretrained("{source.model_path}")',
            f'pipe.load_lora_weights("{out}")',
        ]
    else:
        lines.append(f'pipe = DiffusionPipeline.from_pretrained("{out}")')
    lines += [
        "```",
        "",
        "Pictures from the run's own (deterministic) sampler: "
        f"`python -m tree_grpo_jax.sample --workdir={run.workdir} --step={run.step}`.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command line.


def _parser() -> argparse.ArgumentParser:
    parser = common.command_parser("export", DESCRIPTION, EPILOG)
    parser.add_argument(
        "--workdir", help="a training run: its newest readable checkpoint is exported"
    )
    parser.add_argument(
        "--step", type=int, help="the run's checkpoint to export (default: the newest readable)"
    )
    parser.add_argument("--params", help="denoiser params: .msgpack or orbax folder")
    parser.add_argument(
        "--model_path", help="the base pipeline folder (default: the run's model.path)"
    )
    parser.add_argument("--out", required=True, help="the new pipeline folder")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(EXPORT_DTYPES),
        help="the exported weights' dtype (default: float32)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write full merged weights instead of pytorch_lora_weights.safetensors",
    )
    parser.add_argument(
        "--allow_other_base",
        action="store_true",
        help="export onto a base folder whose files differ from those the run was trained on "
        "(the model card says so)",
    )
    parser.add_argument(
        "--link_base",
        action="store_true",
        help="symbolic links to the base folder's unchanged components (text encoders, VAE, "
        "tokenizers, scheduler) instead of copies",
    )
    return parser


def _done(out: Path) -> None:
    """From here on a signal finds the export done: its line says so."""
    interrupts.set_stop_line(
        lambda name: f"{name} arrived after the export was done; {out} is written whole."
    )


def _said(source: _Source, out: Path) -> str:
    """The one line that says what was exported where."""
    if source.run is None:
        return f"exported {source.path} to {out}"
    run = source.run
    line = f"exported checkpoint {run.step} of {run.workdir} to {out}"
    return f"{line}, {run.skipped}" if run.skipped else line


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        # The destination first: a folder that cannot be made is said before any model is read.
        staging.check_out_dir(None, Path(args.out), args.overwrite, what="--out")
        source = _source(args)
        params, family, adapter = source.params, source.family, source.adapter
        if adapter and not args.merge:
            if args.link_base:
                print(
                    "warning: --link_base changes nothing here: a LoRA export holds only "
                    f"{lora.LORA_FILE} (with --merge it writes the whole pipeline).",
                    file=sys.stderr,
                )
            out = Path(args.out).expanduser().resolve()
            card = model_card(source, out, args, None) if source.run else None
            out = lora.export_lora(
                params,
                family.export.component,
                adapter["rank"],
                adapter.get("alpha") or adapter["rank"],
                args.out,
                args.overwrite,
                sources=[source.path],
                card=card,
                list_names=family.export.list_names,
            )
            _done(out)
            print(f"{_said(source, out)} (load it with pipe.load_lora_weights)")
            return 0
        if adapter:  # --merge: the base weights with the factors added, as full weights
            params = lora.merge(
                family.export.base_params(source.model_path),
                params,
                adapter.get("alpha") or adapter["rank"],
                adapter["rank"],
            )
        base, denoiser = family.export.base_denoiser(source.model_path)
        out = Path(args.out).expanduser().resolve()
        card = model_card(source, out, args, base) if source.run else None
        out = pipeline_export.export_pipeline(
            params,
            base,
            denoiser,
            args.out,
            args.dtype,
            args.overwrite,
            sources=[source.path],
            link_base=args.link_base,
            card=card,
        )
    except (ValueError, CheckpointError) as e:
        # The loaders' sentences name the training flag; here the base folder is --model_path.
        line = common.typed_flags(first_line(e), {"--config.model.path": "--model_path"})
        print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be read or written (permissions, disk full)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the copy's source file is not to blame
            out = Path(args.out).expanduser().resolve()
            print(
                f"error: no space left for the export in {out.parent} (disk full or over "
                "quota); nothing was kept there.",
                file=sys.stderr,
            )
            return 2
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not read or write{where}: {e.strerror or e}.", file=sys.stderr)
        return 2
    _done(out)
    print(_said(source, out))
    return 0


def run() -> None:
    common.starting("export")
    interrupts.set_stop_line(
        lambda name: (
            f"{name} stopped the export; nothing was written (the output folder is as it was)."
        )
    )
    interrupts.finish(main())


if __name__ == "__main__":
    run()
