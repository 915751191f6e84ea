"""What `mesh.sequence` moves between devices: the all-to-alls of every attention call when each
sample's tokens are split over the 'sequence' axis (Ulysses, `run/denoiser.py`), counted from
the model's own shapes.

Between blocks each of a sample's s devices holds 1/s of its tokens; an attention call takes q,
k and v to every token and 1/s of the heads, and its output back. Re-laying an array of `b`
bytes (one row, every token, every head) that way, a device holds b / s of it and keeps 1/s of
that, so it sends b (s - 1) / s^2. One denoiser row's arrays are read off the denoiser itself:
it is traced (`jax.make_jaxpr`, shapes only) with a layout that marks each array
`models.attention.attention` re-lays, and the marks are summed with each scan's length, so a
family needs no table of its layers, tokens or widths. Cross-attention's k and v (Wan's text)
are counted too, though each device holds them whole and slices them without sending: an upper
bound, by the text's share of the tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tree_grpo_jax.models import base

HEADS, TOKENS = "sequence_to_heads", "sequence_to_tokens"  # the marks' names in the jaxpr


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One denoiser row's attention arrays in one forward pass, whole (every token and head),
    in bytes of the activation dtype, and the mesh they are exchanged over."""

    sequence: int  # devices a sample's tokens split over
    batch_shards: int  # devices a batch's rows split over (data x fsdp)
    to_heads: int  # q, k and v of every attention call
    to_tokens: int  # every attention call's output
    attention_calls: int
    evaluate_rows: float = 0.0  # denoiser rows of one evaluation (the whole batch's)


def sent_bytes(array_bytes: float, sequence: int) -> float:
    """Bytes one device sends to re-lay an array of `array_bytes` between tokens split over
    `sequence` devices and heads split over them (either way)."""
    return array_bytes * (sequence - 1) / sequence**2


def _marked(name: str):
    def mark(x):
        return x

    mark.__name__ = name
    return jax.jit(mark)


def _marks(jaxpr, repeat: int, out: dict) -> None:
    """Adds to `out` [name] the bytes of every marked array in `jaxpr`, each `repeat` times
    (a scan's body runs `length` times; of a conditional's branches the largest counts)."""
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if eqn.primitive.name in ("pjit", "jit") and name in (HEADS, TOKENS):
            # (tracing leaves pruned copies without operands beside the live ones)
            for v in eqn.invars:
                out[name] += repeat * v.aval.size * jnp.dtype(v.aval.dtype).itemsize
                out["calls"] += repeat * (name == TOKENS)
            continue
        times = repeat * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else repeat
        for value in eqn.params.values():
            subs = value if isinstance(value, tuple | list) else (value,)
            subs = [getattr(s, "jaxpr", s) for s in subs]
            subs = [s for s in subs if isinstance(s, jax.extend.core.Jaxpr)]
            best = None
            for sub in subs:
                found = {HEADS: 0, TOKENS: 0, "calls": 0}
                _marks(sub, times, found)
                if best is None or sum(found.values()) > sum(best.values()):
                    best = found
                if eqn.primitive.name != "cond":  # every sub-program runs
                    for k in out:
                        out[k] += found[k]
                    best = None
            if best is not None:
                for k in out:
                    out[k] += best[k]


def row_arrays(model) -> dict[str, int]:
    """One denoiser row's attention arrays in one forward pass, whole, in bytes:
    {"sequence_to_heads": q, k and v, "sequence_to_tokens": the outputs, "calls": attention
    calls}, from the denoiser traced on shapes."""
    row = jax.ShapeDtypeStruct((1, *model.sample_shape), jnp.float32)
    cond = jax.ShapeDtypeStruct((1, *model.cond_shape), jnp.float32)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    layout = base.SequenceLayout(heads=_marked(HEADS), tokens=_marked(TOKENS))

    def denoise(params, x, t, cond):
        with base.sequence_layout(layout):
            return model.denoise(params, x, t, cond)

    traced = jax.make_jaxpr(denoise)(model.params, row, t, cond)
    out = {HEADS: 0, TOKENS: 0, "calls": 0}
    _marks(traced.jaxpr, 1, out)
    return out


def exchange(model, sequence: int, batch_shards: int) -> Exchange | None:
    """The model's `Exchange` on a mesh splitting tokens over `sequence` devices (None for 1:
    nothing moves)."""
    if sequence <= 1:
        return None
    arrays = row_arrays(model)
    return Exchange(sequence, batch_shards, arrays[HEADS], arrays[TOKENS], arrays["calls"])


def passes(remat: str, differentiated: bool) -> tuple[float, float]:
    """(times q, k and v, times the outputs) are exchanged per row: once in the forward; again
    in the backward, whose cotangents take the same all-to-alls back; and with remat, again
    when the backward recomputes the forward (with "block_save_attention" the output is kept,
    and q, k and v, kept in the tokens' layout, go to the heads again)."""
    if not differentiated:
        return 1.0, 1.0
    if remat == "none":
        return 2.0, 2.0
    return 3.0, 2.0 if remat == "block_save_attention" else 3.0


def bytes_per_device(
    ex: Exchange, rows: float, grad_rows: float = 0.0, remat: str = "none"
) -> float:
    """Bytes one device sends in one program call that runs `rows` denoiser rows forward (over
    the whole batch, every device's) of which `grad_rows` are differentiated."""
    heads_f, tokens_f = passes(remat, False)
    heads_g, tokens_g = passes(remat, True)
    forward_only = max(rows - grad_rows, 0.0)
    per_row = (
        forward_only * (heads_f * ex.to_heads + tokens_f * ex.to_tokens)
        + grad_rows * (heads_g * ex.to_heads + tokens_g * ex.to_tokens)
    ) / ex.batch_shards
    return sent_bytes(per_row, ex.sequence)
