"""Low-rank factors merged into Dense kernels: W + scale * a @ b, the sum LoRA's merge
(`tree_grpo_jax.lora`) and the models' scanned blocks both compute.

A scanned run of blocks may carry its factors beside its stacked kernels (`lora.attach`
puts an `Attached` under the key `ATTACHED` in each adapted module); the scan slices them
with the kernels, and the scan body merges its block's slice (`merge_attached`), so one
block's merged kernels exist at a time rather than a merged copy of every kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

ATTACHED = "lora_factors"  # the key, beside a Dense module's kernel, of its attached factors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Attached:
    """The factors of one stacked kernel, [layers, in, rank] and [layers, rank, out], and
    their scale alpha / rank (static: the scan slices the arrays only)."""

    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))


def merged_kernel(kernel, a, b, scale):
    """W + scale * a @ b, summed in (at least) float32 at full matmul precision and cast
    back to W's dtype; stacked kernels and factors ([layers, ...]) merge layer by layer."""
    dtype = jnp.promote_types(kernel.dtype, jnp.float32)
    delta = jnp.matmul(
        jnp.asarray(a, dtype), jnp.asarray(b, dtype), precision=jax.lax.Precision.HIGHEST
    )
    return (jnp.asarray(kernel, dtype) + scale * delta).astype(kernel.dtype)


def merge_attached(params):
    """`params` (one block's slice of a scanned run, as a dict of dicts) with every kernel
    that carries `Attached` factors merged with them and the factors dropped."""
    if not isinstance(params, Mapping):
        return params
    out = {k: merge_attached(v) for k, v in params.items() if k != ATTACHED}
    if ATTACHED in params:
        f = params[ATTACHED]
        out["kernel"] = merged_kernel(params["kernel"], f.a, f.b, f.scale)
    return out
