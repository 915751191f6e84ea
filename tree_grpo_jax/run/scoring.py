"""Decoding and scoring overlapped: the leaves (or the evaluation's samples) decode in
parts, and a reward that runs on the host (numpy, or a server over HTTP) scores each part
as soon as it is decoded while the accelerator decodes the next ones.

Every part's decode is dispatched before any is waited for (JAX dispatches asynchronously),
so scoring part j on the host runs beside the decodes of parts j+1 ... The rows are G
groups of B (a prompt's leaves; a device's share of the evaluation batch); part j holds rows
j*c .. (j+1)*c - 1 of every group, so each part keeps the groups' layout over the devices
and every device decodes its share of every part. A JAX-native reward gets the whole batch
once: it runs on the accelerator, behind the decodes, and gains nothing from parts.

Scores do not depend on the parts: each image is scored alone by every reward, so a run
scores the same with `reward_options.decode_chunks` 1 (decode everything, then score) or
more.

Every device decodes its own rows (`on_each_device`): a decoder that runs its rows in a loop
(`lax.map` over `decode_batch_size` at a time) cannot have the loop's axis split by the
compiler, which would gather every row to every device and decode all of them on each.

The run stops with one sentence on numbers it cannot go on with: `RewardError` (rewards that
are not finite, or a reward that could not score) and `DivergenceError` (samples, losses or
gradients that are not finite), raised by the trainer and the evaluator alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_grpo_jax import sharding
from tree_grpo_jax.models.base import Decoder
from tree_grpo_jax.rewards.base import RewardUnavailable


class RewardError(RuntimeError):
    """Rewards that cannot be trained on (NaN or infinite, or a reward that could not
    score); one sentence for the user."""


@contextlib.contextmanager
def reward_failures():
    """A reward that could not score (its server down after the retries) stops the run as
    non-finite rewards do: a RewardError, one sentence."""
    try:
        yield
    except RewardUnavailable as e:
        raise RewardError(str(e)) from None


class DivergenceError(RuntimeError):
    """Training produced non-finite numbers; the last checkpoint is kept as it was."""

    @classmethod
    def in_run(cls, what: str, workdir: str) -> DivergenceError:
        """`what` (plural) not finite, in the run writing its checkpoints under `workdir`."""
        return cls(
            f"{what} are not finite: training diverged (a lower train.learning_rate or "
            f"train.max_grad_norm may help); the checkpoints in {workdir}/checkpoints "
            "are kept as they were."
        )


def chunk_count(per_group: int, asked: int) -> int:
    """The parts a group of `per_group` rows is cut into: the largest divisor of
    `per_group` not above `asked` (equal parts: one decode program for all of them)."""
    asked = max(1, min(int(asked), per_group))
    return next(n for n in range(asked, 0, -1) if per_group % n == 0)


@functools.cache  # one program per decoder, mesh and layout, however often a trainer is made
def device_decoder(apply: Callable, mesh, axes: tuple = sharding.BATCH_AXES) -> Callable:
    """`apply(params, latents)` jitted for `params` on every device and the latents' rows split
    over `mesh`'s `axes`, each device decoding its own rows with its copy of the weights."""
    rows = P(axes)
    return jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=(P(), rows), out_specs=rows))


def on_each_device(decode: Callable, mesh) -> Callable:
    """`decode` of latents [N, ...] run on `mesh` (a process's own devices), each device
    decoding its rows (`sharding.row_axes`: N over every device where they divide it, a
    'sequence' axis's included): when `decode` is a `models.base.Decoder` (its weights are
    placed on every device once, here) and the devices divide N; else `decode` itself."""
    if not isinstance(decode, Decoder):
        return decode
    params = jax.device_put(decode.params, sharding.replicated(mesh))

    def run(latents):
        axes = sharding.row_axes(mesh, latents.shape[0])
        if axes is None:
            return decode(latents)
        split = NamedSharding(mesh, P(axes))
        return device_decoder(decode.apply, mesh, axes)(params, jax.device_put(latents, split))

    return run


def shared_decode(decode: Callable, mesh) -> Callable:
    """`on_each_device(decode, mesh)`, built at its first call (that places the decoder's
    weights on every device): one decoder for the rollout's leaves and the evaluation's
    samples, nothing placed by a run that never decodes."""
    built = functools.cache(lambda: on_each_device(decode, mesh))
    return lambda latents: built()(latents)


def decode_parts(reward_options, on_host: bool) -> int:
    """Parts to decode in: `reward_options.decode_chunks` when a reward scores on the host
    (it scores each part while the next decode), else 1."""
    return reward_options.decode_chunks if on_host else 1


