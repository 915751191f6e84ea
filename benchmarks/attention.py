"""Attention's memory by backend: XLA's per-device figures for one attention's forward and
backward, compiled (not run) at the papers' sequence lengths, with each backend side by side.

    python -m benchmarks.attention                      # -> runs/benchmarks/attention/
    python -m benchmarks.attention --out benchmarks/results

Each setting is `jax.grad` of a weighted sum of `attention(q, k, v)` over [batch, tokens,
heads, head_dim] float32 or bfloat16 arrays, lowered and compiled for this machine's CPU;
`memory_analysis()` gives the temporaries (what the scores and their softmax cost) and the
compile seconds are timed around `compile()`. On a GPU (`jax.default_backend() == "gpu"`)
the cudnn backend joins the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.common import default_out
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.models import attention as attn

# (name, tokens, heads, head_dim): SD3.5-M at 512 px (1024 image + 333 text tokens), FLUX at
# 512 px (1024 + 512) and at BranchGRPO's 720 px (2025 + 512) and at 1024 px (4096 + 512).
SETTINGS = [
    ("sd35m_512", 1357, 24, 64),
    ("flux_512", 1536, 24, 128),
    ("flux_720", 2537, 24, 128),
    ("flux_1024", 4608, 24, 128),
]
GB = 1e9


def measure(tokens: int, heads: int, head_dim: int, backend: str, dtype) -> dict:
    shape = jax.ShapeDtypeStruct((1, tokens, heads, head_dim), dtype)

    def loss(q, k, v):
        out = attn.attention(q, k, v, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * 1e-3)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return {
        "temp_gb": memory.temp_size_in_bytes / GB,
        "argument_gb": memory.argument_size_in_bytes / GB,
        "output_gb": memory.output_size_in_bytes / GB,
        "compile_s": seconds,
    }


def main(argv=None) -> None:
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=default_out("attention"), help="results folder")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    backends = ["xla", "blockwise"] + (["cudnn"] if jax.default_backend() == "gpu" else [])
    dtype = jnp.dtype(args.dtype)
    rows = []
    print(f"{'setting':<12} {'backend':<10} {'temp GB':>9} {'compile s':>10}")
    for name, tokens, heads, head_dim in SETTINGS:
        for backend in backends:
            figures = measure(tokens, heads, head_dim, backend, dtype)
            rows.append({"setting": name, "tokens": tokens, "backend": backend, **figures})
            print(
                f"{name:<12} {backend:<10} {figures['temp_gb']:>9.3f} {figures['compile_s']:>10.2f}"
            )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention.json")
    record = {"platform": jax.default_backend(), "dtype": args.dtype, "rows": rows}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
