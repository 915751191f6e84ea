"""The command line: the `hpsv2`, `aesthetic` and `imagereward` subcommands and `main`.

Every failure is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tree_grpo_jax import interrupts
from tree_grpo_jax.errors import OneLineErrors, first_line
from tree_grpo_jax.rewards.convert.aesthetic import check_aesthetic_mlp, convert_aesthetic
from tree_grpo_jax.rewards.convert.clip_configs import hf_clip_config, read_open_clip_config
from tree_grpo_jax.rewards.convert.dtypes import (
    OUTPUT_DTYPES,
    _check_dtype,
    _dtype_name,
    _set_dtype,
)
from tree_grpo_jax.rewards.convert.errors import ConversionError
from tree_grpo_jax.rewards.convert.imagereward import (
    blip_tokenizer,
    convert_imagereward,
    tokenizer_files,
)
from tree_grpo_jax.rewards.convert.keys import convert_open_clip
from tree_grpo_jax.rewards.convert.reading import (
    load_checkpoint,
    read_clip_config,
    read_clip_folder,
)
from tree_grpo_jax.rewards.convert.tokenizer import (
    _tokenizer_folder,
    check_tokenizer,
    copied_tokenizer_files,
    open_clip_tokenizer_files,
)
from tree_grpo_jax.rewards.convert.writing import (
    _folder_size,
    _size_text,
    check_out_dir,
    write_folder,
)

# The `--help` text.
_DESCRIPTION = """\
Pickled reward-model releases -> folders the JAX reward loader reads (safetensors + JSON).

    python -m tree_grpo_jax.rewards.convert hpsv2 --checkpoint=HPS_v2.1_compressed.pt \\
        --out=<new folder> [--open-clip-config=<open_clip model config .json>] \\
        [--tokenizer=<a Hugging Face CLIP folder>] [--dtype=float32|float16|bfloat16|keep]
    python -m tree_grpo_jax.rewards.convert aesthetic \\
        --checkpoint=sac+logos+ava1-l14-linearMSE.pth --clip=<transformers CLIP folder> \\
        --out=<new folder>
    python -m tree_grpo_jax.rewards.convert imagereward --checkpoint=ImageReward.pt \\
        --tokenizer=<a bert-base-uncased folder> --out=<new folder>

