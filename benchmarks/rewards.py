"""Scoring throughput of the CLIP reward models: images per second through the image path
(preprocessing from 512x512 decoded images, the image tower, the score), and prompts per
second through the text tower, for ViT-L/14 (aesthetic, CLIP score) and ViT-H/14 (HPS-v2.1,
PickScore) at their real sizes with random weights (timing does not need trained ones).

    python -m benchmarks.rewards                      # both towers, batch 4, float32, this CPU
    python -m benchmarks.rewards --dtype bfloat16 --batch 16
    python -m benchmarks.rewards --smoke              # tiny towers: checks the code in seconds
    python -m benchmarks.rewards --out benchmarks/results   # updates the committed results

The scorers are built by the library's `rewards.clip.make_scorer` exactly as `load_reward`
builds them from a folder. Figures: median over `--reps` timed calls after one warm-up call
(whose time, mostly compilation, is reported apart). Results go to
`<out>/rewards_<backend>.json`: `runs/benchmarks/rewards` (git-ignored, under the working
directory; with --smoke a temporary folder) unless --out is given. The committed results in
`benchmarks/results/` change only with `--out benchmarks/results`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import OneLineErrors

# The two architectures the preference rewards use (transformers CLIPConfig fields).
ARCHITECTURES = {
    "vit_l14": dict(  # openai/clip-vit-large-patch14: aesthetic, clip_score
        projection_dim=768,
        text_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, hidden_act="quick_gelu"),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, patch_size=14, image_size=224,
                           hidden_act="quick_gelu"),
    ),
    "vit_h14": dict(  # laion ViT-H-14: HPS-v2.1, PickScore
        projection_dim=1024,
        text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, hidden_act="gelu"),
        vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                           num_attention_heads=16, patch_size=14, image_size=224,
                           hidden_act="gelu"),
    ),
}  # fmt: skip
SMOKE = dict(
    projection_dim=16,
    text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, patch_size=14, image_size=224),
)  # fmt: skip


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="vit_l14,vit_h14", help="comma-separated architectures")
    p.add_argument("--batch", type=int, default=4, help="images per call")
    p.add_argument("--image-size", type=int, default=512, help="decoded image side")
    p.add_argument("--chunk-size", type=int, default=16, help="images through the tower at once")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--reps", type=int, default=5, help="timed calls")
    p.add_argument("--smoke", action="store_true", help="tiny towers, 1 rep")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default runs/benchmarks/rewards; smoke: a temporary one; "
        "benchmarks/results updates the committed results)",
    )
    return p.parse_args(argv)


def _timed(fn, reps: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, times


def random_scorer(fields: dict, dtype: str, chunk_size: int, seed: int = 0):
    """A CLIP scorer of the given architecture with random weights (no tokenizer)."""
    from transformers import CLIPConfig

    from tree_grpo_jax.models import clip as clip_model
    from tree_grpo_jax.rewards import clip

    config = CLIPConfig(**fields)
    module = clip_model.CLIPModel(config)
    params = jax.jit(lambda key: clip_model.init_clip(module, key))(jax.random.PRNGKey(seed))
    return clip.make_scorer(
        config, params, layout="resize_crop_hf", dtype=dtype, chunk_size=chunk_size
    )


def measure(name: str, fields: dict, args) -> dict:
    scorer = random_scorer(fields, args.dtype, args.chunk_size)
    count = sum(x.size for x in jax.tree_util.tree_leaves(scorer.params))
    rng = np.random.default_rng(0)
    images = jnp.asarray(
        rng.uniform(0, 1, (args.batch, args.image_size, args.image_size, 3)), jnp.float32
    )
    image_path = jax.jit(scorer.image_embeddings)
    first, times = _timed(lambda: image_path(scorer.params, images), args.reps)
    image_s = statistics.median(times)

    context = scorer.max_length
    ids = jnp.asarray(rng.integers(1, 1000, (args.batch, context)), jnp.int32)
    mask = jnp.ones_like(ids)
    text_path = jax.jit(scorer.token_embeddings)
    text_first, text_times = _timed(lambda: text_path(scorer.params, ids, mask), args.reps)
    text_s = statistics.median(text_times)
    row = {
        "params_millions": count / 1e6,
        "batch": args.batch,
        "image_size": args.image_size,
        "dtype": args.dtype,
        "image_first_call_s": first,
        "image_call_s": {"median": image_s, "all": times},
        "images_per_s": args.batch / image_s,
        "text_first_call_s": text_first,
        "text_call_s": {"median": text_s, "all": text_times},
        "prompts_per_s": args.batch / text_s,
    }
    print(
        f"{name}: {count / 1e6:.0f}M params, {args.dtype}, batch {args.batch}: "
        f"{row['images_per_s']:.2f} images/s (median {image_s:.3f} s per call; first call "
        f"{first:.1f} s), {row['prompts_per_s']:.1f} prompts/s",
        flush=True,
    )
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.reps = 1
    device = jax.devices()[0]
    results = {
        "command": "python -m benchmarks.rewards "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "models": {},
    }
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for name in names:
        if name not in ARCHITECTURES:
            raise SystemExit(f"unknown model {name!r}; choose from {sorted(ARCHITECTURES)}.")
        fields = SMOKE if args.smoke else ARCHITECTURES[name]
        results["models"][name] = measure(name, fields, args)
    from benchmarks.common import default_out

    # Smoke figures check the code, not the speed: they stay out of the results folder.
    smoke_dir = os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks")
    out = args.out or (smoke_dir if args.smoke else default_out("rewards"))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rewards_{results['backend']}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"results in {path}", flush=True)
    return results


if __name__ == "__main__":
    main()
