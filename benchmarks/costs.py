"""The cost of each preset, from its tree spec alone, and the same counts measured at run time.

Derived counts (per prompt): rollout denoiser rows = one per node per step; trained edges
and training rows (one row = one parent, whose single forward scores all its trained
children) per stochastic step, minus the edges pruning drops. They are computed here from the
spec and the pruning settings by counting nodes, independently of `pruning.py` and
`transitions.py`, and compared with what a training iteration really ran: denoiser rows
counted by a callback inside the jitted rollout and train step, and the gathered rows' own
`num_rows` / `num_edges`.
"""

from __future__ import annotations

import math

from benchmarks.common import LABELS, fmt_stats, markdown_table
from tree_grpo_jax import methods
from tree_grpo_jax.core.tree_spec import Kind, TreeSpec
from tree_grpo_jax.methods import nft


def _width_keep_fraction(spec: TreeSpec, split: int, mode: str, ratio: float) -> float:
    """Share of the branches after the last split that width pruning keeps."""
    if mode == "none":
        return 1.0
    k = spec.steps[split].k
    if mode == "top_per_branch":
        return max(1, int(k * ratio)) / k
    per_tree = spec.nodes_out[split] // spec.num_trees
    return min(per_tree, max(2, int(per_tree * ratio))) / per_tree


def derived_counts(config, iteration: int = 0) -> dict:
    """Per-prompt counts of one iteration of `config`, from the spec and pruning settings."""
    spec = methods.spec_at(config, iteration)
    a = config.advantage
    guidance = config.sampling.guidance_scale != 1.0
    if methods.get(config.tree.method).forward_process:
        return _forward_process_counts(config, spec)
    prunes = methods.get(config.tree.method).pruning
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
        "spec": spec.describe(),
        "leaves": spec.leaves,
        "guidance": guidance,
        "rollout_rows": spec.rollout_denoiser_calls(guidance),
        "trained_edges": edges,
        "train_rows": rows,
        "train_forward_rows": rows * (2 if guidance else 1),
        # Unpruned and un-amortized, for reference: the spec's own counts.
        "spec_trainable_edges": spec.trainable_edges,
        "spec_train_rows": spec.training_forward_rows(True, False),
    }


def _forward_process_counts(config, spec) -> dict:
    """DiffusionNFT: every leaf at its share of the sampling steps, one row each; a row runs
    the trained and the old policy (and the reference with a KL term)."""
    per_sample = nft.steps_per_sample(
        config.sampling.num_steps, config.diffusion_nft.timestep_fraction
    )
    rows = spec.leaves * per_sample
    forwards = 3 if config.train.kl_beta > 0 else 2
    return {
        "spec": spec.describe(),
        "leaves": spec.leaves,
        "guidance": False,
        "rollout_rows": spec.rollout_denoiser_calls(False),
        "trained_edges": rows,
        "train_rows": rows,
        "train_forward_rows": rows * forwards,
        "spec_trainable_edges": 0,
        "spec_train_rows": 0,
    }


def padded_forward_rows(train_rows: int, rows_per_minibatch: int, guidance: bool) -> int:
    """Denoiser rows the train steps run for `train_rows` rows: whole minibatches."""
    batches = math.ceil(train_rows / rows_per_minibatch)
    return batches * rows_per_minibatch * (2 if guidance else 1)


def check(config, measured: dict) -> dict:
    """Derived against measured counts of one iteration with `config.prompts.batch_size`
    prompts; returns both and whether every count matches."""
    d = derived_counts(config)
    p = config.prompts.batch_size
    expected = {
        "rollout_rows": d["rollout_rows"] * p,
        "trained_edges": d["trained_edges"] * p,
        "train_rows": d["train_rows"] * p,
        "train_forward_rows_padded": padded_forward_rows(
            d["train_rows"] * p, config.train.rows_per_minibatch, d["guidance"]
        ),
    }
    matches = {k: int(measured[k]) == int(v) for k, v in expected.items()}
    return {
        "derived_per_prompt": d,
        "expected": expected,
        "measured": measured,
        "matches": matches,
        "all_match": all(matches.values()),
    }


def per_leaf(count: int, leaves: int) -> float:
    return count / leaves


def cost_table(results: dict) -> str:
    """Markdown: per-leaf costs of every preset, derived and measured."""
    rows = []
    for name, r in results.items():
        d, m, p = r["derived_per_prompt"], r["measured"], r["prompts"]
        leaves = d["leaves"]
        g = 2 if d["guidance"] else 1

        def per(count, leaves=leaves, p=p):
            return f"{count / (leaves * p):.2f}"

        rows.append(
            [
                LABELS[name],
                d["spec"].split(": ", 1)[1],
                leaves,
                f"{d['rollout_rows'] / leaves:.2f}",
                per(m["rollout_rows"]),
                f"{d['trained_edges'] / leaves:.2f}",
                per(m["trained_edges"]),
                f"{d['train_rows'] * g / leaves:.2f}",
                per(m["train_rows"] * g),
                per(m["train_forward_rows_padded"]),
                "yes" if r["all_match"] else "**no**",
            ]
        )
    header = [
        "preset",
        "tree (per prompt)",
        "leaves",
        "rollout rows / leaf (derived)",
        "(measured)",
        "trained edges / leaf (derived)",
        "(measured)",
        "train forward rows / leaf (derived)",
        "(measured)",
        "train rows run incl. minibatch padding / leaf",
        "all match",
    ]
    return markdown_table(header, rows)


def work(d: dict) -> int:
    """Rollout rows plus three times the train rows (a backward costs about two forwards)."""
    return d["rollout_rows"] + 3 * d["train_rows"]


def ratio_table(results: dict, baseline: str = "grpo") -> str:
    """Markdown: each preset's costs relative to the baseline (derived counts)."""
    base = results[baseline]["derived_per_prompt"]
    rows = []
    for name, r in results.items():
        d = r["derived_per_prompt"]
        rows.append(
            [
                LABELS[name],
                f"{d['rollout_rows'] / base['rollout_rows']:.2f}",
                f"{d['trained_edges'] / base['trained_edges']:.2f}",
                f"{d['train_rows'] / base['train_rows']:.2f}",
                f"{work(d) / work(base):.2f}",
            ]
        )
    header = [
        "preset",
        f"rollout rows vs {baseline}",
        f"trained edges vs {baseline}",
        f"train rows vs {baseline}",
        "rollout + 3 x train rows (forward + backward) vs grpo",
    ]
    return markdown_table(header, rows)


__all__ = ["derived_counts", "check", "cost_table", "ratio_table", "fmt_stats"]
