"""Credit assignment: from leaf rewards to one advantage per trainable edge.

Everything here is indexed the way the rollout lays the tree out. The children of node j
are j*k .. j*k+k-1 of the next level, so a node's descendants are one contiguous block of
every level below, and backing values up the tree is one segment reduction per BRANCH step
over parent ids `arange(n * k) // k`.

Structural levels. Level 0 holds the `num_trees` roots of each prompt; level b the nodes
after the b-th BRANCH step. An ODE or SDE step has one child per node, so every depth
between two BRANCH steps holds the same nodes' values: the mean of the leaves below, the
path-probability fusion and BranchGRPO's depth-wise normalization all give the same numbers
at each of those depths. The advantages are therefore computed per structural level, and a
segment's edges take the values of its children's level (`Segment.level`). None of it
depends on step indices, so a sliding window changes nothing here and one compiled
function serves every window position.

An edge is (parent, child) at a stochastic step; its advantage is laid out like the
segment's `log_probs`, `[T, P, n * k]`, and is a value of its child node. The methods differ
only in what that value is:

- grpo / mixgrpo: leaf A = (r - mean_p) / (std_p + 1e-8) over the prompt's leaves
  (population std, or the sample std with `ddof=1` as DanceGRPO's code), or from a DDPO
  per-prompt stat tracker; an edge takes the mean of the leaf advantages below its child.
  On chains that is simply the leaf's advantage.
- treegrpo: the TreeGRPO advantage, `treegrpo_advantages`: the same leaf normalization over
  all leaves of the prompt (all its trees), and an edge parent -> child takes the mean of the
  leaf advantages below the child. Branch edges therefore get step-specific credit. With
  `edge_normalization="per_depth"` those means are normalized again over each depth of the
  prompt (all its trees), so a shallow edge, whose mean over many leaves is small, gets
  credit of the same scale as a leaf's; with `edge_normalization="per_leaf"` each mean is
  multiplied by the number of leaves below the edge (scaled so the weights average 1 over
  the trained edges), which makes the loss, a mean over edges, that of flat GRPO over the
  tree's leaf paths with their shared edges merged.
- branchgrpo / branchgrpo_mix: rewards are fused up each tree (mean of descendant leaves, or
  path-probability weighting), then normalized per depth within each tree with the sample
  std; a depth with one node, or with std < 1e-6, gets advantage 0. With
  `normalization="leaf"` the prompt's leaves are normalized first and fused up the tree with
  no depth-wise step.

- node rewards (any of the above, `advantage.node_rewards`): the gain of an edge,
  value(child) - value(parent) with a node's value the reward of its x0 estimate, normalized
  over the prompt's edges of each step (`node_gain_advantages`, Stepwise-Flow-GRPO), mixed
  with the method's credit; with node pruning, TreeGRPO's credit over the kept leaves
  (`surviving_leaf_advantages`).

Exact under a constant shift: every normalization first subtracts a member of its own group
(the prompt's first leaf; for BranchGRPO, each tree's first leaf, and then the mean of the
differences, before fusing), so constant rewards give exact zeros and adding a constant to a
prompt's (or a tree's) rewards changes nothing beyond the rounding of the rewards
themselves. (Fusing raw rewards of size ~20 and more turned the float32 rounding of the
softmax weights into depth-wise "credit".)

Which method uses which function, and the clipping, is `tree_grpo_jax.methods`' table.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Hashable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.core.rollout import Tree
from tree_grpo_jax.core.tree_spec import TreeSpec

EPS = 1e-8  # added to the std in every normalization (GRPO, TreeGRPO, BranchGRPO)
DEPTH_STD_FLOOR = 1e-6  # BranchGRPO: a depth whose fused rewards are this flat gets A = 0
FUSIONS = ("mean", "path_prob")
DDOFS = (0, 1)  # leaf normalization: population std (0) or sample std (1, DanceGRPO's code)
# treegrpo's edge advantages: "none" (the mean of the leaf advantages below the child, the
# paper's definition), "per_depth" (those means normalized again within each depth) or
# "per_leaf" (those means weighted by the number of leaves below: flat GRPO's loss over the
# tree's leaf paths, shared edges merged)
EDGE_NORMALIZATIONS = ("none", "per_depth", "per_leaf")
# branchgrpo's: "depthwise" (BranchGRPO's: fuse each tree's rewards, normalize every depth of
# the tree) or "leaf" (normalize the prompt's leaves, then fuse: no depth is rescaled)
BRANCH_NORMALIZATIONS = ("depthwise", "leaf")

Advantages = tuple[jax.Array, ...]  # one [T, P, n * k] array per segment


# ---------------------------------------------------------------------------------------------
# Checks and layout.


def check_tree(spec: TreeSpec, tree: Tree, rewards: jax.Array | None = None) -> int:
    """Asserts the tree's segments are the spec's segment blocks; returns the prompt count."""
    blocks = spec.segment_blocks
    if len(blocks) != len(tree.segments):
        raise ValueError(
            f"the tree has {len(tree.segments)} segments but the spec has {len(blocks)}; "
            "was it rolled out with this spec?"
        )
    num_prompts = tree.leaves.shape[0]
    for j, (block, seg) in enumerate(zip(blocks, tree.segments)):
        if (seg.num_steps, seg.k, seg.level) != (block.num_steps, block.step.k, block.level):
            raise ValueError(
                f"segment {j} ({seg.num_steps} steps, k={seg.k}, level {seg.level}) does not "
                f"match the spec's ({block.num_steps} steps, k={block.step.k}, level "
                f"{block.level})."
            )
        chex.assert_shape(seg.log_probs, (block.num_steps, num_prompts, block.nodes_out))
    if rewards is not None:
        chex.assert_shape(rewards, (num_prompts, spec.leaves))
    return num_prompts


def parent_ids(num_children: int, k: int) -> jax.Array:
    """Index of each child's parent at a step with k children per parent."""
    return jnp.arange(num_children) // k


