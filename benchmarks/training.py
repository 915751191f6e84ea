"""Training benchmarks on the trainer's own iteration: counts measured at run time, time per
iteration, and eval reward against wall-clock and against images generated.

All presets run in one process on one loaded model whose denoiser counts its rows. Each
preset's first iteration compiles; it is the iteration whose counts are measured and it is
dropped from every timing. Timings then interleave the presets iteration by iteration, so a
slow spell of a shared machine hits them all alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import costs
from benchmarks.common import (
    LABELS,
    RowCounter,
    counting_denoiser,
    fmt_stats,
    markdown_table,
    pyplot,
    stats,
    with_denoiser,
)
from benchmarks.presets import Settings, load_model, make_config
from tree_grpo_jax.run import loop as train

TIME_KEYS = ("time_rollout", "time_reward", "time_update", "time_iteration")


@dataclasses.dataclass
class PresetRun:
    name: str
    config: object
    trainer: train.Trainer
    state: object  # advanced by the timing iterations
    initial_params: object  # never donated: a fresh state for every training run
    iteration: int = 0


def _copy(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def setup_presets(presets, settings: Settings, workdir: str) -> tuple[dict, RowCounter]:
    """One trainer per preset, all handed one model whose denoiser counts its rows (one
    denoiser object, so identical computations compile once)."""
    counter = RowCounter()
    model = load_model(settings)
    model = with_denoiser(model, counting_denoiser(model.denoise, counter))
    runs = {}
    for name in presets:
        config = make_config(name, settings)
        trainer, state = train.setup(config, workdir, model=model)
        runs[name] = PresetRun(name, config, trainer, state, _copy(state.params))
    return runs, counter


def measure_counts(pr: PresetRun, counter: RowCounter) -> dict:
    """Runs the preset's first iteration (it compiles) and counts what it ran.

    Denoiser rows of the whole iteration come from the callback; the rollout alone is run
    again (already compiled) to split them into rollout and train rows. Trained edges and
    rows are the gathered transitions' `num_edges` / `num_rows`.
    """
    trainer, c = pr.trainer, pr.config
    with counter.phase("iteration"):
        pr.state, metrics = trainer.iteration(pr.state, pr.iteration)
    pr.iteration += 1
    prompts = trainer.evaluator.prompts[: c.prompts.batch_size]
    with counter.phase("rollout"):
        sampled = trainer.rollout(pr.initial_params, prompts, jax.random.PRNGKey(0))
        jax.block_until_ready(sampled.tree.leaves)
    measured = {
        "rollout_rows": counter.rows["rollout"],
        "train_forward_rows_padded": counter.rows["iteration"] - counter.rows["rollout"],
        "trained_edges": metrics["trained_edges"],
        "train_rows": metrics["train_rows"],
        "rollout_denoiser_calls": counter.calls["rollout"],
        "minibatches": metrics["minibatches"],
        "node_decodes": metrics.get("node_decodes", 0),  # node rewards' extra decodes
    }
    counter.reset()
    result = costs.check(c, measured)
    result["prompts"] = c.prompts.batch_size
    result["compile_iteration_s"] = metrics["time_iteration"]
    return result


def time_iterations(runs: dict, iterations: int) -> dict:
    """`iterations` more iterations of every preset, interleaved; their phase times."""
    times = {name: {k: [] for k in TIME_KEYS} for name in runs}
    names = list(runs)
    for i in range(iterations):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
        for name in order:
            pr = runs[name]
            pr.state, metrics = pr.trainer.iteration(pr.state, pr.iteration)
            pr.iteration += 1
            for k in TIME_KEYS:
                times[name][k].append(metrics[k])
    summary = {}
    base = times[names[0]]["time_iteration"]
    for name in names:
        t = times[name]
        summary[name] = {k: stats(t[k]) for k in TIME_KEYS}
        # Paired ratios: iteration i of this preset against iteration i of the first preset.
        summary[name]["ratio_to_first"] = stats([a / b for a, b in zip(t["time_iteration"], base)])
        summary[name]["raw"] = t
    return summary


def time_table(summary: dict, leaves_per_iteration: int, cost_results: dict | None = None) -> str:
    names = list(summary)
    base = summary[names[0]]["time_iteration"]["median"]
    rows = []
    for name, s in summary.items():
        row = [
            LABELS[name],
            fmt_stats(s["time_rollout"]),
            fmt_stats(s["time_reward"]),
            fmt_stats(s["time_update"]),
            fmt_stats(s["time_iteration"]),
            f"{1000 * s['time_iteration']['median'] / leaves_per_iteration:.1f}",
            f"{s['time_iteration']['median'] / base:.2f}",
            fmt_stats(s["ratio_to_first"], 2),
        ]
        if cost_results:
            work = costs.work(cost_results[name]["derived_per_prompt"])
            row.append(f"{work / costs.work(cost_results[names[0]]['derived_per_prompt']):.2f}")
            row.append(f"{cost_results[name]['compile_iteration_s']:.0f}")
        rows.append(row)
    header = [
        "preset",
        "rollout s",
        "reward s",
        "update s",
        "iteration s",
        "ms / image",
        f"iteration vs {names[0]} (ratio of medians)",
        "paired ratio [min, max]",
    ]
    if cost_results:
        header += [f"rows predict (rollout + 3 x train rows vs {names[0]})", "first iteration s"]
    note = (
        "median [min, max] over the timed iterations; the first iteration of each preset "
        "(it compiles) is dropped and shown on its own."
    )
    return markdown_table(header, rows) + "\n\n" + note


def plot_times(summary: dict, path: str) -> None:
    plt = pyplot()
    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = np.zeros(len(names))
    for key, label in (
        ("time_rollout", "rollout"),
        ("time_reward", "reward"),
        ("time_update", "update"),
    ):
        vals = np.array([summary[n][key]["median"] for n in names])
        ax.bar(range(len(names)), vals, bottom=bottom, label=label)
        bottom += vals
    lo = [summary[n]["time_iteration"]["min"] for n in names]
    hi = [summary[n]["time_iteration"]["max"] for n in names]
    med = [summary[n]["time_iteration"]["median"] for n in names]
    ax.errorbar(
        range(len(names)),
        med,
        yerr=[np.subtract(med, lo), np.subtract(hi, med)],
        fmt="k.",
        label="iteration (median, min-max)",
    )
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_ylabel("seconds per iteration")
    ax.set_title("Time per iteration (tiny model, medians)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Reward against wall-clock.


def fresh_run(pr: PresetRun, seed: int) -> tuple[train.Trainer, object]:
    """The preset's trainer started over with `seed` from the initial weights; compiled
    functions are kept."""
    trainer = pr.trainer.reseed(seed)
    return trainer, trainer.init_state(_copy(pr.initial_params))


def _eval_point(trainer, params, clock, images, iteration) -> dict:
    metrics, _ = trainer.evaluator.evaluate(params)
    return {
        "time": clock,
        "images": images,
        "iteration": iteration,
        "reward": metrics["reward_mean"],
        "accuracy": metrics.get("digit_accuracy", float("nan")),
    }


def eval_times(budget_s: float, evals: int) -> list[float]:
    """Clock readings to evaluate at: quadratically spaced, dense early where the fast
    presets move, ending at the budget."""
    return [budget_s * ((i + 1) / evals) ** 2 for i in range(evals)]


def train_for_budget(pr: PresetRun, seed: int, budget_s: float, evals: int) -> dict:
    """Trains a fresh copy until its training clock passes `budget_s`.

    The clock is the sum of the iterations' own `time_iteration` (rollout, reward, update);
    evaluation runs between iterations, off the clock, at the first iteration boundary past
    each of `eval_times`, and once at the end.
    """
    trainer, state = fresh_run(pr, seed)
    leaves = trainer.spec().leaves * pr.config.prompts.batch_size
    curve = [_eval_point(trainer, state.params, 0.0, 0, 0)]
    clock, images, iteration = 0.0, 0, 0
    pending = eval_times(budget_s, evals)
    times = []
    while clock < budget_s:
        state, metrics = trainer.iteration(state, iteration)
        iteration += 1
        clock += metrics["time_iteration"]
        images += leaves
        times.append(metrics["time_iteration"])
        if clock >= pending[0] or clock >= budget_s:
            curve.append(_eval_point(trainer, state.params, clock, images, iteration))
            pending = [t for t in pending if t > clock] or [budget_s]
    return {"seed": seed, "curve": curve, "iterations": iteration, "iteration_times": times}


def reward_vs_time(runs: dict, seeds, budget_s: float, evals: int) -> dict:
    """Every preset for every seed, seed by seed (presets interleaved)."""
    out = {name: [] for name in runs}
    for seed in seeds:
        for name, pr in runs.items():
            out[name].append(train_for_budget(pr, seed, budget_s, evals))
    return out


def seed_curves(results: list, key: str, grid: np.ndarray) -> np.ndarray:
    """[seeds, grid] rewards, each seed's eval curve linearly interpolated at `grid`."""
    return np.stack(
        [
            np.interp(grid, [p[key] for p in r["curve"]], [p["reward"] for p in r["curve"]])
            for r in results
        ]
    )


