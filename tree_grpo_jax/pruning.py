"""BranchGRPO's pruning: which trainable edges enter the backward pass.

Pruning changes the loss only: the rollout, the rewards and the advantages are computed on
the whole tree. A mask is one boolean array per segment shaped like its `log_probs`,
`[T, P, n * k]`, True where the edge is trained. Masks combine with `combine_masks` (AND).

Depth: the depth of a node is the number of denoising steps from its root (roots are depth
0), so the edge of step i produces a node at depth i + 1 and "pruning depth d" drops every
edge of step d - 1. This is the official code's `child_depth`.

These run once per iteration on the host (numpy), between the advantages and the gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tree_grpo_jax.rollout import Tree
from tree_grpo_jax.tree_spec import Kind, TreeSpec

WIDTH_MODES = ("top_per_branch", "best_worst")

Masks = tuple[np.ndarray, ...]


def full_masks(tree: Tree) -> Masks:
    """Every edge trained."""
    return tuple(np.ones(seg.log_probs.shape, bool) for seg in tree.segments)


def combine_masks(*masks: Masks | None) -> Masks | None:
    """Edge-wise AND of several masks; None entries are ignored (None if all are None)."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    return tuple(np.logical_and.reduce(parts) for parts in zip(*given))


def edge_depth(step_index: int) -> int:
    """Depth of the node an edge of step `step_index` produces."""
    return step_index + 1


def last_split_step(spec: TreeSpec) -> int | None:
    """Index of the last BRANCH step, None if the spec never branches."""
    splits = [i for i, s in enumerate(spec.steps) if s.kind is Kind.BRANCH]
    return splits[-1] if splits else None


# ---------------------------------------------------------------------------------------------
# Depth pruning.


def active_pruned_depths(
    spec: TreeSpec,
    pruned_depths: Iterable[int],
    *,
    iteration: int = 0,
    slide_every: int | None = None,
    stop_depth: int | None = None,
) -> tuple[int, ...]:
    """The depths pruned at `iteration`.

    Without sliding that is `pruned_depths`. With `slide_every`, the whole set moves one
    depth towards the root (earlier steps) every `slide_every` iterations, until its
    shallowest depth reaches `stop_depth`; that defaults to the last split step's index,
    the depth of the last split's parents, so the last split's own edges are never pruned
    by the slide (the official default).
    """
    depths = sorted(set(int(d) for d in pruned_depths))
    bad = [d for d in depths if not 1 <= d <= spec.num_steps]
    if bad:
        raise ValueError(
            f"pruned depths {bad} are outside 1..{spec.num_steps}: depth d is the node made by "
            f"step d - 1."
        )
    if not depths or slide_every is None:
        return tuple(depths)
    if slide_every < 1:
        raise ValueError(f"depth pruning slides every {slide_every} iterations; use at least 1.")
    if stop_depth is None:
        stop_depth = last_split_step(spec) or 0
    shift = min(iteration // slide_every, max(0, depths[0] - stop_depth))
    return tuple(d - shift for d in depths)


def depth_pruning_mask(
    spec: TreeSpec,
    tree: Tree,
    pruned_depths: Iterable[int],
    *,
    iteration: int = 0,
    slide_every: int | None = None,
    stop_depth: int | None = None,
) -> Masks:
    """False on every edge whose child is at a pruned depth (see `active_pruned_depths`)."""
    active = set(
        active_pruned_depths(
            spec, pruned_depths, iteration=iteration, slide_every=slide_every, stop_depth=stop_depth
        )
    )
    masks = []
    for seg in tree.segments:
        kept = np.array([edge_depth(int(i)) not in active for i in seg.step_indices])
        masks.append(np.broadcast_to(kept[:, None, None], seg.log_probs.shape).copy())
    return tuple(masks)


# ---------------------------------------------------------------------------------------------
# Width pruning.


def _descending_rank(scores: np.ndarray) -> np.ndarray:
    """Rank along the last axis, 0 = highest score; ties go to the lower index."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return np.argsort(order, axis=-1, kind="stable")


def width_pruning_mask(
    spec: TreeSpec,
    tree: Tree,
    advantages: Sequence,
    *,
    mode: str = "top_per_branch",
    ratio: float = 0.5,
) -> Masks:
    """Prunes whole branches after the last split.

    A branch is a child of the last BRANCH step together with the chain of edges below it;
    its score is the advantage of the split edge that made it (for every method here the
    edges below carry the same advantage, since nothing splits after). The edges strictly
    after the last split step of an unselected branch are pruned; the split edges themselves
    are always trained, as in the official code, whose width pruning acts on the transitions
    after the last split only.

    - "top_per_branch": within each sibling group (the k children of one parent at the last
      split) keep the top max(1, int(k * ratio)) branches by score.
    - "best_worst": within each tree keep the best keep // 2 and the worst keep - keep // 2
      of its branches, keep = max(2, int(branches * ratio)), so both ends of the contrast
      stay.

    Ties go to the lower node index. A spec without a BRANCH step has nothing to prune.
    """
    if mode not in WIDTH_MODES:
        raise ValueError(f"width pruning mode must be one of {WIDTH_MODES}, got {mode!r}.")
    if not 0 < ratio <= 1:
        raise ValueError(f"width pruning ratio must be in (0, 1], got {ratio}.")
    masks = list(full_masks(tree))
    split = last_split_step(spec)
    if split is None:
        return tuple(masks)
    split_seg = next(j for j, s in enumerate(tree.segments) if s.first_step == split)
    scores = np.asarray(advantages[split_seg], np.float64)[0]  # [P, branches]
    num_prompts, branches = scores.shape
    k = spec.steps[split].k

    if mode == "top_per_branch":
        ranks = _descending_rank(scores.reshape(num_prompts, branches // k, k))
        keep = ranks < max(1, int(k * ratio))
    else:
        per_tree = branches // spec.num_trees
        ranks = _descending_rank(scores.reshape(num_prompts, spec.num_trees, per_tree))
        kept = min(per_tree, max(2, int(per_tree * ratio)))
        best = kept // 2
        keep = (ranks < best) | (ranks >= per_tree - (kept - best))
    keep = keep.reshape(num_prompts, branches)

    for j, seg in enumerate(tree.segments):
        if seg.first_step > split:  # no split after: node c at this level is branch c
            masks[j] = np.broadcast_to(keep[None], seg.log_probs.shape).copy()
    return tuple(masks)