`hpsv2` turns an open_clip ViT CLIP state dict (HPS-v2.1 is open_clip's ViT-H-14, fine-tuned;
`--open-clip-config` describes other open_clip ViTs) into a transformers CLIP folder:
`config.json`, `model.safetensors` in transformers' PyTorch key layout, the CLIP tokenizer
files (`vocab.json`, `merges.txt`, `tokenizer_config.json`, `special_tokens_map.json`) and
`reward_config.json`. `aesthetic` keeps the image tower of a transformers CLIP folder
(`config.json`, `model.safetensors` with `vision_model.*` and `visual_projection.weight`) and
writes the LAION aesthetic predictor's MLP as `aesthetic_mlp.safetensors` (float32, the
release's key names) beside it, with `reward_config.json`. `imagereward` keeps the tensors of
the ImageReward release that its score reads (BLIP's ViT and BERT, the head in float32) under
their own names in `model.safetensors`, its sizes in `config.json`, bert-base-uncased's
tokenizer with BLIP's added [DEC] and [ENC] tokens, and `reward_config.json`.

torch is needed only to read the pickled release (`torch.load(..., weights_only=True)`) and to
learn the expected shapes from transformers' CLIP on the meta device. Every key and shape is
checked before anything is written; the folder is built beside `--out` and moved into place,
so a failure leaves no half-built folder; every failure is one `error:` line and exit status 2.
"""

FORMAT = 1


def _say(text: str) -> None:
    print(text, flush=True)


def run_hpsv2(args) -> Path:
    checkpoint = Path(args.checkpoint).expanduser()
    out = check_out_dir(args.out, args.overwrite, [checkpoint])
    _check_dtype(args.dtype)
    open_clip_config, config_name = None, "the ViT-H-14 config"
    if args.open_clip_config:
        open_clip_config = read_open_clip_config(args.open_clip_config)
        config_name = f"the open_clip config {Path(args.open_clip_config).name}"
    # The config and the tokenizer are checked before the (large) release is read.
    planned = hf_clip_config(open_clip_config)
    context_length = planned["text_config"]["max_position_embeddings"]
    if args.tokenizer:
        tokenizer = copied_tokenizer_files(args.tokenizer, context_length)
        where = str(_tokenizer_folder(args.tokenizer))
    else:
        tokenizer = open_clip_tokenizer_files(context_length)
        where = "open_clip's BPE vocabulary"
    check_tokenizer(tokenizer, planned, where)
    _say(f"reading {checkpoint}")
    state_dict = load_checkpoint(checkpoint)
    _say(f"checking {len(state_dict)} tensors against {config_name}")
    hf_config, weights = convert_open_clip(
        state_dict, open_clip_config, args.dtype, config_name, what=f"checkpoint {checkpoint.name}"
    )
    del state_dict
    _say(f"writing {out}")
    files = {"config.json": hf_config, "model.safetensors": weights, **tokenizer}
    files["reward_config.json"] = {
        "reward": "hpsv2",
        "converted_from": checkpoint.name,
        "format": FORMAT,
    }
    return write_folder(out, files)


def run_aesthetic(args) -> Path:
    checkpoint = Path(args.checkpoint).expanduser()
    clip_dir = Path(args.clip).expanduser()
    out = check_out_dir(args.out, args.overwrite, [checkpoint, clip_dir])
    _check_dtype(args.dtype)
    read_clip_config(clip_dir)  # a wrong folder is refused before anything is read
    _say(f"reading {checkpoint}")
    mlp = load_checkpoint(checkpoint)
    check_aesthetic_mlp(mlp, f"checkpoint {checkpoint.name}")
    _say(f"reading the image tower in {clip_dir}")
    clip_config, clip_weights, clip_names = read_clip_folder(clip_dir)
    _say(f"checking the MLP and {len(clip_weights)} image-tower tensors")
    config, vision, mlp = convert_aesthetic(mlp, clip_config, clip_weights, args.dtype, clip_names)
    _set_dtype(config, _dtype_name(vision) if args.dtype == "keep" else args.dtype)
    _say(f"writing {out}")
    files = {"config.json": config, "model.safetensors": vision, "aesthetic_mlp.safetensors": mlp}
    files["reward_config.json"] = {
        "reward": "aesthetic",
        "converted_from": checkpoint.name,
        "clip_from": clip_dir.resolve().name,
        "format": FORMAT,
    }
    return write_folder(out, files)


def run_imagereward(args) -> Path:
    checkpoint = Path(args.checkpoint).expanduser()
    out = check_out_dir(args.out, args.overwrite, [checkpoint])
    _check_dtype(args.dtype)
    tokenizer = blip_tokenizer(args.tokenizer)  # a wrong folder is refused before the release
    _say(f"reading {checkpoint}")
    state_dict = load_checkpoint(checkpoint)
    _say(f"checking {len(state_dict)} tensors against ImageReward's layout")
    config, weights = convert_imagereward(state_dict, args.dtype, f"checkpoint {checkpoint.name}")
    del state_dict
    files = {"config.json": config, "model.safetensors": weights}
    files |= tokenizer_files(tokenizer, config["vocab_size"], args.tokenizer)
    files["reward_config.json"] = {
        "reward": "imagereward",
        "converted_from": checkpoint.name,
        "format": FORMAT,
    }
    _say(f"writing {out}")
    return write_folder(out, files)


_COMMANDS = {"hpsv2": run_hpsv2, "aesthetic": run_aesthetic, "imagereward": run_imagereward}


def _parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="python -m tree_grpo_jax.rewards.convert",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{hpsv2,aesthetic,imagereward}"
    )
    hps = commands.add_parser(
        "hpsv2",
        help="HPS-v2.1 (an open_clip ViT CLIP) -> a transformers CLIP folder",
        allow_abbrev=False,
    )
    hps.add_argument(
        "--checkpoint", required=True, help="the release file, e.g. HPS_v2.1_compressed.pt"
    )
    hps.add_argument(
        "--open-clip-config", help="an open_clip model config JSON (default: ViT-H-14)"
    )
    hps.add_argument("--tokenizer", help="a Hugging Face CLIP folder to copy the tokenizer from")
    aes = commands.add_parser(
        "aesthetic", help="LAION aesthetic predictor v2 + its CLIP image tower", allow_abbrev=False
    )
    aes.add_argument(
        "--checkpoint",
        required=True,
        help="the release file, e.g. sac+logos+ava1-l14-linearMSE.pth",
    )
    aes.add_argument(
        "--clip", required=True, help="a transformers CLIP folder (openai/clip-vit-large-patch14)"
    )
    ir = commands.add_parser(
        "imagereward",
        help="ImageReward v1.0 (BLIP) -> a folder of safetensors and JSON",
        allow_abbrev=False,
    )
    ir.add_argument("--checkpoint", required=True, help="the release file, ImageReward.pt")
    ir.add_argument("--tokenizer", required=True, help="a bert-base-uncased folder (vocab.txt)")
    for sub in (hps, aes, ir):
        sub.add_argument("--out", required=True, help="the new reward folder")
        sub.add_argument(
            "--dtype",
            default="float32",
            choices=sorted(OUTPUT_DTYPES),
            help="of the weights (MLP heads stay float32)",
        )
        sub.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def _stop_line(out: Path, started: float):
    """The line of a Ctrl-C or SIGTERM: the staged folder is either not in place yet (it is
    removed) or was moved into place whole before the stop (the swap is never cut)."""

    def line(name: str) -> str:
        try:  # a reward_config.json newer than this run: the new folder is in place
            whole = (out / "reward_config.json").stat().st_mtime >= started
        except OSError:
            whole = False
        if whole:
            return f"{name} stopped the conversion after {out} was written whole."
        return (
            f"{name} stopped the conversion; nothing was written (the output folder is as it was)."
        )

    return line


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help 0
        return e.code if isinstance(e.code, int) else 2
    interrupts.set_stop_line(_stop_line(Path(args.out).expanduser(), time.time()))
    try:
        out = _COMMANDS[args.command](args)
    except ConversionError as e:
        print(f"error: {first_line(e, default='').rstrip('.')}.", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be read or written (permissions, disk full)
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not read or write{where}: {e.strerror or e}.", file=sys.stderr)
        return 2
    interrupts.set_stop_line(
        lambda name: f"{name} arrived after the conversion was done; {out} is written whole."
    )
    _say(f"done: {out} ({_size_text(_folder_size(out))})")
    return 0
