"""Node rewards in the trainer: the x0 estimates the rollout kept, decoded and scored.

The rollout keeps Tweedie's estimate of the clean sample at the parents of its recorded
steps (`Segment.x0_hats`, from the predictions it made anyway: no extra denoiser rows);
here they are decoded and scored by the run's reward like the leaves (`run/scoring.py`),
one batch per iteration, and laid back out per segment, [T, P, n], for the method's credit
(`Method.clipped_advantages`) and node pruning (`methods.node_credit.survival`, once per
iteration). The decodes and reward calls are extra: `node_credit.counts` counts them per
prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tree_grpo_jax.core import pruning
from tree_grpo_jax.core.rollout import Tree
from tree_grpo_jax.methods import node_credit
from tree_grpo_jax.run import scoring


def estimates(tree: Tree) -> tuple[np.ndarray | None, list[tuple[np.ndarray, int] | None]]:
    """(every kept x0 estimate of a stochastic step [P, M, *S] prompt by prompt, each
    segment's (which of its T steps were scored [T] bool, n) or None where it kept none);
    (None, ...) when no segment kept any. A mixed segment's steps outside the window are
    deterministic and trained on no edge: their estimates are not scored (the credit takes
    the exact value below them, `advantages.edge_end_values`)."""
    parts, shapes = [], []
    for seg in tree.segments:
        if seg.x0_hats is None:
            shapes.append(None)
            continue
        scored = np.asarray(seg.active, bool)
        x0 = np.asarray(seg.x0_hats)[scored]  # [T scored, P, n, *S]
        t, p, n = x0.shape[:3]
        parts.append(np.swapaxes(x0, 0, 1).reshape(p, t * n, *x0.shape[3:]))
        shapes.append((scored, n))
    if not parts:
        return None, shapes
    return np.concatenate(parts, axis=1), shapes


def per_segment(values: np.ndarray, shapes) -> tuple:
    """[P, M] rewards in `estimates`' order -> per segment [T, P, n], NaN at the steps not
    scored (None where the segment kept none)."""
    out, at = [], 0
    for shape in shapes:
        if shape is None:
            out.append(None)
            continue
        scored, n = shape
        t = int(scored.sum())
        block = values[:, at : at + t * n].reshape(values.shape[0], t, n)
        full = np.full((len(scored), values.shape[0], n), np.nan, np.float32)
        full[scored] = np.swapaxes(block, 0, 1)
        out.append(full)
        at += t * n
    return tuple(out)


def with_node_values(trainer, sampled, batch, iteration: int):
    """`sampled` (a `trainer.Rollout`) with the rewards of its kept x0 estimates, per
    segment [T, P, n] for the global batch, and node pruning's survival of its rows (once
    per iteration; `node_credit.NodeScores`); unchanged when node rewards are off (nothing
    kept). Decoded in parts and scored as the leaves are (`scoring.score`). With
    node_rewards="leaf_means" nothing is scored: every segment's values are None, and the
    credit backs the leaves' rewards up the tree (`advantages.edge_end_values`)."""
    if trainer.config.advantage.node_rewards == "leaf_means":
        scores = node_credit.NodeScores((None,) * len(sampled.tree.segments))
        return dataclasses.replace(sampled, node_values=scores)
    x0, shapes = estimates(sampled.tree)
    if x0 is None:
        return sampled
    num_prompts, per_prompt = x0.shape[:2]
    decoded = scoring.decode(
        trainer.device_decode,
        x0.reshape(num_prompts * per_prompt, *x0.shape[2:]),
        groups=num_prompts,
        parts=scoring.decode_parts(trainer.config.reward_options, trainer.reward.on_host),
    )
    prompts = [p for p in sampled.prompts[sampled.rows] for _ in range(per_prompt)]
    metadata = trainer.prompt_metadata(batch, sampled.rows, per_prompt)
    where = f"on the node estimates of iteration {iteration}"
    values, _, _ = scoring.score(trainer.reward, decoded, prompts, where, metadata)
    values = per_segment(values.reshape(len(sampled.prompts), per_prompt), shapes)
    scores = node_credit.NodeScores(values)
    survival = node_credit.survival(trainer.config, sampled.tree, scores.local(sampled.rows))
    scores = dataclasses.replace(scores, survival=survival)
    return dataclasses.replace(sampled, node_values=scores)


def node_metrics(trainer, sampled) -> dict:
    """The iteration's node figures: their mean reward, the estimates scored, and with node
    pruning the nodes dropped and the denoiser rows a sampler that stopped them would save
    (the static-shape rollout still computes those rows)."""
    scores = sampled.node_values
    if scores is None:
        return {}
    if all(v is None for v in scores.per_segment):
        return {}  # leaf_means: nothing scored
    kept = np.concatenate([v.ravel() for v in scores.per_segment if v is not None])
    kept = kept[~np.isnan(kept)]
    metrics = {"node_reward_mean": float(np.mean(kept)), "node_decodes": int(kept.size)}
    if scores.survival is not None:
        _, decisions = scores.survival
        plain = sampled.spec.at(sampled.window_start)
        metrics["node_pruned"] = int(sum(d[2].sum() for d in decisions))
        metrics["node_saved_rollout_rows"] = pruning.saved_rollout_rows(
            plain, decisions, trainer.guidance
        )
    return metrics
