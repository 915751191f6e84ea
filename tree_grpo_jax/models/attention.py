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
to a run. Where a run splits each sample's tokens over devices and the split does not divide
the heads, `attention` runs `ring_attention` (the blockwise maths, the key/value slices
passed from device to device) in place of the backend.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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
    Where the run splits tokens over devices (`base.sequence_layout`): when the axis divides
    the heads, each device attends every token for a slice of the heads in between
    (Ulysses); otherwise, when it divides the query and key lengths, each device keeps its
    slice of the queries and the key/value slices pass around the ring (`ring_attention`,
    the blockwise backend's maths whatever `backend` says); when it divides neither, the
    compiler lays attention out as it likes."""
    layout = base.attention_layout()
    if layout is None:
        return _attend(query, key, value, backend, mask, block_size)
    if layout.mesh is not None and query.shape[2] % layout.size:
        size = layout.size
        if query.shape[1] % size == 0 and key.shape[1] % size == 0:
            return ring_attention(
                query,
                key,
                value,
                mesh=layout.mesh,
                axis=layout.axis,
                mask=mask,
                block_size=block_size,
            )
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
    key, value, mask, block = _padded_keys(key, value, _key_mask(mask, key.shape[1]), block_size)
    return _blockwise(query, key, value, mask, block)


def _key_mask(mask, k_len):
    """`mask` (None, or broadcasting to [b, h, q, L]) as a 4-d bool array with all L keys."""
    if mask is None:
        return jnp.ones((1, 1, 1, k_len), bool)
    mask = jnp.asarray(mask, bool)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return jnp.broadcast_to(mask, (*mask.shape[:3], k_len))


def _padded_keys(key, value, mask, block_size):
    """(key, value, mask, block): keys padded, masked out, to a whole number of blocks."""
    k_len = key.shape[1]
    block = max(1, min(block_size, k_len))
    pad = -k_len % block
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        key, value = jnp.pad(key, widths), jnp.pad(value, widths)
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=False)
    return key, value, mask, block


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


def _start(query, value_dim):
    """The online softmax before any key: (output sum, row max, row sum), float32."""
    batch, q_len, heads, _ = query.shape
    return (
        jnp.zeros((batch, heads, q_len, value_dim), jnp.float32),
        jnp.full((batch, heads, q_len), _MASKED, jnp.float32),
        jnp.zeros((batch, heads, q_len), jnp.float32),
    )


def _accumulate(stats, query, key, value, mask, block):
    """`stats` (`_start`'s) after the keys of `key`, `value` and `mask` (their length a
    multiple of `block`), a block at a time."""
    scale = 1.0 / math.sqrt(query.shape[-1])

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

    blocks = (_key_blocks(key, block), _key_blocks(value, block), _mask_blocks(mask, block))
    return jax.lax.scan(step, stats, blocks)[0]


def _finish(stats, dtype):
    """(output [B, Q, H, D] in `dtype`, log-sum-exp [B, H, Q]) from the final `stats`."""
    out, row_max, row_sum = stats
    out = out / row_sum[..., None]
    logsumexp = row_max + jnp.log(row_sum)
    return out.transpose(0, 2, 1, 3).astype(dtype), logsumexp


def _forward(query, key, value, mask, block):
    stats = _accumulate(_start(query, value.shape[-1]), query, key, value, mask, block)
    return _finish(stats, query.dtype)


def _row_dot(out, d_out):
    """D_i = sum_j dO_ij O_ij: the softmax's Jacobian-vector term, per query row."""
    return jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))


def _gradients(query, key, value, mask, block, logsumexp, row_dot, d_out, d_query):
    """The backward pass over the keys of `key`, `value`, `mask`: (d_query plus their share,
    d_key, d_value), float32, the forward's softmax recomputed from its log-sum-exp."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    d_out32 = d_out.astype(jnp.float32)

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
    d_query, (d_key, d_value) = jax.lax.scan(step, d_query, blocks)

    def unblock(x, like):  # [L/block, B, block, H, D] -> [B, L, H, D]
        return x.swapaxes(0, 1).reshape(*like.shape[:3], x.shape[-1])

    return d_query, unblock(d_key, key), unblock(d_value, value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(query, key, value, mask, block):
    return _forward(query, key, value, mask, block)[0]


def _blockwise_fwd(query, key, value, mask, block):
    out, logsumexp = _forward(query, key, value, mask, block)
    return out, (query, key, value, mask, out, logsumexp)


def _blockwise_bwd(block, residuals, d_out):
    query, key, value, mask, out, logsumexp = residuals
    d_query, d_key, d_value = _gradients(
        query,
        key,
        value,
        mask,
        block,
        logsumexp,
        _row_dot(out, d_out),
        d_out,
        jnp.zeros(query.shape, jnp.float32),
    )
    return (*_cast_like((d_query, d_key, d_value), (query, key, value)), None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def _cast_like(gradients, inputs) -> tuple:
    """Gradients accumulated in float32, each in its input's dtype."""
    return tuple(g.astype(x.dtype) for g, x in zip(gradients, inputs))