def _sum_siblings(values: jax.Array, k: int) -> jax.Array:
    """[P, n * k] -> [P, n]: sums each parent's contiguous block of children."""
    num_children = values.shape[1]
    summed = jax.ops.segment_sum(
        values.T, parent_ids(num_children, k), num_segments=num_children // k
    )
    return summed.T


def branch_log_probs(spec: TreeSpec, tree: Tree) -> list[jax.Array]:
    """The log-probs of the children of each BRANCH step, in order, [P, n * k] each."""
    out = [seg.log_probs[0] for seg in tree.segments if seg.k > 1]  # one step each
    if len(out) != len(spec.branch_ks):
        raise ValueError(
            f"the tree has {len(out)} branching segments but the spec has "
            f"{len(spec.branch_ks)} BRANCH steps."
        )
    return out


def per_segment(tree: Tree, levels: Sequence[jax.Array]) -> Advantages:
    """Edge values from node values: a segment's edges take its children's structural level,
    `levels[seg.level]`, at every one of its steps."""
    layout = tuple((seg.level, tuple(seg.log_probs.shape)) for seg in tree.segments)
    return _per_segment(layout, tuple(levels))


# Jitted, as one program: op by op they are dozens of small programs, each compiled (or read
# from the compilation cache) on a run's first iteration. Only exact operations (copies, sums
# of siblings in order, products by 1/k) are joined: a fused normalization rounds differently.
@functools.partial(jax.jit, static_argnums=(0,))
def _per_segment(layout, levels) -> Advantages:
    return tuple(
        jnp.broadcast_to(levels[level][None], shape).astype(jnp.float32) for level, shape in layout
    )


def depth_levels(spec: TreeSpec, levels: Sequence[jax.Array]) -> list[jax.Array]:
    """Structural levels expanded to one per depth (0..num_steps) of a spec without a window:
    depth d holds the level of the nodes d steps below the roots."""
    return [levels[spec.level_of_depth(d)] for d in range(spec.num_steps + 1)]


# ---------------------------------------------------------------------------------------------
# Reward backup.

ChildWeights = Callable[[int, jax.Array], jax.Array]


