"""Writes tiny random Stable Diffusion 1.5 and 3.5 folders in the real diffusers layout, for a
smoke run of the SD configs without downloading any weights.

    python launch/tiny_folders.py --out=/tmp/tiny_sd      # -> /tmp/tiny_sd/sd15, /tmp/tiny_sd/sd35

The folders are the ones the tests build (`tests/sd_fixtures.py`, `tests/sd3_fixtures.py`):
diffusers' and transformers' PyTorch classes with random weights, saved with
`save_pretrained` as the releases hold them (UNet, VAE, CLIP text encoder and tokenizer, DDIM
scheduler; SD3.5's MMDiT with dual-attention layers, its 16-channel VAE, CLIP-L, CLIP-G, a
sharded T5 and the flow-matching scheduler), only a few thousand times smaller. Writing them
needs torch, diffusers and transformers: the test extra (`pip install -e ".[test]"`). Training
on them needs none of torch. The samples are noise: the folders check that a config runs, not
what it learns.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("sd15", "sd35")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="/tmp/tiny_sd", help="parent folder of sd15/ and sd35/")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace folders that already exist")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, pathlib.Path]:
    args = parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"error: unknown kind(s) {unknown}; choose from {', '.join(KINDS)}.")
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"error: {e.name} is not installed; writing the tiny folders needs torch, diffusers "
            'and transformers: pip install -e ".[test]"'
        ) from None
    # The fixtures live in tests/ and import each other by their module names.
    sys.path.insert(0, str(ROOT / "tests"))
    from sd3_fixtures import make_tiny_sd3_folder
    from sd_fixtures import make_tiny_sd_folder

    makers = {"sd15": make_tiny_sd_folder, "sd35": make_tiny_sd3_folder}
    out = pathlib.Path(args.out)
    written = {}
    for kind in kinds:
        folder = out / kind
        if folder.exists() and any(folder.iterdir()):
            if not args.force:
                raise SystemExit(f"error: {folder} exists and is not empty; --force replaces it.")
            shutil.rmtree(folder)
        start = time.perf_counter()
        written[kind] = makers[kind](folder, seed=args.seed)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(
            f"{kind}: {folder} ({size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return written


if __name__ == "__main__":
    main()
