"""The tree's trainable edges as flat rows, one row per parent.

A row holds a parent state and the K actions taken from it (K = the largest k in the tree).
The loss runs the denoiser once per row and scores all K actions against the one Gaussian
that forward implies; that is where a BRANCH(k) step saves k-fold. A chain step has one real
action and K - 1 padded, masked slots. Rows whose edges are all masked (pruned) are dropped,
so pruning saves forwards, not just gradient terms.

Conditioning stays out of the rows: `prompt` indexes the iteration's prompt batch and the
loss looks the embedding up in `cond[P, L, D]`.

Gathering and batching run once per iteration on the host, in numpy; the minibatches all
have the same number of rows so the jitted train step compiles once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import chex
import jax
import numpy as np
from flax import struct

from tree_grpo_jax.core.rollout import Tree


class MaskedRows:
    """What the trainer counts in a batch of rows: its `mask` is [R] (one per row) or [R, K]
    (one per edge), True where it trains."""

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    @property
    def num_edges(self) -> int:
        return int(np.sum(self.mask))


@struct.dataclass
class Transitions(MaskedRows):
    x: np.ndarray  # [R, *S] parent states
    step: np.ndarray  # [R] int32, step index into the schedule
    prompt: np.ndarray  # [R] int32, row of the prompt batch (cond[prompt])
    noise_scale: np.ndarray  # [R] float32, the std multiplier the actions are scored with
    actions: np.ndarray  # [R, K, *S] the children drawn from the parent
    old_log_probs: np.ndarray  # [R, K] under the rollout's parameters
    advantages: np.ndarray  # [R, K]
    mask: np.ndarray  # [R, K] bool, True = a real edge that is trained
    # [R, *S] the step mean under the rollout's parameters (GRPO-Guard), when the rollout
    # recorded it; else None
    old_means: np.ndarray | None = None


def _rows(array: np.ndarray) -> np.ndarray:
    """[T, P, n, ...] -> [T * P * n, ...]."""
    return array.reshape(-1, *array.shape[3:])


def _pad_children(array: np.ndarray, k: int, max_k: int, fill) -> np.ndarray:
    """[T, P, n * k, ...] -> [T * P * n, max_k, ...], padded slots set to `fill`.

    `fill=None` repeats the last real child, so padded actions are finite, plausible states.
    """
    t, p, nk = array.shape[:3]
    grouped = array.reshape(t * p * (nk // k), k, *array.shape[3:])
    if k == max_k:
        return grouped
    widths = [(0, 0), (0, max_k - k)] + [(0, 0)] * (grouped.ndim - 2)
    if fill is None:
        return np.pad(grouped, widths, mode="edge")
    return np.pad(grouped, widths, constant_values=fill)


def gather_transitions(
    tree: Tree, advantages: Sequence, masks: Sequence | None = None
) -> Transitions:
    """Flattens every segment's edges into rows; drops rows with no trained edge.

    advantages, masks: one array per segment shaped like its log_probs ([T, P, n * k]);
    masks default to all True. Steps a segment recorded without sampling (`Segment.active`
    False: BranchGRPO-Mix outside its window) are never trained, whatever the mask says.
    Step indices come from the segments (data, so a sliding window needs no new shapes),
    and `noise_scale` is the segment's `score_scale`, the std multiplier its log-probs were
    computed with, so the loss scores every action as the rollout did.
    """
    if len(advantages) != len(tree.segments):
        raise ValueError(
            f"got {len(advantages)} advantage arrays for {len(tree.segments)} segments."
        )
    if masks is not None and len(masks) != len(tree.segments):
        raise ValueError(f"got {len(masks)} masks for {len(tree.segments)} segments.")
    sample_shape = tuple(tree.leaves.shape[2:])
    max_k = max((seg.k for seg in tree.segments), default=1)
    parts = []
    for j, seg in enumerate(tree.segments):
        num_steps, num_prompts, n = seg.parents.shape[:3]
        chex.assert_shape(advantages[j], seg.log_probs.shape)
        mask = np.ones(seg.log_probs.shape, bool) if masks is None else np.asarray(masks[j], bool)
        chex.assert_shape(mask, seg.log_probs.shape)
        mask = mask & np.asarray(seg.active, bool)[:, None, None]
        num_rows = num_steps * num_prompts * n
        steps = np.repeat(np.asarray(seg.steps, np.int32), num_prompts * n)
        parts.append(
            Transitions(
                x=_rows(np.asarray(seg.parents)),
                step=steps,
                prompt=np.tile(np.repeat(np.arange(num_prompts, dtype=np.int32), n), num_steps),
                noise_scale=np.full((num_rows,), seg.score_scale, np.float32),
                actions=_pad_children(np.asarray(seg.children), seg.k, max_k, None),
                old_log_probs=_pad_children(np.asarray(seg.log_probs, np.float32), seg.k, max_k, 0),
                advantages=_pad_children(np.asarray(advantages[j], np.float32), seg.k, max_k, 0),
                mask=_pad_children(mask, seg.k, max_k, False),
                old_means=None if seg.means is None else _rows(np.asarray(seg.means)),
            )
        )
    if not parts:
        means = bool(tree.segments) and tree.segments[0].means is not None
        return empty_transitions(sample_shape, max_k, np.asarray(tree.leaves).dtype, means)
    merged = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *parts)
    live = merged.mask.any(axis=1)
    return jax.tree_util.tree_map(lambda a: a[live], merged)


def zero_transitions(
    rows: int, sample_shape, max_k: int = 1, dtype=np.float32, make=np.zeros, means=False
) -> Transitions:
    """`rows` rows of zeros (`make=jax.ShapeDtypeStruct`: their shapes alone), the layout
    `gather_transitions` gives and `minibatches` cuts; `means`: with the rollout's step
    means (GRPO-Guard)."""
    return Transitions(
        x=make((rows, *sample_shape), dtype),
        step=make((rows,), np.int32),
        prompt=make((rows,), np.int32),
        noise_scale=make((rows,), np.float32),
        actions=make((rows, max_k, *sample_shape), dtype),
        old_log_probs=make((rows, max_k), np.float32),
        advantages=make((rows, max_k), np.float32),
        mask=make((rows, max_k), np.bool_),
        old_means=make((rows, *sample_shape), np.float32) if means else None,
    )


def empty_transitions(
    sample_shape, max_k: int = 1, dtype=np.float32, means: bool = False
) -> Transitions:
    return zero_transitions(0, sample_shape, max_k, dtype, means=means)


def num_minibatches(num_rows: int, rows_per_batch: int) -> int:
    return math.ceil(num_rows / rows_per_batch)


def minibatches(
    transitions: Transitions, key: jax.Array, rows_per_batch: int, count: int | None = None
) -> list[Transitions]:
    """Shuffles the rows with `key` and cuts them into minibatches of exactly
    `rows_per_batch` rows; the last one is topped up with copies of real rows whose mask is
    all False, so they cost a forward but contribute nothing. No rows, no minibatches.

    `count` (at least what the rows need) asks for that many minibatches, the extra ones
    all masked: processes with different numbers of rows then run the same number of
    steps. A process with no rows fills them with zeros."""
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be at least 1, got {rows_per_batch}.")
    num_rows = transitions.num_rows
    needed = num_minibatches(num_rows, rows_per_batch)
    count = needed if count is None else count
    if count < needed:
        raise ValueError(f"{num_rows} rows need {needed} minibatches, not {count}.")
    if count == 0:
        return []
    total = count * rows_per_batch
    if num_rows == 0:
        shuffled = jax.tree_util.tree_map(
            lambda a: np.zeros((total, *a.shape[1:]), a.dtype), transitions
        )
    else:
        order = np.asarray(jax.random.permutation(key, num_rows))
        order = np.concatenate([order, order[np.arange(total - num_rows) % num_rows]])
        shuffled = jax.tree_util.tree_map(lambda a: a[order], transitions)
        mask = shuffled.mask.copy()
        mask[num_rows:] = False  # the top-up copies train nothing
        shuffled = shuffled.replace(mask=mask)

    def batch(b: int) -> Transitions:
        rows = slice(b * rows_per_batch, (b + 1) * rows_per_batch)
        return jax.tree_util.tree_map(lambda a: a[rows], shuffled)

    return [batch(b) for b in range(count)]
