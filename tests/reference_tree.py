"""Brute-force reference for credit assignment and pruning.

The tree is rebuilt as explicit node objects by a recursion over the spec, and every
quantity is computed by walking them in plain Python float64 (math.fsum, statistics):
no arrays, no levels, no segment reductions. The only thing shared with the library is the
documented layout: the children of node j are j*k .. j*k + k - 1 of the next level, which
is how the reference reads a node's log-prob and a leaf's reward out of the arrays.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from tree_grpo_jax.core.rollout import Segment, Tree
from tree_grpo_jax.core.tree_spec import Kind, TreeSpec


@dataclasses.dataclass(eq=False)
class Node:
    prompt: int
    tree: int  # which root of the prompt it descends from
    depth: int  # steps from the root
    index: int  # position within its level (all trees of the prompt)
    step: int | None = None  # the step that made it; None for a root
    kind: Kind | None = None  # that step's kind
    logp: float | None = None  # log-prob of the edge into it (stochastic steps)
    reward: float | None = None  # leaves only
    parent: Node | None = None
    children: list[Node] = dataclasses.field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.kind in (Kind.SDE, Kind.BRANCH)


def random_tree(
    spec: TreeSpec, num_prompts: int, rng: np.random.Generator, window_start: int = 0
) -> Tree:
    """A Tree with the spec's segment layout, random log-probs and dummy states.

    For a sliding-window family the layout is the family's (the same at every position) and
    the step indices and active flags those of `window_start`: inactive steps (a mixed
    segment outside the window) get log-prob 0, as the rollout records them.
    """
    stochastic = set(spec.at(window_start).trainable_steps)
    segments = []
    for block in spec.segment_blocks:
        begin, _ = block.bounds(window_start)
        t, n, k = block.num_steps, block.nodes_in, block.step.k
        steps = np.arange(begin, begin + t, dtype=np.int32)
        active = np.array([int(i) in stochastic for i in steps])
        log_probs = rng.normal(0.0, 2.0, (t, num_prompts, n * k)).astype(np.float32)
        segments.append(
            Segment(
                parents=np.zeros((t, num_prompts, n, 1), np.float32),
                children=np.zeros((t, num_prompts, n * k, 1), np.float32),
                log_probs=np.where(active[:, None, None], log_probs, 0.0).astype(np.float32),
                steps=steps,
                active=active,
                k=k,
                noise_scale=block.step.noise_scale,
                score_scale=block.step.noise_scale,
                level=block.level,
            )
        )
    return Tree(segments=tuple(segments), leaves=np.zeros((num_prompts, spec.leaves, 1)))


def build_forest(spec: TreeSpec, tree: Tree, rewards, window_start: int = 0) -> list[list[Node]]:
    """roots[p] = the prompt's root nodes, each grown to the leaves (of the plain spec at
    `window_start` when `spec` is a sliding-window family)."""
    spec = spec.at(window_start)
    logp_of_step = {}
    for seg in tree.segments:
        for t, (step, active) in enumerate(zip(np.asarray(seg.steps), np.asarray(seg.active))):
            if active:
                logp_of_step[int(step)] = np.asarray(seg.log_probs[t], np.float64)
    rewards = np.asarray(rewards, np.float64)

    def grow(node: Node) -> None:
        if node.depth == spec.num_steps:
            node.reward = float(rewards[node.prompt, node.index])
            return
        i = node.depth
        step = spec.steps[i]
        for c in range(step.k):
            child = Node(
                prompt=node.prompt,
                tree=node.tree,
                depth=i + 1,
                index=node.index * step.k + c,
                step=i,
                kind=step.kind,
                parent=node,
            )
            if step.stochastic:
                child.logp = float(logp_of_step[i][node.prompt, child.index])
            node.children.append(child)
            grow(child)

    forest = []
    for p in range(rewards.shape[0]):
        roots = [Node(prompt=p, tree=r, depth=0, index=r) for r in range(spec.num_trees)]
        for root in roots:
            grow(root)
        forest.append(roots)
    return forest


def descendants(node: Node) -> list[Node]:
    out = [node]
    for child in node.children:
        out.extend(descendants(child))
    return out


def leaves_below(node: Node) -> list[Node]:
    if not node.children:
        return [node]
    return [leaf for child in node.children for leaf in leaves_below(child)]


def edges(forest) -> list[Node]:
    """Every trainable edge, represented by the node it produces."""
    return [n for roots in forest for root in roots for n in descendants(root) if n.trainable]


def _mean(values) -> float:
    return math.fsum(values) / len(values)


# ---------------------------------------------------------------------------------------------
# Advantages: dict node -> advantage of the edge into it.


def leaf_group_advantages(forest, ddof: int = 0) -> dict[Node, float]:
    """(r - mean) / (std + 1e-8) over all leaves of each prompt: population std (ddof 0) or
    sample std (ddof 1; 0 for a single leaf)."""
    out = {}
    for roots in forest:
        leaves = [leaf for root in roots for leaf in leaves_below(root)]
        rewards = [leaf.reward for leaf in leaves]
        if ddof == 0:
            std = statistics.pstdev(rewards)
        else:
            std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        mean = _mean(rewards)
        for leaf in leaves:
            out[leaf] = (leaf.reward - mean) / (std + 1e-8)
    return out


def treegrpo_reference(forest, ddof: int = 0) -> dict[Node, float]:
    """Edge parent -> child: mean of the leaf advantages below the child."""
    leaf_adv = leaf_group_advantages(forest, ddof)
    return {n: _mean([leaf_adv[leaf] for leaf in leaves_below(n)]) for n in edges(forest)}


def treegrpo_per_depth_reference(forest, ddof: int = 0) -> dict[Node, float]:
    """The edge values of `treegrpo_reference`, normalized over the edges of each depth of
    each prompt (all its trees), with the std of `ddof`: (v - mean) / (std + 1e-8); 0 for a
    depth of one edge or one whose std is below 1e-6."""
    edge = treegrpo_reference(forest, ddof)
    groups: dict[tuple[int, int], list[Node]] = {}
    for node in edge:
        groups.setdefault((node.prompt, node.depth), []).append(node)
    out = {}
    for nodes in groups.values():
        values = [edge[n] for n in nodes]
        if len(values) == 1:
            out[nodes[0]] = 0.0
            continue
        std = statistics.pstdev(values) if ddof == 0 else statistics.stdev(values)
        mean = _mean(values)
        for n, v in zip(nodes, values):
            out[n] = 0.0 if std < 1e-6 else (v - mean) / (std + 1e-8)
    return out


def treegrpo_per_leaf_reference(forest, ddof: int = 0) -> dict[Node, float]:
    """The edge values of `treegrpo_reference` times the number of leaves below the edge,
    times the prompt's number of trainable edges over the sum of those leaf counts."""
    edge = treegrpo_reference(forest, ddof)
    out = {}
    for roots in forest:
        nodes = [n for root in roots for n in descendants(root) if n.trainable]
        counts = [len(leaves_below(n)) for n in nodes]
        for n, count in zip(nodes, counts):
            out[n] = edge[n] * count * len(nodes) / math.fsum(counts)
    return out