def first_crossing(grid: np.ndarray, values: np.ndarray, target: float) -> float | None:
    """First x on the piecewise-linear curve where it reaches `target`; None if never."""
    above = np.nonzero(values >= target)[0]
    if not len(above):
        return None
    i = int(above[0])
    if i == 0:
        return float(grid[0])
    x0, x1, y0, y1 = grid[i - 1], grid[i], values[i - 1], values[i]
    return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0))


def _ratio(base: float | None, other: float | None) -> float | None:
    if base is None or other is None or other <= 0:
        return None
    return base / other


def time_to_reward(curves: dict, budget_s: float, baseline: str = "grpo", points: int = 2000):
    """How much sooner each preset reaches the eval reward the baseline ends its budget with.

    Seeds are combined by the pointwise median of their curves on a common time grid (one
    seed that collapses does not move it). The target is the baseline's median reward at the
    budget; a preset's time is the first time its median curve reaches the target, and its
    speedup is the baseline's own time to the target over the preset's. (The baseline's own
    time is the budget unless its curve had passed its final value earlier.) Per seed the
    same is done seed against seed.
    """
    grid = np.linspace(0.0, budget_s, points)
    base = seed_curves(curves[baseline], "time", grid)
    base_median = np.median(base, axis=0)
    target = float(base_median[-1])
    t_base = first_crossing(grid, base_median, target)
    out = {
        "target_reward": target,
        "baseline_time_to_target_s": t_base,
        "budget_s": budget_s,
        "start_reward": float(base_median[0]),
        "presets": {},
    }
    for name, results in curves.items():
        per_seed = seed_curves(results, "time", grid)
        median = np.median(per_seed, axis=0)
        t_hit = first_crossing(grid, median, target)
        seed_ratios, seed_hits = [], []
        for s in range(len(results)):
            b = base[min(s, len(base) - 1)]
            hit = first_crossing(grid, per_seed[s], float(b[-1]))
            seed_hits.append(hit)
            seed_ratios.append(_ratio(first_crossing(grid, b, float(b[-1])), hit))
        reached = [r for r in seed_ratios if r is not None]
        out["presets"][name] = {
            "time_to_target_s": t_hit,
            # None when the target is met at the start (the baseline ended below its start).
            "speedup": _ratio(t_base, t_hit),
            "per_seed_time_to_target_s": seed_hits,
            "per_seed_speedup": stats(reached) if reached else None,
            "seeds_reaching": sum(t is not None for t in seed_hits),
            "final_reward": stats(per_seed[:, -1]),
            "start_reward": float(median[0]),
            "final_accuracy": stats([r["curve"][-1]["accuracy"] for r in results]),
            "iterations": stats([r["iterations"] for r in results]),
            "images": stats([r["curve"][-1]["images"] for r in results]),
            "iteration_s": stats([t for r in results for t in r["iteration_times"]]),
        }
    return out


