"""LoRA against full fine-tuning: trainable parameters and optimizer-state bytes for the SD1.5
UNet and the SD3.5-Medium MMDiT at their real sizes (from `jax.eval_shape`: nothing is
allocated), and the train-step time of the tiny model, full and LoRA, measured side by side.

    python -m benchmarks.lora                 # -> runs/benchmarks/lora/lora.json
    python -m benchmarks.lora --out benchmarks/results   # updates the committed lora.json
    python -m benchmarks.lora --smoke --out /tmp/bench

Counts use the library's own selection (`lora.target_paths` with each family's `lora_targets`).
Optimizer state is AdamW's two float32 moments per trainable scalar; full fine-tuning also
keeps float32 master weights and gradients of every scalar, LoRA only of the factors (the
frozen base is stored once, in the compute dtype). The train-step times alternate full and
LoRA calls on the same minibatch; medians and their ratio are reported.
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

from tree_grpo_jax import lora
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.models.registry import family_of

RANKS = (4, 32, 128)


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=20, help="timed train steps of each kind")
    p.add_argument("--smoke", action="store_true", help="3 timed steps: checks the code")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default runs/benchmarks/lora; smoke: a temporary one; "
        "benchmarks/results updates the committed results)",
    )
    return p.parse_args(argv)


def sd15_shapes():
    from benchmarks.random_models import SD15_UNET
    from tree_grpo_jax.models.sd15.load import unet_reference_shapes
    from tree_grpo_jax.models.sd15.unet import unet_module

    return unet_reference_shapes(unet_module(SD15_UNET))


def sd35m_shapes():
    from benchmarks.random_models import SD35_MEDIUM
    from tree_grpo_jax.models.components import abstract_params
    from tree_grpo_jax.models.sd3 import mmdit
    from tree_grpo_jax.weights.convert import shapes_of

    return shapes_of(abstract_params(mmdit.transformer_module(SD35_MEDIUM)))


def counts(family: str, flat_shapes: dict) -> dict:
    from flax.traverse_util import unflatten_dict

    shapes = unflatten_dict(
        {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in flat_shapes.items()}
    )
    paths = lora.target_paths(shapes, family_of(family).lora_targets)
    base = lora.count_params(shapes)
    row = {
        "base_params": base,
        "adapted_kernels": len(paths),
        "full": {
            "trainable_params": base,
            "optimizer_state_bytes": 8 * base,
            "masters_grads_and_state_bytes": 16 * base,
        },
    }
    for rank in RANKS:
        trainable, _ = lora.lora_summary(shapes, paths, rank)
        row[f"rank_{rank}"] = {
            "trainable_params": trainable,
            "share_of_base": trainable / base,
            "optimizer_state_bytes": 8 * trainable,
            "masters_grads_and_state_bytes": 16 * trainable,
        }
    return row


def step_times(reps: int) -> dict:
    """The tiny model's train step, full and LoRA rank 4, alternating on one minibatch."""
    from tree_grpo_jax import sharding
    from tree_grpo_jax.config import base_config
    from tree_grpo_jax.core import transitions
    from tree_grpo_jax.run import loop as train

    def setup(rank):
        c = base_config()
        c.model.name = "random_tiny"
        c.prompts.batch_size = 2
        c.train.rows_per_minibatch = 16
        c.lora.rank = rank
        c.log.progress = False
        return train.setup(c, tempfile.mkdtemp())

    runs = {"full": setup(0), "lora_rank_4": setup(4)}
    trainer, state = runs["full"]
    sampled = trainer.rollout(
        state.params, trainer.host_state.prompts.next_batch(), jax.random.PRNGKey(0)
    )
    rewards = jax.random.normal(jax.random.PRNGKey(1), (2, sampled.spec.leaves))
    rows = trainer.trainable_rows(sampled, rewards)
    batch = transitions.minibatches(rows, jax.random.PRNGKey(2), 16)[0]
    batch = sharding.shard_batch(trainer.mesh, batch)
    holders = {name: {"state": s} for name, (_, s) in runs.items()}

    def call(name):
        t, holder = runs[name][0], holders[name]
        args = t.step_args(batch, sampled.cond, t.schedule(), 1e-5)
        t0 = time.perf_counter()
        holder["state"], metrics = t.train_step(holder["state"], *args)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - t0

    first = {name: call(name) for name in runs}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name in runs:
            times[name].append(call(name))
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "rows_per_step": 16,
        "first_call_s": first,
        "median_s": med,
        "all_s": times,
        "lora_over_full": med["lora_rank_4"] / med["full"],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    reps = 3 if args.smoke else args.reps
    results = {
        "command": "python -m benchmarks.lora " + " ".join(sys.argv[1:] if argv is None else argv),
        "backend": jax.default_backend(),
        "sd15_unet": counts("sd", sd15_shapes()),
        "sd35_medium_mmdit": counts("sd3", sd35m_shapes()),
        "tiny_train_step": step_times(reps),
    }
    for name in ("sd15_unet", "sd35_medium_mmdit"):
        row = results[name]
        text = ", ".join(
            f"rank {r}: {row[f'rank_{r}']['trainable_params'] / 1e6:.2f}M "
            f"({row[f'rank_{r}']['optimizer_state_bytes'] / 2**20:.0f} MiB Adam)"
            for r in RANKS
        )
        print(
            f"{name}: full {row['base_params'] / 1e6:.0f}M params "
            f"({row['full']['optimizer_state_bytes'] / 2**30:.1f} GiB Adam); {text}",
            flush=True,
        )
    steps = results["tiny_train_step"]
    print(
        f"tiny train step, 16 rows: full {steps['median_s']['full'] * 1e3:.1f} ms, LoRA rank 4 "
        f"{steps['median_s']['lora_rank_4'] * 1e3:.1f} ms (ratio {steps['lora_over_full']:.2f})",
        flush=True,
    )
    from benchmarks.common import default_out

    out = args.out or (
        os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks")
        if args.smoke
        else default_out("lora")
    )
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "lora.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"results in {path}", flush=True)
    return results


if __name__ == "__main__":
    main()