def branchgrpo_leaf_reference(forest, fusion: str = "mean", alpha: float = 1.0) -> dict:
    """BranchGRPO's fusion applied to the prompt's normalized leaf rewards (population std),
    with no depth-wise step: an edge takes the fused value of the node it produces."""
    leaf_adv = leaf_group_advantages(forest)

    def value(node: Node) -> float:
        if not node.children:
            return leaf_adv[node]
        values = [value(c) for c in node.children]
        if fusion == "mean" or len(values) == 1:
            return _mean(values)
        logits = [alpha * c.logp for c in node.children]
        top = max(logits)
        weights = [math.exp(z - top) for z in logits]
        total = math.fsum(weights)
        return math.fsum(w / total * v for w, v in zip(weights, values))

    return {n: value(n) for n in edges(forest)}


def fused_reward(node: Node, fusion: str, alpha: float) -> float:
    if not node.children:
        return node.reward
    if fusion == "mean":
        return _mean([leaf.reward for leaf in leaves_below(node)])
    values = [fused_reward(c, fusion, alpha) for c in node.children]
    if len(node.children) == 1:
        return values[0]
    logits = [alpha * c.logp for c in node.children]
    top = max(logits)
    weights = [math.exp(z - top) for z in logits]
    total = math.fsum(weights)
    return math.fsum(w / total * v for w, v in zip(weights, values))