def backup(spec: TreeSpec, leaf_values: jax.Array, child_weights: ChildWeights) -> list[jax.Array]:
    """Backs leaf values up the tree: a parent is the weighted sum of its children.

    `child_weights(b, children)` gives the weights of the children of the b-th BRANCH step
    (0-based), [P, n * k], summing to one within each sibling group; a step with a single
    child (SDE or ODE) passes values through. Returns the values of every structural level,
    levels[b] of shape [P, spec.level_sizes[b]]: levels[0] are the roots, levels[-1] the
    leaves.
    """
    levels = [leaf_values]
    ks = spec.branch_ks
    for b in reversed(range(len(ks))):
        children = levels[0]
        levels.insert(0, _sum_siblings(child_weights(b, children) * children, ks[b]))
    return levels


def backup_mean(spec: TreeSpec, leaf_values: jax.Array) -> list[jax.Array]:
    """levels[b][p, j]: the mean of the leaf values below node j of structural level b.

    Every node's block of leaves has the same size, so the mean of the children's means is
    the mean over the node's leaves.
    """
    ks = spec.branch_ks
    return backup(spec, leaf_values, lambda b, children: jnp.full_like(children, 1.0 / ks[b]))


_backup_mean = jax.jit(backup_mean, static_argnums=(0,))  # one program (see `_per_segment`)


def backup_path_prob(
    spec: TreeSpec, tree: Tree, leaf_values: jax.Array, alpha: float = 1.0
) -> list[jax.Array]:
    """BranchGRPO's path-probability fusion: value(node) = sum over its children c of
    softmax(alpha * logp_c) * value(c), the softmax over the node's children, logp_c the
    log-prob of the edge into c. Steps with one child pass the value through."""
    log_probs = branch_log_probs(spec, tree)
    ks = spec.branch_ks

    def weights(b, children):
        num_prompts, num_children = children.shape
        logits = alpha * log_probs[b].astype(jnp.float32).reshape(num_prompts, -1, ks[b])
        return jax.nn.softmax(logits, axis=-1).reshape(num_prompts, num_children)

    return backup(spec, leaf_values, weights)


# ---------------------------------------------------------------------------------------------
# Normalization.


def normalize(values: jax.Array, *, ddof: int = 0, eps: float = EPS) -> tuple[jax.Array, jax.Array]:
    """(values - mean) / (std + eps) along the last axis; returns (normalized, std).

    The values are first shifted by the group's first member, so a constant group centres to
    exact zeros (plain float32 means of equal numbers can miss by an ulp, which eps would
    blow up); the shift changes neither the deviations nor the std.
    """
    shifted = values - values[..., :1]
    deviations = shifted - jnp.mean(shifted, axis=-1, keepdims=True)
    count = values.shape[-1]
    std = jnp.sqrt(jnp.sum(deviations**2, axis=-1, keepdims=True) / max(count - ddof, 1))
    return deviations / (std + eps), std


def _check_ddof(ddof: int) -> int:
    if ddof not in DDOFS:
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std), got {ddof!r}.")
    return int(ddof)


def group_normalize(rewards: jax.Array, ddof: int = 0) -> jax.Array:
    """Per-prompt GRPO normalization of rewards [P, L] over each prompt's L leaves, with the
    population std (`ddof=0`) or the sample std (`ddof=1`, DanceGRPO's `torch.std`)."""
    return normalize(rewards.astype(jnp.float32), ddof=_check_ddof(ddof))[0]