def reward_table(ttr: dict) -> str:
    rows = []
    for name, r in ttr["presets"].items():
        t = r["time_to_target_s"]
        seeds = r["per_seed_speedup"]
        n = r["final_reward"]["n"]
        rows.append(
            [
                LABELS[name],
                fmt_stats(r["final_reward"]),
                fmt_stats(r["final_accuracy"], 2),
                f"{r['iterations']['median']:.0f}",
                f"{r['images']['median']:.0f}",
                f"{t:.1f}" if t is not None else "not reached",
                f"{r['speedup']:.1f}x" if r["speedup"] else "-",
                f"{fmt_stats(seeds, 1)} ({r['seeds_reaching']}/{n})" if seeds else f"- (0/{n})",
            ]
        )
    header = [
        "preset",
        f"eval reward at {ttr['budget_s']:.0f} s, median [min, max] over seeds",
        "digit accuracy at budget",
        "iterations",
        "images",
        f"s to reach {ttr['target_reward']:.3f} (median curve)",
        "time-to-reward speedup vs grpo",
        "per seed: speedup vs the same seed of grpo, median [min, max] (seeds reaching)",
    ]
    note = (
        f"Every preset starts at eval reward {ttr['start_reward']:.3f} (the same weights). "
        f"Target: grpo's median eval reward at the end of its budget, {ttr['target_reward']:.3f}"
        f"; grpo's median curve first reaches it at {ttr['baseline_time_to_target_s']:.1f} s."
    )
    return markdown_table(header, rows) + "\n\n" + note


def plot_rewards(curves: dict, budget_s: float, key: str, path: str) -> None:
    """The seeds' median eval reward (line) and their min-max band, against `key` ("time" or
    "images"); a second panel zooms in on the first seconds / on grpo's image count."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    if key == "time":
        zoom = budget_s / 4
    else:
        zoom = 1.25 * max(r["curve"][-1]["images"] for r in curves["grpo"])
    for ax, right in zip(axes, (None, zoom)):
        for name, results in curves.items():
            end = budget_s if key == "time" else min(r["curve"][-1][key] for r in results)
            grid = np.linspace(0.0, end, 400)
            values = seed_curves(results, key, grid)
            (line,) = ax.plot(grid, np.median(values, axis=0), label=LABELS[name])
            ax.fill_between(grid, values.min(axis=0), values.max(axis=0), alpha=0.12, lw=0,
                            color=line.get_color())  # fmt: skip
        if right:
            ax.set_xlim(0, right)
        ax.set_xlabel("training wall-clock, s (evaluation excluded)" if key == "time" else
                      "images generated (leaves)")  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval reward (digit_alignment, mean log p)")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[1].set_title("zoom: first quarter" if key == "time" else "zoom: grpo's image count")
    seeds = len(next(iter(curves.values())))
    axes[0].set_title(f"Eval reward vs {'wall-clock' if key == 'time' else 'images'} "
                      f"(median of {seeds} seeds, band min-max)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
