"""Node rewards (the rollout's x0 estimates, scored by run/node_scoring.py, or the leaves'
rewards backed up the tree; their gains mix into a `node_credit` method's edge credit in
`Method.clipped_advantages`): which methods and trees they apply to (`check`), node
pruning's survival (once per iteration), and the decodes, reward calls and pruned nodes they
add per prompt (`counts`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from tree_grpo_jax.core import pruning
from tree_grpo_jax.core.rollout import Tree


@dataclasses.dataclass(frozen=True)
class NodeScores:
    """One iteration's node rewards, as the run hands them to the objective."""

    # per segment, the global batch's rewards of its parents' x0 estimates, [T, P, n]
    # (None for a segment that kept none)
    per_segment: tuple
    # node pruning's (alive levels, decisions) of this process's rows (`survival`), or None
    survival: Any = None

    def local(self, rows: slice) -> tuple:
        """`per_segment` of the global batch's `rows`."""
        return tuple(None if v is None else v[:, rows] for v in self.per_segment)


def survival(config: ml_collections.ConfigDict, tree: Tree, node_values):
    """Node pruning's (alive levels, decisions) for this rollout, or None when off."""
    o = config.advantage
    if node_values is None or o.node_pruning == "none":
        return None
    return pruning.node_survival(
        tree,
        node_values,
        mode=o.node_pruning,
        threshold=o.node_pruning_threshold,
        quantile=o.node_pruning_quantile,
        keep=o.node_pruning_keep,
    )


def check(method, config: ml_collections.ConfigDict, spec) -> str | None:
    """One sentence where the `advantage` section's node rewards or node pruning do not
    apply to `method` (a `table.Method`) and its tree (`spec`: the tree at iteration 0)."""
    o, name = config.advantage, method.name
    if o.node_rewards == "none":
        if o.node_pruning != "none":
            return "advantage.node_pruning needs node values: set advantage.node_rewards."
        return None
    if not method.node_credit:
        return f"advantage.node_rewards credits the rollout's edges; {name} trains none."
    if o.node_rewards in ("branch_points", "leaf_means") and not spec.branch_ks:
        return (
            f"advantage.node_rewards='{o.node_rewards}' needs BRANCH steps; the {name} tree "
            "has none (use 'all_steps')."
        )
    if o.node_pruning == "none":
        return None
    if o.node_rewards == "leaf_means":
        return (
            "advantage.node_pruning drops nodes by their scored x0 estimates: "
            "node_rewards='leaf_means' scores none (use 'branch_points' or 'all_steps')."
        )
    if method.treegrpo_leaf_credit is None or not method.treegrpo_leaf_credit(o):
        return (
            "advantage.node_pruning recomputes TreeGRPO's leaf credit over the kept leaves: "
            "use treegrpo with edge_normalization='none', or branchgrpo with "
            "branch_normalization='leaf' and fusion='mean'."
        )
    if len(spec.branch_ks) < 2:
        return (
            "advantage.node_pruning drops nodes a BRANCH step made before they branch "
            f"again: the {name} tree needs at least two BRANCH steps."
        )
    return None


def counts(config: ml_collections.ConfigDict, spec) -> dict:
    """Per prompt, the x0 estimates node rewards decode and score each iteration beside
    the leaves (the parents of the tree's stochastic steps, or of its BRANCH steps; no
    extra denoiser rows), and
    where node pruning's count follows from the tree (`pruning.planned_node_pruning`)
    the nodes it drops and the rollout rows a sampler that stopped them would save (the
    static rollout still runs them): empty when off. `spec`: the plain tree."""
    o = config.advantage
    if o.node_rewards in ("none", "leaf_means"):  # leaf_means decodes nothing more
        return {}
    per_prompt = sum(
        b.num_steps * b.nodes_in
        for b in spec.segment_blocks
        if o.node_rewards == "all_steps" or b.step.k > 1
    )
    counts = {"node_decodes": per_prompt, "node_reward_calls": per_prompt}
    planned = pruning.planned_node_pruning(
        spec, o.node_pruning, o.node_pruning_quantile, o.node_pruning_keep
    )
    if planned is not None:
        guidance = 2 if config.sampling.guidance_scale != 1.0 else 1
        counts["node_pruned"] = planned[0]
        counts["node_saved_rollout_rows"] = planned[1] * guidance
    return counts