@dataclasses.dataclass(frozen=True)
class Decoded:
    """Decoded media in parts: `chunks[j]` [G*c, ...] holds rows j*c .. (j+1)*c - 1 of each
    of the G groups of B = c * len(chunks) rows, group-major. The arrays may still be
    decoding (device arrays dispatched in order)."""

    chunks: tuple
    groups: int

    @property
    def count(self) -> int:
        return len(self.chunks)

    def take(self, j: int, items: Sequence | None) -> list | None:
        """Part j's entries of `items` (one per row, in row order); None stays None."""
        if items is None:
            return None
        per_group = len(items) // self.groups
        size = per_group // self.count
        return [
            items[g * per_group + i]
            for g in range(self.groups)
            for i in range(j * size, (j + 1) * size)
        ]

    def restore(self, values: Sequence) -> Any:
        """The parts' values (one [G*c, ...] each) as one [G*B, ...] in row order."""
        if len(values) == 1:
            return values[0]
        xp = np if all(isinstance(v, np.ndarray) for v in values) else jnp
        split = [xp.reshape(v, (self.groups, -1, *v.shape[1:])) for v in values]
        whole = xp.concatenate(split, axis=1)
        return xp.reshape(whole, (-1, *whole.shape[2:]))

    @functools.cached_property
    def whole(self) -> Any:
        """Every row in row order (waits for every part)."""
        return self.restore(list(self.chunks))


def decode(decode_fn: Callable, latents, groups: int, parts: int) -> Decoded:
    """`decode_fn` of `latents` [G*B, *S] in `chunk_count(B, parts)` parts, each dispatched
    before any is waited for."""
    rows = latents.shape[0]
    if groups < 1 or rows % groups:
        groups = 1
    per_group = rows // groups
    count = chunk_count(per_group, parts) if per_group else 1
    if count == 1:
        return Decoded((decode_fn(latents),), groups)
    size = per_group // count
    grouped = latents.reshape(groups, per_group, *latents.shape[1:])
    chunks = tuple(
        decode_fn(grouped[:, j * size : (j + 1) * size].reshape(-1, *latents.shape[1:]))
        for j in range(count)
    )
    return Decoded(chunks, groups)


def scored(
    call: Callable, decoded: Decoded, prompts: Sequence[str], metadata, on_host: bool
) -> tuple:
    """`call(images, prompts, metadata)` -> (scores [N], {name: [N]}, frames [N, T] | None)
    over every row of `decoded`, in row order: part by part as each is decoded when the
    reward runs `on_host`, else once on the whole batch."""
    if not on_host or decoded.count == 1:
        return call(decoded.whole, prompts, metadata)
    answers = [
        call(np.asarray(chunk), decoded.take(j, prompts), decoded.take(j, metadata))
        for j, chunk in enumerate(decoded.chunks)
    ]
    total = decoded.restore([np.asarray(a[0]) for a in answers])
    names = set.intersection(*(set(a[1]) for a in answers))
    order = [n for n in answers[0][1] if n in names]
    parts = {n: decoded.restore([np.asarray(a[1][n]) for a in answers]) for n in order}
    frames = None
    if answers[0][2] is not None:
        frames = decoded.restore([np.asarray(a[2]) for a in answers])
    return total, parts, frames


def score(
    reward, decoded: Decoded, prompts: list[str], where: str, metadata=None
) -> tuple[np.ndarray, dict, Any]:
    """`reward`'s scores of this process's images (a host-side reward scores each part as it
    is decoded), then every process's, in process order: all processes check, log and
    normalise the same values. Also each reward's scores and, for videos scored frame by
    frame, the total frame by frame [N, T] (else None). `metadata`: each image's prompt
    metadata, for the rewards that take it. Non-finite scores raise RewardError."""
    with reward_failures():
        total, parts, frames = scored(
            reward.with_frames, decoded, prompts, metadata, reward.on_host
        )
    total = sharding.gather(np.asarray(total, np.float64))
    parts = {n: sharding.gather(np.asarray(v, np.float64)) for n, v in parts.items()}
    if frames is not None:
        frames = sharding.gather(np.asarray(frames, np.float64))
    bad = ~np.isfinite(total)
    if bad.any():
        raise RewardError(
            f"reward {reward.name} returned {int(bad.sum())} non-finite value(s) out "
            f"of {total.size} {where}; fix the reward (or its weights) before training on it."
        )
    return total, parts, frames