# ---------------------------------------------------------------------------------------------
# Ring: each device keeps its slice of the queries while the key/value slices travel around
# the sequence axis, each combined into the blockwise backend's online softmax as it passes.


def ring_attention(
    query, key, value, *, mesh, axis: str, mask=None, block_size: int = DEFAULT_BLOCK
):
    """Attention with the tokens of `query`, `key` and `value` split over the `axis` of
    `mesh`: each device attends its query slice to every key/value slice in turn as they
    pass around the ring (one `jax.lax.ppermute` of a key/value slice per step, size - 1
    steps; the backward pass sends the keys' gradients along with them), combining them in
    the blockwise backend's online softmax. Each device holds `mask` for its queries and
    every key (a key mask [B, 1, 1, Lk] whole). The other mesh axes stay with the compiler.
    Both lengths must divide by the axis's size (one sentence otherwise)."""
    size = mesh.shape[axis]
    q_len, k_len = query.shape[1], key.shape[1]
    if q_len % size or k_len % size:
        raise ValueError(
            f"ring attention splits {q_len} query and {k_len} key tokens over the {size} "
            f"devices of mesh axis {axis!r}, which must divide both."
        )
    mask = _key_mask(mask, k_len)
    tokens = P(None, axis)
    mask_spec = P(None, None, axis if mask.shape[2] == q_len else None, None)
    body = functools.partial(_ring_slice, axis=axis, size=size, block_size=block_size)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, mask_spec),
        out_specs=tokens,
        axis_names={axis},
        check_vma=False,
    )(query, key, value, mask)


def _ring_slice(query, key, value, mask, *, axis, size, block_size):
    """One device's part: its queries, its key/value slice and the mask of its queries,
    each slice's keys padded (masked out) to whole blocks."""
    key, value, _, block = _padded_keys(key, value, mask[..., : key.shape[1]], block_size)
    b, h, q, _ = mask.shape
    slices = mask.reshape(b, h, q, size, -1)
    pad = key.shape[1] - slices.shape[-1]
    slices = jnp.pad(slices, ((0, 0),) * 4 + ((0, pad),), constant_values=False)
    return _ring(query, key, value, slices.reshape(b, h, q, -1), block, axis, size)


def _pass_on(x, axis, size):
    """`x` (a tree) from each device of the ring to the next."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])


def _held_mask(mask, step, axis, size):
    """The mask's keys of the slice a device holds at ring step `step`: the slice of the
    device `step` places before it."""
    length = mask.shape[-1] // size
    owner = (jax.lax.axis_index(axis) - step) % size
    return jax.lax.dynamic_slice_in_dim(mask, owner * length, length, axis=3)


def _ring_forward(query, key, value, mask, block, axis, size):
    def visit(carry, step):
        stats, held = carry
        stats = _accumulate(stats, query, *held, _held_mask(mask, step, axis, size), block)
        return (stats, _pass_on(held, axis, size)), None

    start = (_start(query, value.shape[-1]), (key, value))
    (stats, held), _ = jax.lax.scan(visit, start, jnp.arange(size - 1))
    last = _held_mask(mask, size - 1, axis, size)
    return _finish(_accumulate(stats, query, *held, last, block), query.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(query, key, value, mask, block, axis, size):
    return _ring_forward(query, key, value, mask, block, axis, size)[0]


def _ring_fwd(query, key, value, mask, block, axis, size):
    out, logsumexp = _ring_forward(query, key, value, mask, block, axis, size)
    return out, (query, key, value, mask, out, logsumexp)


def _ring_bwd(block, axis, size, residuals, d_out):
    query, key, value, mask, out, logsumexp = residuals
    row_dot = _row_dot(out, d_out)

    def gradients(d_query, held, d_held, step):
        held_mask = _held_mask(mask, step, axis, size)
        d_query, d_key, d_value = _gradients(
            query, *held, held_mask, block, logsumexp, row_dot, d_out, d_query
        )
        return d_query, (d_held[0] + d_key, d_held[1] + d_value)

    # A slice's key/value gradients travel with it and reach its own device one step after
    # the last device has added its share.
    def visit(carry, step):
        d_query, held, d_held = carry
        d_query, d_held = gradients(d_query, held, d_held, step)
        return (d_query, _pass_on(held, axis, size), _pass_on(d_held, axis, size)), None

    zeros = (jnp.zeros(key.shape, jnp.float32), jnp.zeros(value.shape, jnp.float32))
    start = (jnp.zeros(query.shape, jnp.float32), (key, value), zeros)
    (d_query, held, d_held), _ = jax.lax.scan(visit, start, jnp.arange(size - 1))
    d_query, d_held = gradients(d_query, held, d_held, size - 1)
    d_key, d_value = _pass_on(d_held, axis, size)
    return (*_cast_like((d_query, d_key, d_value), (query, key, value)), None)


_ring.defvjp(_ring_fwd, _ring_bwd)
