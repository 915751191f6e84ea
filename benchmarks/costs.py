"""The cost of each preset, from its tree spec alone, and the same counts measured at run time.

Derived counts (per prompt): rollout denoiser rows = one per node per step; trained edges
and training rows as the method's objective counts them from the spec and the settings (PPO:
one row = one parent, whose single forward scores all its trained children, per stochastic
step, minus the edges pruning drops, by counting nodes, independently of `pruning.py` and
`transitions.py`; DiffusionNFT: each leaf at its share of the sigmas). They are compared with
what a training iteration really ran: denoiser rows counted by a callback inside the jitted
rollout and train step, and the gathered rows' own `num_rows` / `num_edges`.
"""

from __future__ import annotations

import math

from benchmarks.common import LABELS, fmt_stats, markdown_table
from tree_grpo_jax import methods


def derived_counts(config, iteration: int = 0) -> dict:
    """Per-prompt counts of one iteration of `config`, from the spec and the settings: the
    method's objective counts its own rows (`Objective.training_counts`)."""
    return methods.get(config.tree.method).training_counts(config, iteration)


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
    if "node_decodes" in d:  # node rewards: x0 estimates decoded and scored beside the leaves
        expected["node_decodes"] = d["node_decodes"] * p
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


def row_equivalents(d: dict, inner_epochs: int = 1) -> float:
    """One iteration's cost per prompt in forward-row equivalents: the rollout's denoiser
    rows, and per inner epoch the train step's forwards plus two for each that the gradient
    flows back through (a backward costs about two forwards). Guidance, reference and old
    copies counted as the objective counts them (`Objective.training_counts`)."""
    train = d["train_forward_rows"] + 2 * d["train_grad_rows"]
    return d["rollout_rows"] + inner_epochs * train


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


__all__ = [
    "derived_counts",
    "check",
    "cost_table",
    "ratio_table",
    "row_equivalents",
    "fmt_stats",
]