def branchgrpo_reference(forest, fusion: str = "mean", alpha: float = 1.0) -> dict[Node, float]:
    """Fuse, then normalize each depth of each tree with the sample std."""
    advantage = {}
    for roots in forest:
        for root in roots:
            by_depth: dict[int, list[Node]] = {}
            for node in descendants(root):
                by_depth.setdefault(node.depth, []).append(node)
            for nodes in by_depth.values():
                rewards = [fused_reward(n, fusion, alpha) for n in nodes]
                if len(nodes) == 1:
                    advantage[nodes[0]] = 0.0
                    continue
                mean, std = _mean(rewards), statistics.stdev(rewards)
                for n, r in zip(nodes, rewards):
                    advantage[n] = 0.0 if std < 1e-6 else (r - mean) / (std + 1e-8)
    return {n: advantage[n] for n in edges(forest)}


def edge_value(arrays, tree: Tree, node: Node) -> float:
    """The entry of a per-segment array that belongs to the edge into `node`."""
    for seg, array in zip(tree.segments, arrays):
        for t, (step, active) in enumerate(zip(np.asarray(seg.steps), np.asarray(seg.active))):
            if active and int(step) == node.step:
                return np.asarray(array)[t, node.prompt, node.index]
    raise KeyError(f"no segment holds step {node.step}")


# ---------------------------------------------------------------------------------------------
# Pruning: dict node -> kept?


