"""BranchGRPO's pruning: which trainable edges enter the backward pass.

Pruning changes the loss only: the rollout, the rewards and the advantages are computed on
the whole tree. A mask is one boolean array per segment shaped like its `log_probs`,
`[T, P, n * k]`, True where the edge is trained. Masks combine with `combine_masks` (AND).
Every mask here is already False on the steps a segment recorded without sampling (the
steps of BranchGRPO-Mix outside the window, `Segment.active`).

Depth: the depth of a node is the number of denoising steps from its root (roots are depth
0), so the edge of step i produces a node at depth i + 1 and "pruning depth d" drops every
edge of step d - 1. This is the official code's `child_depth`. Step indices are read from
the segments (they are data: a sliding window moves them).

When to prune: the released code (`fastvideo/train_branchgrpo_flux.py`) prunes, depth and
width alike, only while `step <= int(max_train_steps * pruning_step_ratio)`, its `step`
counting iterations from 1; `pruning_active` is that rule for 0-based iterations. Its
sliding depth window moves by `step // depth_pruning_slide_interval`, also counted from 1:
`active_pruned_depths(..., count_from=1)` reproduces it (our default counts from 0, so the
set first moves after `slide_every` iterations rather than `slide_every - 1`).

These run once per iteration on the host (numpy), between the advantages and the gather.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from tree_grpo_jax.core.rollout import Tree
from tree_grpo_jax.core.tree_spec import Kind, TreeSpec

WIDTH_MODES = ("top_per_branch", "best_worst")

Masks = tuple[np.ndarray, ...]


def full_masks(tree: Tree) -> Masks:
    """Every trainable edge: all edges of every segment, less the steps it did not sample."""
    return tuple(
        np.broadcast_to(np.asarray(seg.active, bool)[:, None, None], seg.log_probs.shape).copy()
        for seg in tree.segments
    )


def combine_masks(*masks: Masks | None) -> Masks | None:
    """Edge-wise AND of several masks; None entries are ignored (None if all are None)."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    return tuple(np.logical_and.reduce(parts) for parts in zip(*given))


def edge_depth(step_index: int) -> int:
    """Depth of the node an edge of step `step_index` produces."""
    return step_index + 1


def last_split_step(spec: TreeSpec, window_start: int | None = None) -> int | None:
    """Index of the last BRANCH step, None if the spec never branches. A spec whose window
    holds its BRANCH steps (TreeGRPO's family) needs the `window_start`."""
    if spec.sliding and spec.window.step.kind is Kind.BRANCH:
        if window_start is None:
            raise ValueError(
                f"the BRANCH steps of {spec.name!r} move with its window: give window_start."
            )
        spec = spec.at(window_start)
    splits = [i for i, s in enumerate(spec.steps) if s.kind is Kind.BRANCH]
    return splits[-1] if splits else None


# ---------------------------------------------------------------------------------------------
# When pruning applies.


def pruning_active(iteration: int, total_iterations: int, ratio: float = 1.0) -> bool:
    """Whether pruning (depth and width) applies at 0-based `iteration` of a run of
    `total_iterations`: during the first `int(total_iterations * ratio)` iterations.

    This is the released BranchGRPO code's `pruning_step_ratio` (default 1.0, always):
    `should_prune = step <= int(max_train_steps * pruning_step_ratio)` with `step` counted
    from 1, i.e. `iteration < int(total_iterations * ratio)`. A ratio of 1 or more prunes at
    every iteration, also past `total_iterations`.
    """
    if not ratio >= 0:
        raise ValueError(f"the pruning ratio must be at least 0, got {ratio}.")
    if ratio >= 1:
        return True
    return iteration + 1 <= int(total_iterations * ratio)


# ---------------------------------------------------------------------------------------------
# Depth pruning.


