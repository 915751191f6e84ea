"""Credit assignment: from leaf rewards to one advantage per trainable edge.

Everything here is indexed the way the rollout lays the tree out. Level d of a prompt holds
the nodes at depth d: the `num_trees` roots at depth 0, and the children of step i at depth
i + 1 (every step, ODE included, makes one level). The children of node j are j*k .. j*k+k-1,
so a node's descendants are one contiguous block of the level below, and backing values up
the tree is one segment reduction per step over parent ids `arange(n * k) // k`.

An edge is (parent, child) at a stochastic step; its advantage is laid out like the
segment's `log_probs`, `[T, P, n * k]`, and is a value of its child node. The methods differ
only in what that value is:

- grpo / mixgrpo: leaf A = (r - mean_p) / (std_p + 1e-8) over the prompt's leaves
  (population std), or from a DDPO per-prompt stat tracker; an edge takes the mean of the
  leaf advantages below its child. On chains that is simply the leaf's advantage.
- treegrpo: the TreeGRPO advantage, `treegrpo_advantages`: the same leaf normalization over
  all leaves of the prompt (all its trees), and an edge parent -> child takes the mean of the
  leaf advantages below the child. Branch edges therefore get step-specific credit.
- branchgrpo / branchgrpo_mix: rewards are fused up each tree (mean of descendant leaves, or
  path-probability weighting), then normalized per depth within each tree with the sample
  std; a depth with one node, or with std < 1e-6, gets advantage 0.

`compute_advantages` dispatches by method name and clips to +-clip.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.rollout import Tree
from tree_grpo_jax.tree_spec import TreeSpec

EPS = 1e-8  # added to the std in every normalization (GRPO, TreeGRPO, BranchGRPO)
DEPTH_STD_FLOOR = 1e-6  # BranchGRPO: a depth whose fused rewards are this flat gets A = 0
FUSIONS = ("mean", "path_prob")
METHODS = ("grpo", "mixgrpo", "treegrpo", "branchgrpo", "branchgrpo_mix")

Advantages = tuple[jax.Array, ...]  # one [T, P, n * k] array per segment


# ---------------------------------------------------------------------------------------------
# Checks and layout.


def check_tree(spec: TreeSpec, tree: Tree, rewards: jax.Array | None = None) -> int:
    """Asserts the tree's segments are the spec's stochastic runs; returns the prompt count."""
    runs = [run for run in spec.runs if run.step.stochastic]
    if len(runs) != len(tree.segments):
        raise ValueError(
            f"the tree has {len(tree.segments)} segments but the spec has {len(runs)} "
            "stochastic runs; was it rolled out with this spec?"
        )
    num_prompts = tree.leaves.shape[0]
    for run, seg in zip(runs, tree.segments):
        if (seg.first_step, seg.num_steps, seg.k) != (run.first_step, run.num_steps, run.step.k):
            raise ValueError(
                f"segment at step {seg.first_step} ({seg.num_steps} steps, k={seg.k}) does not "
                f"match the spec's run at step {run.first_step} ({run.num_steps} steps, "
                f"k={run.step.k})."
            )
        n_out = spec.nodes_out[run.first_step]
        chex.assert_shape(seg.log_probs, (run.num_steps, num_prompts, n_out))
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


def step_log_probs(tree: Tree) -> dict[int, jax.Array]:
    """Step index -> the log-probs of that step's children, [P, n * k]."""
    return {
        int(step): seg.log_probs[t]
        for seg in tree.segments
        for t, step in enumerate(seg.step_indices)
    }


def per_segment(tree: Tree, levels: Sequence[jax.Array]) -> Advantages:
    """Edge values from node values: the edge of step i takes its child's value, levels[i+1]."""
    return tuple(
        jnp.stack([levels[int(step) + 1] for step in seg.step_indices]) for seg in tree.segments
    )


# ---------------------------------------------------------------------------------------------
# Reward backup.

ChildWeights = Callable[[int, jax.Array], jax.Array]


def backup(spec: TreeSpec, leaf_values: jax.Array, child_weights: ChildWeights) -> list[jax.Array]:
    """Backs leaf values up the tree: a parent is the weighted sum of its children.

    `child_weights(i, children)` gives the weights of step i's children, [P, n * k], summing
    to one within each sibling group; it is only called at steps with k > 1 (a single child,
    SDE or ODE, passes its value through). Returns the values of every level, levels[d] of
    shape [P, nodes at depth d]: levels[0] are the roots, levels[-1] the leaves.
    """
    levels = [leaf_values]
    for i in reversed(range(spec.num_steps)):
        k = spec.steps[i].k
        children = levels[0]
        if k > 1:
            children = _sum_siblings(child_weights(i, children) * children, k)
        levels.insert(0, children)
    return levels


