"""The eval guard: reward hacking seen in the evaluations, as pure functions of their record.

At every evaluation of a run (`history["eval"]`: one dict of eval metrics per evaluation,
with its `iteration`) it compares the newest with the first: it trips when the diversity has
fallen below `eval.guard.min_diversity_fraction` of its first value, or when a held-out
metric (`eval.extra_rewards`) has fallen by more than `eval.guard.held_out_drop` while the
eval reward has risen. The training loop then stops (or warns) and keeps the best
evaluation's checkpoint, best by the eval reward.
"""

from __future__ import annotations


def _g(x: float) -> str:
    return f"{x:.4g}"


def check(config, evals: list[dict]) -> str | None:
    """Why the newest evaluation trips the guard (a clause), or None."""
    if len(evals) < 2:
        return None
    g = config.eval.guard
    first, last = evals[0], evals[-1]
    fraction = g.min_diversity_fraction
    if fraction > 0 and first.get("diversity", 0) > 0 and "diversity" in last:
        ratio = last["diversity"] / first["diversity"]
        if ratio < fraction:
            return (
                f"diversity fell to {ratio:.2f} of its first value ({_g(first['diversity'])} -> "
                f"{_g(last['diversity'])}), below eval.guard.min_diversity_fraction={fraction}"
            )
    rose = last["reward_mean"] > first["reward_mean"]
    if g.held_out_drop > 0 and rose:
        for name in config.eval.extra_rewards:
            if name in first and name in last and first[name] - last[name] > g.held_out_drop:
                return (
                    f"held-out {name} fell by {_g(first[name] - last[name])} ({_g(first[name])} "
                    f"-> {_g(last[name])}), more than eval.guard.held_out_drop="
                    f"{g.held_out_drop}, while the eval reward rose ({_g(first['reward_mean'])} "
                    f"-> {_g(last['reward_mean'])})"
                )
    return None


def best(evals: list[dict]) -> dict:
    """The evaluation with the highest eval reward (the earliest of equals)."""
    return max(evals, key=lambda e: (e["reward_mean"], -e["iteration"]))


def stop_line(reason: str, iteration: int, best_eval: dict, directory: str) -> str:
    return (
        f"stopped by the guard after {iteration} iterations: {reason}; the best checkpoint is "
        f"step {best_eval['iteration']} (eval reward {_g(best_eval['reward_mean'])}) in "
        f"{directory}."
    )
