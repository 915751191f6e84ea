"""The PPO objective: PPO-clip on the rollout's own stochastic steps (core/loss.py).

Its rows are the tree's trainable edges gathered by parent (`core.transitions`), each with
its advantage from the method's credit assignment and, where the method prunes, only the
edges its masks keep. The state keeps no old policy: the rollout's own log-probabilities
are the ratio's denominator.

Its section `grpo_guard` switches on GRPO-Guard (arXiv 2510.22319) for every PPO method of
the table: the rollout records each parent's step mean and the loss normalises the ratio
with it and reweights the steps (core/loss.py). Off by default: today's runs are unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.core import pruning, sampling, transitions
from tree_grpo_jax.core.loss import GUARD_REWEIGHTS, PPOSettings, ppo_loss
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.tree_spec import Kind, TreeSpec
from tree_grpo_jax.methods.objective import Objective, RowSource


def _width_keep_fraction(spec: TreeSpec, split: int, mode: str, ratio: float) -> float:
    """Share of the branches after the last split that width pruning keeps."""
    if mode == "none":
        return 1.0
    k = spec.steps[split].k
    if mode == "top_per_branch":
        return max(1, int(k * ratio)) / k
    per_tree = spec.nodes_out[split] // spec.num_trees
    return min(per_tree, max(2, int(per_tree * ratio))) / per_tree


class PPOObjective(Objective):
    name = "ppo"
    section = "grpo_guard"
    replays_rows = True

    # GRPO-Guard for the PPO methods (grpo, mixgrpo, treegrpo, branchgrpo and their
    # variants), flow models only. The ratio becomes
    # exp(s * (logp - logp_old + |mu - mu_old|^2 / (2 s^2))), s the step's std, mu_old the
    # rollout's step mean (recorded by the rollout: one more state per trained parent), and
    # with reweight "dt" each edge's term is divided by its step's |dt|. Sources:
    # Flow-Factory src/flow_factory/trainers/grpo.py (GRPOGuardTrainer: the normalised ratio)
    # and the Flow-GRPO-based GRPO-Guard trainers (the `policy_loss / sqrt_dt**2`
    # reweighting); arXiv 2510.22319.
    settings = {
        "enabled": Setting(False, "the normalised ratio (flow models)"),
        "reweight": Setting(
            "dt",
            '"dt": divide each step\'s terms by |dt|; "none": the ratio alone',
            choices=GUARD_REWEIGHTS,
        ),
    }

    def check_run(self, config, spec):
        if spec.trainable_edges > 0:
            return None
        return f"the {config.tree.method} tree has no trainable step."

    def check_model(self, config, model):
        if not config.grpo_guard.enabled:
            return None
        schedule = model.make_schedule(config.sampling.num_steps, config.sampling)
        if isinstance(schedule, sampling.FlowSchedule):
            return None
        return (
            "grpo_guard.enabled normalises the ratio of a flow SDE step: it needs a "
            f"rectified-flow model (tiny_flow, sd3, flux), not model.name={config.model.name}."
        )

    def rollout_options(self, config):
        """The parents' step means, for GRPO-Guard's ratio; their x0 estimates, for node
        rewards."""
        options = {"record_means": True} if config.grpo_guard.enabled else {}
        if config.advantage.node_rewards in ("all_steps", "branch_points"):
            options["record_x0"] = config.advantage.node_rewards
        return options

    def rows(self, method, config, source: RowSource, key=None) -> transitions.Transitions:
        """The trainable edges of this process's trees with their clipped advantages (the
        stat tracker updated when the method uses one), less the edges the masks drop (the
        method's pruning, and node pruning's dead subtrees)."""
        nodes = source.local_node_values()
        alive = None if source.node_survival is None else source.node_survival[0]
        advantages = method.clipped_advantages(
            config,
            source.spec,
            source.tree,
            jnp.asarray(source.rewards[source.rows]),
            prompt_ids=source.prompts[source.rows],
            tracker=source.tracker,
            node_values=nodes,
            alive=alive,
        )
        masks = method.edge_masks_at(
            config, source.spec, source.tree, advantages, source.iteration, source.window_start
        )
        if alive is not None:
            masks = pruning.combine_masks(masks, pruning.alive_edge_masks(source.tree, alive))
        rows = transitions.gather_transitions(source.tree, advantages, masks)
        return source.in_global_batch(rows)

    def loss(self, config, denoise_fn):
        c = config
        return ppo_loss, PPOSettings(
            denoise_fn=denoise_fn,
            kl_beta=float(c.train.kl_beta),
            guidance_scale=float(c.sampling.guidance_scale),
            clip_range=float(c.train.clip_range),
            reduce=str(c.sampling.log_prob_reduce),
            guard=bool(c.grpo_guard.enabled),
            guard_reweight=str(c.grpo_guard.reweight),
            correction=str(c.train.replay_correction),
            weight_max=float(c.train.replay_weight_max),
        )

    def zero_rows(self, config, rows, sample_shape, max_k, dtype, make=np.zeros):
        means = config.grpo_guard.enabled
        return transitions.zero_transitions(rows, sample_shape, max_k, dtype, make, means)

    def row_samples(self, config, spec):
        """GRPO-Guard: each recorded parent's step mean beside the recorded states; node
        rewards: each kept parent's x0 estimate."""
        blocks = spec.segment_blocks
        means = sum(b.num_steps * b.nodes_in for b in blocks) if config.grpo_guard.enabled else 0
        kept = config.advantage.node_rewards
        x0 = sum(
            b.num_steps * b.nodes_in
            for b in blocks
            if kept == "all_steps" or (kept == "branch_points" and b.step.k > 1)
        )
        return means + x0

    def replay_samples(self, config, spec):
        """Every recorded parent's row before pruning: its state, its actions padded to the
        widest branch, and (GRPO-Guard) its step mean (a sliding window's blocks are the
        same at every position)."""
        blocks = spec.segment_blocks
        max_k = max((b.step.k for b in blocks), default=1)
        rows = sum(b.num_steps * b.nodes_in for b in blocks)
        return rows * (1 + max_k + int(config.grpo_guard.enabled))

    def training_counts(self, config, spec: TreeSpec, prunes: bool) -> dict:
        """Trained edges and rows (one row = one parent, whose single forward scores all its
        trained children) per stochastic step, less the edges pruning drops: counted from the
        nodes of `spec`, independently of `pruning.py` and `transitions.py`."""
        a = config.advantage
        guidance = config.sampling.guidance_scale != 1.0
        # depth d = the nodes step d - 1 makes
        pruned_steps = {d - 1 for d in a.depth_pruning} if prunes else set()
        splits = [i for i, s in enumerate(spec.steps) if s.kind is Kind.BRANCH]
        width = a.width_pruning if prunes else "none"
        edges = rows = 0
        for i in spec.trainable_steps:
            if i in pruned_steps:
                continue
            step_edges, step_rows = spec.nodes_out[i], spec.nodes_in[i]
            if splits and i > splits[-1]:  # a chain step after the last split: rows = edges
                keep = _width_keep_fraction(spec, splits[-1], width, a.width_pruning_ratio)
                step_edges = step_rows = round(step_edges * keep)
            edges += step_edges
            rows += step_rows
        return {
            "guidance": guidance,
            "rollout_rows": spec.rollout_denoiser_calls(guidance),
            "trained_edges": edges,
            "train_rows": rows,
            "train_forward_rows": rows * (2 if guidance else 1),
            "train_grad_rows": rows * (2 if guidance else 1),  # both halves are trained
            # Unpruned and un-amortized, for reference: the spec's own counts.
            "spec_trainable_edges": spec.trainable_edges,
            "spec_train_rows": spec.training_forward_rows(True, False),
        }


PPO = PPOObjective()