def backup_mean(spec: TreeSpec, leaf_values: jax.Array) -> list[jax.Array]:
    """levels[d][p, j]: the mean of the leaf values below node j at depth d.

    Every node's block of leaves has the same size, so the mean of the children's means is
    the mean over the node's leaves.
    """
    return backup(
        spec, leaf_values, lambda i, children: jnp.full_like(children, 1.0 / spec.steps[i].k)
    )


def backup_path_prob(
    spec: TreeSpec, tree: Tree, leaf_values: jax.Array, alpha: float = 1.0
) -> list[jax.Array]:
    """BranchGRPO's path-probability fusion: value(node) = sum over its children c of
    softmax(alpha * logp_c) * value(c), the softmax over the node's children, logp_c the
    log-prob of the edge into c. Steps with one child pass the value through."""
    log_probs = step_log_probs(tree)

    def weights(i, children):
        num_prompts, num_children = children.shape
        k = spec.steps[i].k
        logits = alpha * log_probs[i].astype(jnp.float32).reshape(num_prompts, -1, k)
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


def group_normalize(rewards: jax.Array) -> jax.Array:
    """Per-prompt GRPO normalization of rewards [P, L] over each prompt's L leaves."""
    return normalize(rewards.astype(jnp.float32), ddof=0)[0]


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
) -> Advantages:
    """Flat GRPO (DDPO / DanceGRPO / Flow-GRPO) and MixGRPO.

    Leaf advantages are the per-prompt group normalization of the rewards [P, L], or, with a
    `tracker`, DDPO's per-prompt statistics (host side: not jittable; `prompt_ids` names the
    prompt of each row). Every edge of a chain takes its leaf's advantage; where chains share
    a prefix, the shared edges take the mean of the leaves below them.
    """
    check_tree(spec, tree, rewards)
    if tracker is None:
        leaf_advantages = group_normalize(rewards)
    else:
        if prompt_ids is None:
            raise ValueError("the per-prompt stat tracker needs prompt_ids, one per prompt row.")
        leaf_advantages = jnp.asarray(tracker.update(prompt_ids, np.asarray(rewards)), jnp.float32)
    return _edge_means_of_leaves(spec, tree, leaf_advantages)


def treegrpo_advantages(spec: TreeSpec, tree: Tree, rewards: jax.Array) -> Advantages:
    """TreeGRPO: leaf A = (r - mean_p) / (std_p + 1e-8) over all leaves of the prompt (all
    its trees, population std); the edge parent -> child takes the mean of the leaf
    advantages below the child.

    A branch edge is thus credited with how good the subtree it chose is relative to the
    prompt's other samples, which differs step by step along a path.
    """
    check_tree(spec, tree, rewards)
    return _edge_means_of_leaves(spec, tree, group_normalize(rewards))


def fused_rewards(
    spec: TreeSpec, tree: Tree, rewards: jax.Array, *, fusion: str = "mean", alpha: float = 1.0
) -> list[jax.Array]:
    """BranchGRPO's reward fusion: every node's reward from its leaves, per level."""
    rewards = rewards.astype(jnp.float32)
    if fusion == "mean":
        return backup_mean(spec, rewards)
    if fusion == "path_prob":
        return backup_path_prob(spec, tree, rewards, alpha)
    raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}.")


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
) -> Advantages:
    """BranchGRPO: fuse rewards up each tree, normalize each depth within each tree; an edge
    takes the advantage of the node it produces."""
    check_tree(spec, tree, rewards)
    levels = fused_rewards(spec, tree, rewards, fusion=fusion, alpha=alpha)
    return per_segment(tree, [depthwise_normalize(spec, level) for level in levels])


_METHODS: dict[str, Callable[..., Advantages]] = {
    "grpo": grpo_advantages,
    "mixgrpo": grpo_advantages,
    "treegrpo": treegrpo_advantages,
    "branchgrpo": branchgrpo_advantages,
    "branchgrpo_mix": branchgrpo_advantages,
}


def compute_advantages(
    method: str,
    spec: TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    clip: float = 5.0,
    **method_kwargs,
) -> Advantages:
    """The advantages of `method`, clipped to +-clip, one [T, P, n * k] array per segment.

    method_kwargs go to the method: `tracker`, `prompt_ids` for grpo / mixgrpo; `fusion`,
    `alpha` for branchgrpo / branchgrpo_mix.
    """
    if method not in _METHODS:
        raise ValueError(f"unknown advantage method {method!r}; use one of {', '.join(METHODS)}.")
    advantages = _METHODS[method](spec, tree, rewards, **method_kwargs)
    return tuple(jnp.clip(a, -clip, clip) for a in advantages)
