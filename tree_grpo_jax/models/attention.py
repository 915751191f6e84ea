"""Attention by name: one call, several kernels.

`attention(query, key, value, backend=...)` takes jax.nn's layout, [batch, length, heads,
head_dim], and gives the same values with any backend:
- "xla": `jax.nn.dot_product_attention` as XLA lowers it: the [heads, Lq, Lk] scores are
  materialised (in float32), and so is their softmax for the backward pass;
- "blockwise": pure JAX, any platform: an online softmax over blocks of keys, so no more than
  [heads, Lq, block] scores live at once, with its own backward pass that recomputes them
  from the output and the log-sum-exp (the FlashAttention recurrence), so the training
  step keeps O(L) per head instead of O(L^2);
- "cudnn": jax.nn's fused cuDNN kernel (NVIDIA GPUs; float16/bfloat16 inputs);
- "pallas": the Pallas flash-attention kernel for TPUs;
- "auto": cudnn on a GPU, pallas on a TPU, and elsewhere blockwise once the scores would be
  large (`AUTO_BLOCKWISE_SCORES`), xla below that.
`resolve` says which backend a platform will run, `plan_backend` which one a memory plan
compiles in place of a kernel its platform lacks, and `check_platform` refuses such a kernel
to a run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from tree_grpo_jax.models import base

BACKENDS = ("xla", "blockwise", "cudnn", "pallas", "auto")
DEFAULT_BLOCK = 512  # keys per block: [heads, Lq, 512] float32 scores at a time
# Above this many scores per head (Lq * Lk), "auto" leaves XLA's materialised softmax
# (FLUX at 1024 px: 4,608 tokens, 21M scores a head).
AUTO_BLOCKWISE_SCORES = 4096 * 4096
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a fully masked row gives no NaN


def resolve(backend: str, platform: str, query_len: int = 0, key_len: int = 0) -> str:
    """The backend that runs on `platform` ("cpu", "gpu", "tpu") for `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}.")
    if backend != "auto":
        return backend
    if platform == "gpu":
        return "cudnn"
    if platform == "tpu":
        return "pallas"
    return "blockwise" if query_len * key_len > AUTO_BLOCKWISE_SCORES else "xla"


# The fused kernel of each accelerator platform.
NATIVE_KERNELS = {"gpu": "cudnn", "tpu": "pallas"}
_KERNEL_DEVICES = {"gpu": "NVIDIA GPUs", "tpu": "TPUs"}


def check_platform(attention: str, platform: str) -> str | None:
    """One sentence when `attention` (model.attention) names a fused kernel that `platform`
    lacks: a run cannot compile it there (a memory plan compiles "blockwise" in its place,
    see `plan_backend`); None otherwise."""
    home = next((p for p, kernel in NATIVE_KERNELS.items() if kernel == attention), None)
    if home is None or home == platform:
        return None
    return (
        f"model.attention={attention} is the fused kernel of {_KERNEL_DEVICES[home]}, but "
        f"this run's devices are {platform.upper()}s; set --config.model.attention=auto "
        "(each platform's best) or blockwise (any platform)."
    )


def plan_backend(backend: str, platform: str) -> tuple[str, str]:
    """(the backend a memory plan on `platform` compiles for a run asking for `backend`, a
    note when that is not the run's own): a fused kernel this platform lacks ("cudnn" or
    "pallas" on a CPU plan, or "auto", which picks one on a GPU or TPU) is compiled as
    "blockwise", whose memory is of the kernels' order (O(L) per head)."""
    resolve(backend, platform)  # an unknown name: one sentence
    if backend == "auto" and platform not in NATIVE_KERNELS:
        return "blockwise", (
            "attention: the run's auto backend picks the cudnn kernel on GPUs and the pallas "
            f"kernel on TPUs; this {platform.upper()} plan compiles the blockwise backend in "
            "their place (the same O(L) memory order)"
        )
    if backend in NATIVE_KERNELS.values() and NATIVE_KERNELS.get(platform) != backend:
        where = next(p for p, k in NATIVE_KERNELS.items() if k == backend).upper()
        return "blockwise", (
            f"attention: the run uses the {backend} kernel on its {where}s; this "
            f"{platform.upper()} plan compiles the blockwise backend in its place (the same "
            "O(L) memory order)"
        )
    return backend, ""


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    backend: str = "xla",
    mask: jax.Array | None = None,
    block_size: int = DEFAULT_BLOCK,
) -> jax.Array:
    """Softmax(q k^T / sqrt(d) [masked]) v over [batch, length, heads, head_dim] arrays;
    `mask` broadcasts to [batch, heads, Lq, Lk], True where a query may attend a key.
    Where the run splits tokens over devices (`base.sequence_layout`), each device attends
    every token for a slice of the heads in between."""
    layout = base.attention_layout()
    if layout is None:
        return _attend(query, key, value, backend, mask, block_size)
    query, key, value = (layout.heads(x) for x in (query, key, value))
    return layout.tokens(_attend(query, key, value, backend, mask, block_size))


def _attend(query, key, value, backend, mask, block_size):
    backend = resolve(backend, jax.default_backend(), query.shape[1], key.shape[1])
    if backend == "xla":
        return jax.nn.dot_product_attention(query, key, value, mask=mask, implementation="xla")
    if backend == "cudnn":
        return jax.nn.dot_product_attention(query, key, value, mask=mask, implementation="cudnn")
    if backend == "pallas":
        return _pallas(query, key, value, mask)
    return blockwise_attention(query, key, value, mask=mask, block_size=block_size)


def _pallas(query, key, value, mask):
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    if mask is not None:
        raise ValueError("the pallas attention backend takes no mask; use blockwise or xla.")
    # The kernel's layout is [batch, heads, length, head_dim].
    q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))
    out = tpu_flash.flash_attention(q, k, v, sm_scale=1.0 / math.sqrt(query.shape[-1]))
    return out.swapaxes(1, 2)


# ---------------------------------------------------------------------------------------------
# Blockwise: an online softmax over key blocks, with a backward pass that recomputes.


def blockwise_attention(query, key, value, *, mask=None, block_size: int = DEFAULT_BLOCK):
    """The "blockwise" backend (see the module's docstring)."""
    batch, q_len, heads, _ = query.shape
    k_len = key.shape[1]
    if mask is None:
        mask = jnp.ones((1, 1, 1, k_len), bool)
    mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], mask.shape[2], k_len))
    block = max(1, min(block_size, k_len))
    pad = -k_len % block
    if pad:  # padded keys are masked out
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        key, value = jnp.pad(key, widths), jnp.pad(value, widths)
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=False)
    return _blockwise(query, key, value, mask, block)


def _key_blocks(x, block):
    """[B, L, H, D] -> [L/block, B, block, H, D], the scan's leading axis."""
    b, length, h, d = x.shape
    return x.reshape(b, length // block, block, h, d).swapaxes(0, 1)


def _mask_blocks(mask, block):
    """[b, h, q, L] -> [L/block, b, h, q, block]."""
    b, h, q, length = mask.shape
    return mask.reshape(b, h, q, length // block, block).transpose(3, 0, 1, 2, 4)


def _scores(q, k_block, mask_block, scale):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k_block, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask_block, s, _MASKED)


def _forward(query, key, value, mask, block):
    scale = 1.0 / math.sqrt(query.shape[-1])
    batch, q_len, heads, dim = query.shape
    value_dim = value.shape[-1]

    def step(carry, blocks):
        out, row_max, row_sum = carry
        k_block, v_block, mask_block = blocks
        s = _scores(query, k_block, mask_block, scale)  # [B, H, Q, block]
        new_max = jnp.maximum(row_max, s.max(-1))
        p = jnp.exp(s - new_max[..., None])
        correction = jnp.exp(row_max - new_max)
        row_sum = row_sum * correction + p.sum(-1)
        pv = jnp.einsum("bhqk,bkhd->bhqd", p, v_block.astype(jnp.float32))
        out = out * correction[..., None] + pv
        return (out, new_max, row_sum), None

    init = (
        jnp.zeros((batch, heads, q_len, value_dim), jnp.float32),
        jnp.full((batch, heads, q_len), _MASKED, jnp.float32),
        jnp.zeros((batch, heads, q_len), jnp.float32),
    )
    blocks = (_key_blocks(key, block), _key_blocks(value, block), _mask_blocks(mask, block))
    (out, row_max, row_sum), _ = jax.lax.scan(step, init, blocks)
    out = out / row_sum[..., None]
    logsumexp = row_max + jnp.log(row_sum)  # [B, H, Q]
    return out.transpose(0, 2, 1, 3).astype(query.dtype), logsumexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(query, key, value, mask, block):
    return _forward(query, key, value, mask, block)[0]


def _blockwise_fwd(query, key, value, mask, block):
    out, logsumexp = _forward(query, key, value, mask, block)
    return out, (query, key, value, mask, out, logsumexp)


def _blockwise_bwd(block, residuals, d_out):
    query, key, value, mask, out, logsumexp = residuals
    scale = 1.0 / math.sqrt(query.shape[-1])
    d_out32 = d_out.astype(jnp.float32)
    # D_i = sum_j dO_ij O_ij: the softmax's Jacobian-vector term, per query row.
    row_dot = jnp.einsum("bqhd,bqhd->bhq", d_out32, out.astype(jnp.float32))

    def step(d_query, blocks):
        k_block, v_block, mask_block = blocks
        s = _scores(query, k_block, mask_block, scale)
        p = jnp.exp(s - logsumexp[..., None])  # the forward's softmax, recomputed
        d_value = jnp.einsum("bhqk,bqhd->bkhd", p, d_out32)
        d_p = jnp.einsum("bqhd,bkhd->bhqk", d_out32, v_block.astype(jnp.float32))
        d_s = p * (d_p - row_dot[..., None]) * scale
        d_query = d_query + jnp.einsum("bhqk,bkhd->bqhd", d_s, k_block.astype(jnp.float32))
        d_key = jnp.einsum("bhqk,bqhd->bkhd", d_s, query.astype(jnp.float32))
        return d_query, (d_key, d_value)

    blocks = (_key_blocks(key, block), _key_blocks(value, block), _mask_blocks(mask, block))
    d_query, (d_key, d_value) = jax.lax.scan(step, jnp.zeros(query.shape, jnp.float32), blocks)

    def unblock(x, like):  # [L/block, B, block, H, D] -> [B, L, H, D]
        x = x.swapaxes(0, 1)
        return x.reshape(like.shape).astype(like.dtype)

    return (
        d_query.astype(query.dtype),
        unblock(d_key, key),
        unblock(d_value, value),
        None,
    )


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