def active_pruned_depths(
    spec: TreeSpec,
    pruned_depths: Iterable[int],
    *,
    iteration: int = 0,
    slide_every: int | None = None,
    stop_depth: int | None = None,
    count_from: int = 0,
    window_start: int | None = None,
) -> tuple[int, ...]:
    """The depths pruned at `iteration` (0-based).

    Without sliding that is `pruned_depths`. With `slide_every`, the whole set moves one
    depth towards the root (earlier steps) every `slide_every` iterations, shift =
    (iteration + count_from) // slide_every, until its shallowest depth reaches
    `stop_depth`; that defaults to the last split step's index, the depth of the last
    split's parents, so the last split's own edges are never pruned by the slide (the
    official default). `count_from=1` counts iterations from 1 as the released code does
    (shift = step // depth_pruning_slide_interval with step = iteration + 1).
    """
    depths = sorted(set(int(d) for d in pruned_depths))
    bad = [d for d in depths if not 1 <= d <= spec.num_steps]
    if bad:
        raise ValueError(
            f"pruned depths {bad} are outside 1..{spec.num_steps}: depth d is the node made by "
            f"step d - 1."
        )
    if count_from not in (0, 1):
        raise ValueError(f"count_from must be 0 or 1, got {count_from!r}.")
    if not depths or slide_every is None:
        return tuple(depths)
    if slide_every < 1:
        raise ValueError(f"depth pruning slides every {slide_every} iterations; use at least 1.")
    if stop_depth is None:
        stop_depth = last_split_step(spec, window_start) or 0
    shift = min((iteration + count_from) // slide_every, max(0, depths[0] - stop_depth))
    return tuple(d - shift for d in depths)


def depth_pruning_mask(spec: TreeSpec, tree: Tree, pruned_depths: Iterable[int], **slide) -> Masks:
    """False on every edge whose child is at a pruned depth: the depths
    `active_pruned_depths(spec, pruned_depths, **slide)` gives (`slide`: its iteration,
    slide_every, stop_depth, count_from and window_start)."""
    active = set(active_pruned_depths(spec, pruned_depths, **slide))
    masks = []
    for seg, trainable in zip(tree.segments, full_masks(tree)):
        kept = np.array([edge_depth(int(i)) not in active for i in seg.step_indices])
        masks.append(trainable & kept[:, None, None])
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
    Branches are found by structure (the segments after the last branching one), so this
    works the same at every window position.

    How this differs from the released BranchGRPO code (`width_pruning_mode` 1 and 2), by
    design: that code ranks individual transitions (steps), not chains. Its mode 1 groups
    the steps after the last split by the branch they descend from and keeps the top
    `max(1, int(group_size * ratio))` steps of each group; a chain's steps all carry the same
    advantage, so its stable sort keeps the *earliest* steps of *every* chain (with ratio
    0.5, the first half of each chain below the last split): a depth cut, not a choice
    between branches. Its mode 2 pools the steps after the last split over the whole
    per-GPU batch (every prompt and tree on that process) and keeps the best keep // 2 and
    worst keep - keep // 2 steps, keep = max(2, int(steps * ratio)), so what is kept depends
    on the per-device batch and a chain at the cut may be kept in part. Here a branch is
    kept or dropped whole, compared within its sibling group ("top_per_branch") or within
    its own tree ("best_worst").
    """
    if mode not in WIDTH_MODES:
        raise ValueError(f"width pruning mode must be one of {WIDTH_MODES}, got {mode!r}.")
    if not 0 < ratio <= 1:
        raise ValueError(f"width pruning ratio must be in (0, 1], got {ratio}.")
    masks = list(full_masks(tree))
    ks = spec.branch_ks
    if not ks:
        return tuple(masks)
    last_level = len(ks)
    split_seg = next(j for j, s in enumerate(tree.segments) if s.k > 1 and s.level == last_level)
    scores = np.asarray(advantages[split_seg], np.float64)[0]  # [P, branches]
    num_prompts, branches = scores.shape
    k = ks[-1]

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
        if seg.level == last_level and seg.k == 1:  # after the last split: node c is branch c
            masks[j] = masks[j] & keep[None]
    return tuple(masks)


def branchgrpo_masks(
    options,
    spec: TreeSpec,
    tree: Tree,
    advantages,
    *,
    iteration: int,
    total_iterations: int,
    window_start: int,
) -> Masks | None:
    """BranchGRPO's depth and width pruning as the `advantage` section `options` sets them,
    while pruning is on (`pruning_step_ratio`); None (train every edge) otherwise."""
    a = options
    if not pruning_active(iteration, total_iterations, a.pruning_step_ratio):
        return None
    masks = None
    if a.depth_pruning:
        masks = depth_pruning_mask(
            spec,
            tree,
            tuple(a.depth_pruning),
            iteration=iteration,
            slide_every=a.depth_pruning_slide_every or None,
            stop_depth=None if a.depth_pruning_stop < 0 else a.depth_pruning_stop,
            count_from=a.depth_pruning_count_from,
            window_start=window_start,
        )
    if a.width_pruning != "none":
        width = width_pruning_mask(
            spec, tree, advantages, mode=a.width_pruning, ratio=a.width_pruning_ratio
        )
        masks = combine_masks(masks, width)
    return masks


# ---------------------------------------------------------------------------------------------
# Node pruning on node values (Pro-GRPO's early pruning, on a static tree).
#
# At each BRANCH step whose parents a BRANCH step made (structural level >= 1), the prompt's
# live parents (all its trees) are compared by their node value, the reward of their x0
# estimate; those the rule drops are not expanded further: they, their chain up to the branch
# that made them, and everything below leave the credit and the loss. The tree keeps its
# static shape, so the rollout still computes the dropped subtrees; `saved_rollout_rows`
# counts the denoiser rows a sampler that stopped there would not run.

NODE_PRUNINGS = ("none", "cluster", "quantile", "variance")
KEEP_AT_LEAST = 2  # a level keeps at least two live nodes per prompt: a group to compare


# Two candidate subsets whose variances differ by less than this share of the larger are a
# tie (float rounding, about 1e-16 of it, decides nothing): relative, so the choice is the
# same whatever the reward's units (values 1e-7 apart choose as values 1 apart do).
_VARIANCE_TIE = 1e-9


def _max_variance_keep(values: np.ndarray, keep: int) -> np.ndarray:
    """The `keep` of `values` whose variance is largest (Pro-GRPO's Optimal Variance
    Filtering): such a subset is always the i lowest and keep - i highest values for some i,
    so trying every i finds it; ties in the variance (within _VARIANCE_TIE of each other)
    go to the smaller i, in the order to the lower index."""
    order = np.argsort(values, kind="stable")
    best, chosen = 0.0, None
    for low in range(keep + 1):
        picked = np.concatenate([order[:low], order[len(order) - (keep - low) :]])
        variance = float(np.var(values[picked]))
        if chosen is None or variance > best * (1 + _VARIANCE_TIE):
            best, chosen = variance, picked
    kept = np.zeros(len(values), bool)
    kept[chosen] = True
    return kept


def _drop(values: np.ndarray, mode: str, threshold: float, quantile: float, keep: float):
    """Which of one prompt's live values [m] the rule drops: "cluster", those within
    `threshold` standard deviations of their mean (|z| < threshold, Pro-GRPO's
    reward-clustered nodes); "quantile", those below the `quantile` quantile; "variance",
    all but the max(2, round(keep * m)) whose variance is largest (Pro-GRPO's OVF; Python's
    `round`, half to even: keep=0.5 of 5 nodes keeps 2, of 7 keeps 4)."""
    if mode == "cluster":
        z = (values - values.mean()) / (values.std() + 1e-8)
        return np.abs(z) < threshold
    if mode == "variance":
        count = min(len(values), max(KEEP_AT_LEAST, round(keep * len(values))))
        return ~_max_variance_keep(values, count)
    return values < np.quantile(values, quantile)


def node_survival(
    tree: Tree,
    node_values,
    *,
    mode: str = "cluster",
    threshold: float = 0.5,
    quantile: float = 0.25,
    keep: float = 0.5,
) -> tuple[list[np.ndarray], list[tuple[int, int, np.ndarray]]]:
    """(alive, decisions): per structural level, which nodes live ([P, n] bool; a node dies
    with its ancestor); and per pruning point (level, step index, dropped [P, n]). A prompt
    whose level would keep fewer than two live nodes drops none there."""
    if mode not in NODE_PRUNINGS:
        raise ValueError(f"node pruning must be one of {NODE_PRUNINGS}, got {mode!r}.")
    num_prompts = tree.leaves.shape[0]
    sizes = {0: tree.segments[0].parents.shape[2]} if tree.segments else {0: 1}
    for seg in tree.segments:
        sizes[seg.level] = seg.log_probs.shape[2]
    alive = [np.ones((num_prompts, sizes[b]), bool) for b in range(max(sizes) + 1)]
    decisions = []
    for j, seg in enumerate(tree.segments):
        level = seg.level - 1
        if mode == "none" or seg.k == 1 or level < 1:
            continue
        values = np.asarray(node_values[j], np.float64)[0]  # [P, n]
        dropped = np.zeros_like(alive[level])
        for p in range(num_prompts):
            live = np.flatnonzero(alive[level][p])
            drop = _drop(values[p, live], mode, threshold, quantile, keep)
            if live.size - drop.sum() >= KEEP_AT_LEAST:
                dropped[p, live[drop]] = True
        decisions.append((level, int(seg.step_indices[0]), dropped))
        for b in range(level, len(alive)):  # the dropped nodes' descendants die with them
            alive[b] &= ~np.repeat(dropped, alive[b].shape[1] // dropped.shape[1], axis=1)
    return alive, decisions


def alive_edge_masks(tree: Tree, alive: Sequence[np.ndarray]) -> Masks:
    """False on every edge whose child is dead (`node_survival`'s alive levels)."""
    return tuple(
        mask & np.asarray(alive[seg.level], bool)[None]
        for seg, mask in zip(tree.segments, full_masks(tree))
    )


def saved_rollout_rows(
    plain: TreeSpec, decisions: Sequence[tuple[int, int, np.ndarray]], guidance: bool = False
) -> int:
    """Denoiser rows (all prompts) a sampler that stops the dropped nodes would skip: the
    rows of every later depth's nodes below them. `plain`: the spec at this rollout's window
    position. The dropped nodes' own rows at the pruning step are run (their x0 estimate is
    what decided)."""
    saved = 0
    for depth in range(plain.num_steps):
        n = plain.nodes_in[depth]
        dead = None
        for _, step, dropped in decisions:
            if step < depth:
                below = np.repeat(dropped, n // dropped.shape[1], axis=1)
                dead = below if dead is None else dead | below
        if dead is not None:
            saved += int(dead.sum())
    return saved * (2 if guidance else 1)


def planned_node_pruning(
    plain: TreeSpec, mode: str, quantile: float = 0.25, keep: float = 0.5
) -> tuple[int, int] | None:
    """(nodes dropped, rollout rows saved) per prompt without guidance, counted from the
    tree alone, for the rules whose drop count depends on the number of live nodes only:
    "variance", and "quantile" when a level's values are distinct (np.quantile's linear
    interpolation puts ceil(q * (m - 1)) of m distinct values strictly below it). None for
    "cluster" (data-dependent) and "none"."""
    if mode not in ("quantile", "variance"):
        return None
    steps = plain.steps
    splits = [i for i, s in enumerate(steps) if s.kind is Kind.BRANCH]

    def per_node(first: int, depth: int) -> int:  # nodes at `depth` below one at `first`
        return math.prod(steps[j].k for j in range(first, depth))

    dropped = saved = 0
    live, previous = None, None
    for split in splits[1:]:
        m = plain.nodes_in[split] if live is None else live * per_node(previous, split)
        if mode == "variance":
            kept = min(m, max(KEEP_AT_LEAST, round(keep * m)))
        else:
            kept = m - math.ceil(quantile * (m - 1))
        if kept < KEEP_AT_LEAST:
            kept = m
        dropped += m - kept
        saved += (m - kept) * sum(per_node(split, d) for d in range(split + 1, plain.num_steps))
        live, previous = kept, split
    return dropped, saved