def depth_pruning_reference(
    forest, depths, iteration, slide_every, stop_depth, last_split, count_from=0
):
    """count_from 1 counts iterations from 1, as the released code's `step` does."""
    depths = sorted(depths)
    if slide_every is not None:
        stop = last_split if stop_depth is None else stop_depth
        stop = 0 if stop is None else stop
        shift = 0
        step = iteration + count_from
        for _ in range(step // slide_every):  # one depth per interval, up to the stop
            if depths[0] - shift > stop:
                shift += 1
        depths = [d - shift for d in depths]
    return {n: n.depth not in depths for n in edges(forest)}


def width_pruning_reference(forest, spec: TreeSpec, advantage_of, mode: str, ratio: float):
    """advantage_of(node) -> the advantage of the edge into node (the arrays under test)."""
    kept = {n: True for n in edges(forest)}
    splits = [i for i, s in enumerate(spec.steps) if s.kind is Kind.BRANCH]
    if not splits:
        return kept
    last = splits[-1]

    def selected(branches, take_best, take_worst):
        ranked = sorted(branches, key=lambda b: (-advantage_of(b), b.index))
        return set(ranked[:take_best]) | set(ranked[len(ranked) - take_worst :])

    chosen = set()
    for roots in forest:
        for root in roots:
            branches = [n for n in descendants(root) if n.step == last]
            if mode == "top_per_branch":
                for parent in {b.parent for b in branches}:
                    group = parent.children
                    chosen |= selected(group, max(1, int(len(group) * ratio)), 0)
            else:
                keep = min(len(branches), max(2, int(len(branches) * ratio)))
                chosen |= selected(branches, keep // 2, keep - keep // 2)
    for branch in {n for n in edges(forest) if n.step == last}:
        if branch in chosen:
            continue
        for n in descendants(branch):
            if n is not branch and n.trainable:
                kept[n] = False
    return kept


# ---------------------------------------------------------------------------------------------
# Node rewards and node pruning.


def recorded_values(tree: Tree, node_values) -> dict[int, np.ndarray]:
    """step index -> [P, n] node values of that step's parents, for every recorded step
    (a step whose values are all NaN was not scored: it is left out)."""
    out = {}
    for seg, values in zip(tree.segments, node_values):
        if values is None:
            continue
        for t, step in enumerate(np.asarray(seg.steps)):
            if not np.all(np.isnan(values[t])):
                out[int(step)] = np.asarray(values[t], np.float64)
    return out


def node_value(node: Node, recorded: dict[int, np.ndarray]) -> float:
    """A node's value: the reward of its x0 estimate where its step recorded one, a leaf's
    reward, else the mean of its children's values (its only child's on a chain)."""
    if node.depth in recorded:
        return float(recorded[node.depth][node.prompt, node.index])
    if not node.children:
        return node.reward
    return statistics.fmean(node_value(child, recorded) for child in node.children)


def _normalized(values: list[float], ddof: int, floor: float) -> list[float]:
    if len(values) < 2:
        return [0.0] * len(values)
    std = statistics.pstdev(values) if ddof == 0 else statistics.stdev(values)
    if floor > 0 and std < floor:
        return [0.0] * len(values)
    mean = _mean(values)
    return [(v - mean) / (std + 1e-8) for v in values]


def node_gain_reference(forest, recorded, ddof: int = 0, dead=frozenset()) -> dict[Node, float]:
    """Edge parent -> child: value(child) - value(parent), normalized over the prompt's live
    edges of the same step (0 for a group of one, or one with std below 1e-6)."""
    out = {n: 0.0 for n in edges(forest)}
    groups: dict[tuple[int, int], list[Node]] = {}
    for n in edges(forest):
        if n not in dead:
            groups.setdefault((n.prompt, n.step), []).append(n)
    for nodes in groups.values():
        gains = [node_value(n, recorded) - node_value(n.parent, recorded) for n in nodes]
        for n, a in zip(nodes, _normalized(gains, ddof, 1e-6)):
            out[n] = a
    return out


def _variance_drop(values: list[float], keep: float) -> list[bool]:
    """Drop all but the subset of max(2, round(keep * m)) values with the largest population
    variance, found by trying every subset of that size (itertools.combinations)."""
    import itertools

    size = min(len(values), max(2, round(keep * len(values))))
    best = max(
        itertools.combinations(range(len(values)), size),
        key=lambda c: statistics.pvariance([values[i] for i in c]),
    )
    return [i not in best for i in range(len(values))]


def node_pruning_reference(
    forest, spec: TreeSpec, recorded, mode: str, threshold, quantile, keep=0.5
):
    """(dead nodes, dropped nodes): at each BRANCH step after the first, in step order, each
    prompt's live parents are dropped by the rule (cluster: |z| < threshold with the
    population std; quantile: below the quantile; variance: outside the largest-variance
    subset of its size) unless fewer than two would stay; a dropped
    node kills its chain up to the node the last BRANCH step made, and all below it."""
    branch_steps = [i for i, s in enumerate(spec.steps) if s.kind is Kind.BRANCH]
    dead: set[Node] = set()
    dropped_all: list[Node] = []
    for step in branch_steps[1:]:
        for roots in forest:
            live = [
                n for root in roots for n in descendants(root) if n.depth == step and n not in dead
            ]
            values = [node_value(n, recorded) for n in live]
            if mode == "cluster":
                mean, std = _mean(values), statistics.pstdev(values)
                drop = [abs((v - mean) / (std + 1e-8)) < threshold for v in values]
            elif mode == "variance":
                drop = _variance_drop(values, keep)
            else:
                cut = float(np.quantile(np.asarray(values), quantile))
                drop = [v < cut for v in values]
            if len(live) - sum(drop) < 2:
                continue
            for n, d in zip(live, drop):
                if not d:
                    continue
                dropped_all.append(n)
                head = n
                while head.kind is not Kind.BRANCH:
                    head = head.parent
                dead.update(descendants(head))
    return dead, dropped_all


def surviving_leaf_reference(forest, dead, ddof: int = 0) -> dict[Node, float]:
    """TreeGRPO's credit over the live leaves: leaves normalized over the prompt's live
    leaves, an edge the mean of the live leaf advantages below it (0 if none)."""
    leaf_adv = {}
    for roots in forest:
        leaves = [leaf for root in roots for leaf in leaves_below(root) if leaf not in dead]
        for leaf, a in zip(leaves, _normalized([x.reward for x in leaves], ddof, 0.0)):
            leaf_adv[leaf] = a
    out = {}
    for n in edges(forest):
        kept = [leaf_adv[leaf] for leaf in leaves_below(n) if leaf in leaf_adv]
        out[n] = _mean(kept) if kept else 0.0
    return out


def saved_rows_reference(forest, dropped, num_steps: int) -> int:
    """Nodes at depths below num_steps strictly below a dropped node: the denoiser rows a
    sampler that stopped the dropped nodes would not run."""
    below = {d for m in dropped for d in descendants(m) if d is not m}
    return sum(1 for n in below if n.depth < num_steps)
