"""The denoiser as the run calls it: its rows laid out over the mesh, and, in the rollout and
the evaluation, run over `sampling.denoise_rows` rows at a time.

Built once per run (`build.build`, and the memory plan from shapes), and kept for equal
settings: the jitted programs take the denoiser as a static argument, so the same function
object must reach every call.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_grpo_jax import sharding
from tree_grpo_jax.core.guidance import DenoiseFn, in_chunks
from tree_grpo_jax.models import base
from tree_grpo_jax.run import reuse


def rows_constraint(mesh, tokens: bool = False):
    """x [B, ...] -> x with its rows split over every device of `mesh` (an array whose rows
    do not divide is left as it is), or None where the compiler needs no help: with fsdp = 1
    and sequence = 1 nothing else competes for the batch's devices. With fsdp > 1 the weights
    are sharded over 'fsdp' and the compiler may otherwise split the activations' channels
    over it (SD1.5's convolutions) rather than gather the weights as FSDP means to.

    `tokens`: the activations between a DiT's blocks, [B, L, ...]: with sequence > 1 their
    tokens (dim 1, where the axis divides it) are split over 'sequence' as well, so that each
    device holds and computes a slice of every sample's tokens (Ulysses)."""
    sequence = sharding.sequence_size(mesh)
    if mesh.shape["fsdp"] == 1 and sequence == 1:
        return None
    shards = sharding.num_batch_shards(mesh)

    def constrain(x):
        if x.ndim == 0 or x.shape[0] % shards:
            return x
        spec = [sharding.BATCH_AXES] + [None] * (x.ndim - 1)
        if tokens and sequence > 1 and x.ndim >= 3 and x.shape[1] % sequence == 0:
            spec[1] = sharding.SEQUENCE_AXIS
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    return constrain


def attention_layout(mesh) -> base.SequenceLayout | None:
    """With sequence > 1, attention's [B, L, heads, head_dim] arrays (`base.SequenceLayout`):
    q, k and v with every token and a slice of the heads on each device, the output back to
    a slice of the tokens; where the heads do not divide, the mesh and its 'sequence' axis
    for ring attention (`models.attention.ring_attention`). A dimension the axis does not
    divide is left to the compiler."""
    sequence = sharding.sequence_size(mesh)
    if sequence == 1:
        return None
    shards = sharding.num_batch_shards(mesh)

    def split(dim):
        def constrain(x):
            if x.ndim != 4 or x.shape[0] % shards or x.shape[dim] % sequence:
                return x
            spec = [sharding.BATCH_AXES, None, None, None]
            spec[dim] = sharding.SEQUENCE_AXIS
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

        return constrain

    return base.SequenceLayout(
        heads=split(2), tokens=split(1), mesh=mesh, axis=sharding.SEQUENCE_AXIS
    )


def laid_out(denoise_fn: DenoiseFn, mesh) -> DenoiseFn:
    """`denoise_fn` with its inputs, its output and, through `models.base.row_layout`, the
    activations its family constrains between blocks, split by rows over the mesh (and by
    tokens over 'sequence', with attention laid out through `models.base.sequence_layout`)."""
    constrain = rows_constraint(mesh)
    if constrain is None:
        return denoise_fn
    between_blocks = rows_constraint(mesh, tokens=True)
    in_attention = attention_layout(mesh)

    def denoise(params, x, t, cond):
        x, t, cond = constrain(x), constrain(t), constrain(cond)
        # traced here: the family's blocks and its attention see them
        with base.row_layout(between_blocks), base.sequence_layout(in_attention):
            out = denoise_fn(params, x, t, cond)
        return constrain(out)

    return denoise


# A model built once and set up twice (a resume in one process) gets the same denoisers back:
# the rollout and the evaluation, which take them as static arguments, then compile once.
_kept = reuse.Kept(8)


def sampling_denoise(model, config, mesh) -> DenoiseFn:
    """The rollout's and the evaluation's denoiser: `sampling.denoise_rows` rows at a time
    (0: a whole level at once), laid out over `mesh`."""
    rows = int(config.sampling.denoise_rows)
    return _kept.get(
        ("sampling", model.denoise, mesh, rows),
        lambda: in_chunks(laid_out(model.denoise, mesh), rows),
    )


def training_denoise(model, config, mesh) -> DenoiseFn:
    """The denoiser the train step differentiates (remat as `model.remat` asks), laid out
    over `mesh`."""
    remat = base.remat_mode(config.model.remat)
    blocks = getattr(model, "remat", "none")
    return _kept.get(
        ("training", model.denoise, mesh, remat, blocks),
        lambda: laid_out(base.training_denoise(model, remat), mesh),
    )