class PerPromptStatTracker:
    """DDPO's per-prompt reward statistics, host side.

    `update` appends each prompt's new rewards to that prompt's history (a buffer of the
    last `buffer_size` rewards) and then normalizes them: with the prompt's history if it
    holds at least `min_count` rewards, else with the mean and std of the whole batch passed
    to this call (all prompts), as DDPO does. Population std plus `eps` (DDPO's 1e-6). The
    current rewards are part of the history they are normalized with.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16, eps: float = 1e-6):
        if buffer_size < 1 or min_count < 1:
            raise ValueError(
                f"buffer_size and min_count must be at least 1, got {buffer_size}, {min_count}."
            )
        self.buffer_size = int(buffer_size)
        self.min_count = int(min_count)
        self.eps = float(eps)
        self.history: dict[str, collections.deque] = {}

    def update(self, prompts: Sequence[Hashable], rewards: np.ndarray) -> np.ndarray:
        """prompts: one per row; rewards [P, L] -> advantages [P, L] (float64)."""
        rewards = np.asarray(rewards, np.float64)
        if rewards.ndim != 2 or len(prompts) != rewards.shape[0]:
            raise ValueError(
                f"need one prompt per reward row: {len(prompts)} prompts, rewards {rewards.shape}."
            )
        keys = [str(p) for p in prompts]
        batch_mean, batch_std = rewards.mean(), rewards.std()
        advantages = np.empty_like(rewards)
        for key in dict.fromkeys(keys):  # unique, in first-seen order
            rows = np.array([k == key for k in keys])
            buffer = self.history.setdefault(key, collections.deque(maxlen=self.buffer_size))
            buffer.extend(rewards[rows].ravel().tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                mean, std = np.mean(buffer), np.std(buffer)
            advantages[rows] = (rewards[rows] - mean) / (std + self.eps)
        return advantages

    def state_dict(self) -> dict:
        """Plain JSON-able state: resuming from it gives the same advantages."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "eps": self.eps,
            "history": {k: list(v) for k, v in self.history.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size = int(state["buffer_size"])
        self.min_count = int(state["min_count"])
        self.eps = float(state["eps"])
        self.history = {
            k: collections.deque((float(r) for r in v), maxlen=self.buffer_size)
            for k, v in state["history"].items()
        }


# ---------------------------------------------------------------------------------------------
# The methods.


def _edge_means_of_leaves(spec: TreeSpec, tree: Tree, leaf_advantages: jax.Array) -> Advantages:
    """Each edge takes the mean of the leaf advantages below its child."""
    return per_segment(tree, backup_mean(spec, leaf_advantages))


def grpo_advantages(
    spec: TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    tracker: PerPromptStatTracker | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    ddof: int = 0,
) -> Advantages:
    """Flat GRPO (DDPO / DanceGRPO / Flow-GRPO) and MixGRPO.

    Leaf advantages are the per-prompt group normalization of the rewards [P, L] (std with
    `ddof`: 0 population, 1 sample as DanceGRPO's code), or, with a `tracker`, DDPO's
    per-prompt statistics (host side: not jittable; `prompt_ids` names the prompt of each
    row; the tracker keeps its own population std). Every edge of a chain takes its leaf's
    advantage; where chains share a prefix, the shared edges take the mean of the leaves
    below them.
    """
    check_tree(spec, tree, rewards)
    if tracker is None:
        leaf_advantages = group_normalize(rewards, ddof)
    else:
        if prompt_ids is None:
            raise ValueError("the per-prompt stat tracker needs prompt_ids, one per prompt row.")
        leaf_advantages = jnp.asarray(tracker.update(prompt_ids, np.asarray(rewards)), jnp.float32)
    return _edge_means_of_leaves(spec, tree, leaf_advantages)


def per_depth_normalize(level: jax.Array, ddof: int = 0) -> jax.Array:
    """One structural level [P, n] normalized over each prompt's n nodes (all its trees):
    (v - mean) / (std + 1e-8), with the std of `ddof`; a level of one node, or one flatter
    than std 1e-6, gets 0."""
    if level.shape[-1] == 1:
        return jnp.zeros_like(level)
    normalized, std = normalize(level.astype(jnp.float32), ddof=_check_ddof(ddof))
    return jnp.where(std < DEPTH_STD_FLOOR, 0.0, normalized)


def treegrpo_advantages(
    spec: TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    ddof: int = 0,
    edge_normalization: str = "none",
) -> Advantages:
    """TreeGRPO: leaf A = (r - mean_p) / (std_p + 1e-8) over all leaves of the prompt (all
    its trees; population std, or the sample std with `ddof=1`); the edge parent -> child
    takes the mean of the leaf advantages below the child.

    A branch edge is thus credited with how good the subtree it chose is relative to the
    prompt's other samples, which differs step by step along a path.

    `edge_normalization="per_depth"` then normalizes those edge values over each depth of
    the prompt, with the same std as the leaves (the leaf depth is unchanged): the mean of
    m unrelated leaf advantages has a spread of about 1/sqrt(m) of a leaf's, so without it
    the shallow edges of a deep tree weigh little in the loss; with it every depth's edges
    carry credit of unit scale. Which subtree is better, and the sign of every edge, are
    unchanged. (It amplifies a shallow edge's noise as much as its signal: on the tiny
    model it measured no better, BENCHMARKS.md section 9.)

    `edge_normalization="per_leaf"` instead weights each mean by the leaves below the edge
    (`leaf_count_weights`): the sum of the leaf advantages below it, rescaled.
    """
    check_tree(spec, tree, rewards)
    if edge_normalization not in EDGE_NORMALIZATIONS:
        raise ValueError(
            f"edge_normalization must be one of {EDGE_NORMALIZATIONS}, got {edge_normalization!r}."
        )
    levels = _backup_mean(spec, group_normalize(rewards, ddof))
    if edge_normalization == "per_depth":
        levels = [per_depth_normalize(level, ddof) for level in levels]
    elif edge_normalization == "per_leaf":
        levels = [level * w for level, w in zip(levels, leaf_count_weights(tree, levels))]
    return per_segment(tree, levels)


def leaf_count_weights(tree: Tree, levels: Sequence[jax.Array]) -> list[jax.Array]:
    """Per structural level, the weight of an edge into it: the number of leaves below the
    edge, divided by that number's mean over the tree's trained edges (a scalar each).

    A leaf path's edges all carry the leaf's advantage in flat GRPO; where paths share an
    edge, the tree trains it once with the mean of their advantages. Weighting it by the
    paths through it restores their sum, so each trained step weighs in the loss as in a flat
    method, instead of in proportion to its edge count (2, 4, 8, 16 for w4 k2). The steps
    trained per level are counted from the segments' `active` flags (data, so one compiled
    function serves every window position).
    """
    sizes = [level.shape[-1] for level in levels]
    num_leaves = sizes[-1]
    steps_at = [jnp.zeros((), jnp.float32) for _ in levels]
    for seg in tree.segments:
        steps_at[seg.level] = steps_at[seg.level] + jnp.sum(jnp.asarray(seg.active, jnp.float32))
    num_edges = sum(s * n for s, n in zip(steps_at, sizes))
    leaf_paths = sum(steps_at) * num_leaves  # the edges' leaf counts, summed
    scale = num_edges / jnp.maximum(leaf_paths, 1.0)
    return [scale * (num_leaves / n) for n in sizes]


def centre_per_tree(spec: TreeSpec, rewards: jax.Array) -> jax.Array:
    """[P, leaves] rewards relative to their tree: minus the tree's first leaf (exact in
    floating point for nearby values, so a constant tree becomes exact zeros and a constant
    offset cancels exactly), then minus the mean of those differences (small numbers, so
    the fusion's rounding stays at the scale of the rewards' spread)."""
    num_prompts, num_leaves = rewards.shape
    per_tree = rewards.reshape(num_prompts, spec.num_trees, num_leaves // spec.num_trees)
    per_tree = per_tree - per_tree[..., :1]
    per_tree = per_tree - jnp.mean(per_tree, axis=-1, keepdims=True)
    return per_tree.reshape(num_prompts, num_leaves)


def fused_rewards(
    spec: TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    fusion: str = "mean",
    alpha: float = 1.0,
    relative: bool = False,
) -> list[jax.Array]:
    """BranchGRPO's reward fusion: every node's reward from its leaves, per structural level.

    With `relative`, each tree's rewards are first centred (`centre_per_tree`), so the
    fused values are relative to a per-tree baseline: exact zeros for a constant tree,
    whatever its size (the softmax weights of path-probability fusion sum to one only up to
    rounding, so fusing raw rewards of size ~20 and more spreads a constant tree by more
    than the 1e-6 floor). The depth-wise normalization is shift-invariant within a tree, so
    it is the same either way, up to that rounding.
    """
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}.")
    rewards = rewards.astype(jnp.float32)
    if relative:
        rewards = centre_per_tree(spec, rewards)
    if fusion == "mean":
        return backup_mean(spec, rewards)
    return backup_path_prob(spec, tree, rewards, alpha)


def depthwise_normalize(spec: TreeSpec, level: jax.Array) -> jax.Array:
    """BranchGRPO's depth-wise normalization of one level [P, n] within each tree.

    A depth of a tree is the set of its nodes after the same number of denoising steps (the
    official code's node.depth); those nodes are compared with one another, with the sample
    std (ddof=1). A depth with a single node, or with std < 1e-6, gets advantage 0.
    """
    num_prompts, n = level.shape
    per_tree = level.reshape(num_prompts, spec.num_trees, n // spec.num_trees)
    if per_tree.shape[-1] == 1:
        return jnp.zeros_like(level)
    normalized, std = normalize(per_tree, ddof=1)
    return jnp.where(std < DEPTH_STD_FLOOR, 0.0, normalized).reshape(num_prompts, n)


def branchgrpo_advantages(
    spec: TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    fusion: str = "mean",
    alpha: float = 1.0,
    normalization: str = "depthwise",
) -> Advantages:
    """BranchGRPO: fuse rewards up each tree (relative to a per-tree baseline, so the result
    is exact under a constant shift), normalize each depth within each tree; an edge takes
    the advantage of the node it produces.

    `normalization="leaf"` instead normalizes the rewards over the prompt's leaves (all its
    trees, population std, as GRPO and TreeGRPO do) and fuses those up the tree with no
    further rescaling: a depth whose nodes differ little gets small advantages. (Depth-wise,
    a depth of two nodes always gets -+0.71, however small and noisy their difference.) With
    mean fusion this is TreeGRPO's credit on BranchGRPO's tree.
    """
    check_tree(spec, tree, rewards)
    if normalization not in BRANCH_NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {BRANCH_NORMALIZATIONS}, got {normalization!r}."
        )
    if normalization == "leaf":
        leaf = group_normalize(rewards)
        return per_segment(tree, fused_rewards(spec, tree, leaf, fusion=fusion, alpha=alpha))
    levels = fused_rewards(spec, tree, rewards, fusion=fusion, alpha=alpha, relative=True)
    return per_segment(tree, [depthwise_normalize(spec, level) for level in levels])


# ---------------------------------------------------------------------------------------------
# Node rewards: credit from the rewards of the nodes' x0 estimates.
#
# `node_values` holds, per segment, the reward of each parent's x0 estimate at each of its
# steps, [T, P, n], or None where the segment kept none (`record_x0="branch_points"` keeps
# only the BRANCH steps'). A node's value is that reward where it was recorded, the leaf's
# reward at a leaf, and otherwise the value of its only child (an unrecorded node is the
# parent of an SDE step, one child). ODE steps pass values through: a segment's last
# children are the next segment's parents, or the leaves.

NodeValues = tuple  # per segment: [T, P, n] rewards of the parents' x0 estimates (NaN: not
# scored), or None
# "leaf_means": no estimate is scored; a BRANCH parent's value is its children's mean
NODE_REWARDS = ("none", "all_steps", "branch_points", "leaf_means")


def _children_mean(values: jax.Array, k: int) -> jax.Array:
    """[..., n * k] -> [..., n]: each parent's mean over its k contiguous children."""
    return jnp.mean(values.reshape(*values.shape[:-1], values.shape[-1] // k, k), axis=-1)


def edge_end_values(
    tree: Tree, rewards: jax.Array, node_values: NodeValues
) -> list[tuple[jax.Array, jax.Array]]:
    """Per segment, (parent values [T, P, n], child values [T, P, n * k]) of its edges. A
    node without a value of its own (a segment's None, or NaN: a step of a mixed segment
    outside the window, not scored) takes the value below it: its only child's, and so on
    down to the leaf's reward (exact across a deterministic step); a BRANCH parent without
    one (node_rewards="leaf_means") takes the mean of its k children's."""
    if len(node_values) != len(tree.segments):
        raise ValueError(f"{len(node_values)} node-value arrays for {len(tree.segments)} segments.")
    below = jnp.asarray(rewards, jnp.float32)
    out = []
    for seg, values in reversed(list(zip(tree.segments, node_values))):
        parents, children = [], []
        for t in reversed(range(seg.num_steps)):
            chex.assert_shape(below, seg.log_probs.shape[1:])
            if values is None:
                parent = below if seg.k == 1 else _children_mean(below, seg.k)
            else:
                value = jnp.asarray(values[t], jnp.float32)
                # a BRANCH step is always stochastic, so always scored
                parent = value if seg.k > 1 else jnp.where(jnp.isnan(value), below, value)
            parents.insert(0, parent)
            children.insert(0, below)
            below = parent
        out.insert(0, (jnp.stack(parents), jnp.stack(children)))
    return out


def masked_normalize(
    values: jax.Array, mask: jax.Array | None, *, ddof: int = 0, floor: float = 0.0
) -> jax.Array:
    """(v - mean) / (std + 1e-8) along the last axis over the members `mask` keeps (all when
    None); 0 for the others, for a group of fewer than two, or one whose std is below
    `floor`. Shifted by the group's first entry first, so a constant group gives exact 0."""
    values = values.astype(jnp.float32)
    keep = jnp.ones(values.shape, bool) if mask is None else jnp.asarray(mask, bool)
    weight = keep.astype(jnp.float32)
    count = jnp.sum(weight, axis=-1, keepdims=True)
    shifted = values - values[..., :1]
    mean = jnp.sum(shifted * weight, axis=-1, keepdims=True) / jnp.maximum(count, 1.0)
    deviations = (shifted - mean) * weight
    dof = jnp.maximum(count - _check_ddof(ddof), 1.0)
    std = jnp.sqrt(jnp.sum(deviations**2, axis=-1, keepdims=True) / dof)
    flat = (count < 2) | (std < floor) if floor > 0 else count < 2
    return jnp.where(flat | ~keep, 0.0, deviations / (std + EPS))


def node_gain_advantages(
    tree: Tree,
    rewards: jax.Array,
    node_values: NodeValues,
    *,
    ddof: int = 0,
    alive: Sequence[jax.Array] | None = None,
) -> Advantages:
    """Stepwise-Flow-GRPO's credit: an edge's gain, value(child) - value(parent), normalized
    over the prompt's edges of the same step (all its trees; (g - mean) / (std + 1e-8), the
    std of `ddof`, 0 for a step of one edge or one flatter than 1e-6). `alive` (per
    structural level, [P, n] bool: node pruning) leaves the pruned nodes' edges out of the
    normalization and gives them 0."""
    out = []
    for seg, (parents, children) in zip(tree.segments, edge_end_values(tree, rewards, node_values)):
        gains = children - jnp.repeat(parents, seg.k, axis=-1)
        mask = None
        if alive is not None:
            mask = jnp.broadcast_to(jnp.asarray(alive[seg.level], bool)[None], gains.shape)
        out.append(masked_normalize(gains, mask, ddof=ddof, floor=DEPTH_STD_FLOOR))
    return tuple(out)


def surviving_leaf_advantages(
    spec: TreeSpec, tree: Tree, rewards: jax.Array, leaf_alive: jax.Array, *, ddof: int = 0
) -> Advantages:
    """TreeGRPO's credit over the leaves node pruning keeps (`leaf_alive` [P, L]): the kept
    leaves normalized over the prompt's kept leaves, an edge the mean over the kept leaves
    below its child (0 where none is kept). With every leaf kept: `treegrpo_advantages`."""
    check_tree(spec, tree, rewards)
    keep = jnp.asarray(leaf_alive, jnp.float32)
    leaf = masked_normalize(rewards, leaf_alive, ddof=ddof)
    sums, counts = backup_mean(spec, leaf * keep), backup_mean(spec, keep)
    levels = [jnp.where(c > 0, s / jnp.maximum(c, 1e-30), 0.0) for s, c in zip(sums, counts)]
    return per_segment(tree, levels)


def mix_credit(gains: Advantages, leaves: Advantages, mix: float) -> Advantages:
    """mix * gain credit + (1 - mix) * leaf credit, edge by edge."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"the node credit's mix must be in [0, 1], got {mix}.")
    return tuple(mix * g + (1.0 - mix) * a for g, a in zip(gains, leaves))
