"""The CPU benchmark suite: every comparison side by side in one process.

    python -m benchmarks.run            # full: about 30 minutes on a 2-core CPU
    python -m benchmarks.run --quick    # about 3 minutes
    python -m benchmarks.run --smoke    # under a minute, a stand-in model (checks the code)
    python -m benchmarks.run --out=benchmarks/results         # updates the committed results
    python -m benchmarks.run --quick --out=benchmarks/results/quick

Stages, in order:
  1. costs:  every preset's derived per-leaf costs, checked against the counts its first
             (compiling) training iteration really ran;
  2. time:   time per iteration (rollout, reward, update, total), presets interleaved
             iteration by iteration, the compiling iteration dropped;
  3. reward: every preset trained from the same weights for the same training wall-clock
             budget per seed; eval reward against time and against images generated, and
             the time each needs to reach the reward grpo ends its budget with;
  4. engine: the batched tree engine against a node-at-a-time rollout of the same tree.
Results go to `<out>/*.json`, `<out>/*.png` and `<out>/tables.md`; `<out>` is
`runs/benchmarks/run` (full) or `runs/benchmarks/run/quick` (git-ignored, under the working
directory) unless `--out` says otherwise, and a temporary folder for `--smoke`. The committed
results in `benchmarks/results/` change only with `--out=benchmarks/results` (or
`benchmarks/results/quick`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax

from benchmarks import costs, node_loop, training
from benchmarks.common import (
    LABELS,
    PRESETS,
    default_out,
    fmt_stats,
    machine,
    markdown_table,
    pyplot,
    save_json,
    smoke_rng,
    stats,
    timed,
)
from benchmarks.presets import Settings, load_model, make_config
from tree_grpo_jax import methods
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.prompts import load_prompts

MODES = {
    # presets, timed iterations, seeds, budget s, evals per run, engine trees, engine reps
    "smoke": dict(
        model="standin",
        presets=tuple(PRESETS),
        iterations=2,
        seeds=(0,),
        budget=1.0,
        evals=3,
        engine_trees=("treegrpo",),
        engine_reps=2,
        overhead_reps=0,
    ),
    "quick": dict(
        model="tiny",
        presets=("grpo", "treegrpo", "branchgrpo"),
        iterations=3,
        seeds=(0,),
        budget=8.0,
        evals=5,
        engine_trees=("treegrpo",),
        engine_reps=3,
        overhead_reps=0,
    ),
    "full": dict(
        model="tiny",
        presets=tuple(PRESETS),
        iterations=8,
        seeds=(0, 1, 2),
        budget=45.0,
        evals=15,
        engine_trees=("treegrpo", "branchgrpo"),
        engine_reps=5,
        overhead_reps=5,
    ),
}

ENGINE_GUIDANCE = 3.0  # the tiny demo's guidance scale: the node loop runs a batch of two


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about 3 minutes on 2 CPU cores")
    mode.add_argument("--smoke", action="store_true", help="a stand-in model; checks the code")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default runs/benchmarks/run[/quick]; benchmarks/results[/quick] "
        "updates the committed results)",
    )
    p.add_argument("--budget", type=float, default=None, help="training seconds per preset-seed")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (0, 1, ...)")
    p.add_argument("--iterations", type=int, default=None, help="timed iterations per preset")
    p.add_argument("--presets", default=None, help="comma-separated subset of the presets")
    p.add_argument("--model", default=None, choices=("tiny", "random_tiny", "standin"))
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-4)")
    p.add_argument(
        "--update-per-minibatch",
        action="store_true",
        help="one optimizer update per minibatch instead of one per iteration",
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="DIR",
        help="rebuild tables.md and the plots of a results folder from its JSON, run nothing",
    )
    p.add_argument(
        "--stages",
        default="costs,time,reward,engine",
        help="comma-separated subset of costs,time,reward,engine (costs always runs: it is "
        "the compiling first iteration)",
    )
    return p.parse_args(argv)


def resolve(args) -> tuple[str, dict]:
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = dict(MODES[name])
    if args.budget is not None:
        mode["budget"] = args.budget
    if args.seeds is not None:
        mode["seeds"] = tuple(range(args.seeds))
    if args.iterations is not None:
        mode["iterations"] = args.iterations
    if args.presets:
        chosen = tuple(p.strip() for p in args.presets.split(","))
        unknown = [p for p in chosen if p not in PRESETS]
        if unknown:
            raise SystemExit(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}.")
        mode["presets"] = chosen
    if args.model:
        mode["model"] = args.model
    if "grpo" not in mode["presets"]:
        mode["presets"] = ("grpo", *mode["presets"])  # the baseline of every ratio
    return name, mode


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# Stage 4 and the callback check.


def engine_vs_loop(model_settings: Settings, trees, reps: int) -> dict:
    model = load_model(model_settings)
    settings = Settings(model=model_settings.model, guidance_scale=ENGINE_GUIDANCE)
    out = {}
    for name in trees:
        config = make_config(name, settings)
        prompts = load_prompts(config.prompts.source)
        prompts = [prompts[i % len(prompts)] for i in range(settings.prompts)]
        spec = methods.get(config.tree.method).spec_at(config)
        log(f"[engine] {name}: {spec.describe()}")
        out[name] = node_loop.compare(
            model.denoise,
            model.params,
            model.encode_prompts(prompts),
            model.make_schedule(settings.num_steps, config.sampling),
            spec,
            model.sample_shape,
            uncond=model.encode_prompts([""])[0],
            guidance_scale=settings.guidance_scale,
            reps=reps,
        )
        r = out[name]
        log(
            f"[engine] {name}: engine {fmt_stats(r['engine_s'])} s, node loop "
            f"{fmt_stats(r['loop_s'])} s, speedup {r['speedup_of_medians']:.1f}x, "
            f"same leaves: {r['same_leaves']}"
        )
    return out


def callback_overhead(runs: dict, settings: Settings, reps: int) -> dict:
    """The grpo rollout with the row-counting denoiser against the plain one, interleaved."""
    pr = runs["grpo"]
    counting = pr.trainer
    plain, _ = train.setup(pr.config, counting.workdir, model=load_model(settings))
    prompts = counting.evaluator.prompts[: pr.config.prompts.batch_size]

    def go(trainer):
        return trainer.rollout(pr.initial_params, prompts, jax.random.PRNGKey(0)).tree.leaves

    timed(go, plain)
    timed(go, counting)
    t_plain, t_count = [], []
    for _ in range(reps):
        t_plain.append(timed(go, plain)[0])
        t_count.append(timed(go, counting)[0])
    return {
        "plain_s": stats(t_plain),
        "counting_s": stats(t_count),
        "ratio": stats([b / a for a, b in zip(t_plain, t_count)]),
    }


def plot_engine(results: dict, path: str) -> None:
    plt = pyplot()
    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, key, label in ((-0.2, "engine_s", "batched engine"), (0.2, "loop_s", "node loop")):
        med = [results[n][key]["median"] for n in names]
        lo = [results[n][key]["median"] - results[n][key]["min"] for n in names]
        hi = [results[n][key]["max"] - results[n][key]["median"] for n in names]
        xs = [i + offset for i in range(len(names))]
        ax.bar(xs, med, width=0.4, yerr=[lo, hi], label=label)
    for i, n in enumerate(names):
        ax.annotate(
            f"{results[n]['speedup_of_medians']:.1f}x",
            (i, results[n]["loop_s"]["median"]),
            ha="center",
            va="bottom",
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds per rollout (median, min-max)")
    ax.set_title("One rollout: batched tree levels vs one node per denoiser call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_costs(results: dict, path: str) -> None:
    plt = pyplot()
    names = list(results)
    keys = (
        ("rollout_rows", "rollout rows"),
        ("trained_edges", "trained edges"),
        ("train_rows", "train forward rows"),
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        vals = [
            results[n]["derived_per_prompt"][key] / results[n]["derived_per_prompt"]["leaves"]
            for n in names
        ]
        ax.bar([i + (k - 1) * width for i in range(len(names))], vals, width=width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_ylabel("per leaf (no guidance; guidance doubles rows)")
    ax.set_title("Cost per leaf at 16 leaves per prompt, 10 steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def stage_costs(runs, counter, out) -> dict:
    results = {}
    for preset, pr in runs.items():
        results[preset] = r = training.measure_counts(pr, counter)
        measured = {k: r["measured"][k] for k in r["expected"]}
        log(
            f"[costs] {preset}: derived {r['expected']} measured {measured} "
            f"match={r['all_match']} (first iteration {r['compile_iteration_s']:.1f} s)"
        )
    save_json(out, "costs", {"presets": results})
    return results


def stage_time(runs, settings, mode, out, cost_results) -> dict:
    times = training.time_iterations(runs, mode["iterations"])
    payload = {"prompts": settings.prompts, "leaves_per_prompt": 16, "presets": times}
    save_json(out, "time_per_iteration", payload)
    log("[time]\n" + training.time_table(times, settings.prompts * 16, cost_results))
    return times


def stage_reward(runs, mode, out) -> dict:
    curves = training.reward_vs_time(runs, mode["seeds"], mode["budget"], mode["evals"])
    ttr = training.time_to_reward(curves, mode["budget"])
    payload = {"budget_s": mode["budget"], "seeds": mode["seeds"], "time_to_reward": ttr}
    save_json(out, "reward_vs_time", {**payload, "curves": curves})
    log("[reward]\n" + training.reward_table(ttr))
    return ttr


def stage_engine(settings, mode, out) -> dict:
    engine = engine_vs_loop(settings, mode["engine_trees"], mode["engine_reps"])
    payload = {"prompts": settings.prompts, "steps": settings.num_steps}
    save_json(
        out, "engine_vs_node_loop", {**payload, "guidance_scale": ENGINE_GUIDANCE, "trees": engine}
    )
    log("[engine]\n" + node_loop.table(engine))
    return engine


def _read(out: str, name: str) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def report(out: str) -> str:
    """Every table (`tables.md`) and plot of a results folder, from its JSON files alone."""
    suite = _read(out, "suite") or {}
    tables = [f"# Benchmark tables ({suite.get('mode', '?')} mode)\n"]
    cost = _read(out, "costs")
    if cost:
        plot_costs(cost["presets"], os.path.join(out, "costs.png"))
        tables += [
            "## Cost per leaf (derived from the spec, and measured while running)\n",
            costs.cost_table(cost["presets"]),
            "\n### Relative to grpo\n",
            costs.ratio_table(cost["presets"]),
            "",
        ]
    times = _read(out, "time_per_iteration")
    if times:
        presets = times["presets"]
        training.plot_times(presets, os.path.join(out, "time_per_iteration.png"))
        n = next(iter(presets.values()))["time_iteration"]["n"]
        tables += [
            f"## Time per iteration ({times['prompts']} prompts x {times['leaves_per_prompt']} "
            f"leaves, {n} interleaved iterations per preset)\n",
            training.time_table(
                presets, times["prompts"] * times["leaves_per_prompt"], (cost or {}).get("presets")
            ),
            "",
        ]
    overhead = suite.get("counting_callback_overhead")
    if overhead:
        tables += [
            "Row-counting callback: the grpo rollout with it against without it, paired ratio "
            f"{fmt_stats(overhead['ratio'])} (median [min, max]).\n"
        ]
    reward = _read(out, "reward_vs_time")
    if reward:
        budget, curves = reward["budget_s"], reward["curves"]
        for key in ("time", "images"):
            training.plot_rewards(curves, budget, key, os.path.join(out, f"reward_vs_{key}.png"))
        tables += [
            f"## Reward vs wall-clock ({budget:.0f} s of training per preset and seed, "
            f"{len(reward['seeds'])} seed(s))\n",
            training.reward_table(training.time_to_reward(curves, budget)),
            "",
        ]
    engine = _read(out, "engine_vs_node_loop")
    if engine:
        plot_engine(engine["trees"], os.path.join(out, "engine_vs_node_loop.png"))
        tables += [
            f"## Batched engine vs node-at-a-time loop ({engine['prompts']} prompts, "
            f"{engine['steps']} steps, guidance {engine['guidance_scale']})\n",
            node_loop.table(engine["trees"]),
            "",
        ]
    if suite.get("wall_s"):
        rows = [[k, f"{v:.0f}"] for k, v in suite["wall_s"].items()]
        tables += ["## Wall time of this run\n", markdown_table(["stage", "seconds"], rows), ""]
    text = "\n".join(tables) + "\n"
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        report(args.replot)
        log(f"[suite] tables and plots rebuilt in {args.replot}")
        return {}
    name, mode = resolve(args)
    # Smoke results check the code, not the speed: they stay out of the results folder.
    smoke_dir = os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks", "smoke")
    out = args.out or {"full": default_out("run"), "smoke": smoke_dir}.get(
        name, os.path.join(default_out("run"), name)
    )
    os.makedirs(out, exist_ok=True)
    for stale in ("costs", "time_per_iteration", "reward_vs_time", "engine_vs_node_loop"):
        if os.path.exists(os.path.join(out, f"{stale}.json")):
            os.remove(os.path.join(out, f"{stale}.json"))
    settings = Settings(
        model=mode["model"],
        learning_rate=args.lr or Settings.learning_rate,
        one_update_per_iteration=not args.update_per_minibatch,
    )
    stages = {s.strip() for s in args.stages.split(",")} | {"costs"}
    start = time.perf_counter()
    walls, results = {}, {}
    log(f"[suite] {name} mode -> {out}; presets {', '.join(mode['presets'])}")

    def clock(stage, since):
        walls[f"{stage}_s"] = time.perf_counter() - since

    rng = smoke_rng() if name == "smoke" else contextlib.nullcontext()
    with rng, tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        runs, counter = training.setup_presets(mode["presets"], settings, workdir)
        results["costs"] = stage_costs(runs, counter, out)
        clock("costs_and_compile", t0)
        if "time" in stages:
            t0 = time.perf_counter()
            stage_time(runs, settings, mode, out, results["costs"])
            clock("time_per_iteration", t0)
        if mode["overhead_reps"]:
            results["overhead"] = callback_overhead(runs, settings, mode["overhead_reps"])
            log(f"[time] row-counting callback, grpo rollout: {results['overhead']['ratio']}")
        if "reward" in stages:
            t0 = time.perf_counter()
            stage_reward(runs, mode, out)
            clock("reward_vs_time", t0)
        if "engine" in stages:
            t0 = time.perf_counter()
            results["engine"] = stage_engine(settings, mode, out)
            clock("engine_vs_loop", t0)

    walls["total_s"] = time.perf_counter() - start
    info = {
        "mode": name,
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": dataclasses.asdict(settings),
        "mode_settings": mode,
        "stages": sorted(stages),
        "presets": {p: LABELS[p] for p in mode["presets"]},
        "machine": machine(),
        "wall_s": walls,
        "counting_callback_overhead": results.get("overhead"),
        "all_counts_match": all(r["all_match"] for r in results["costs"].values()),
        "same_leaves": all(r["same_leaves"] for r in results.get("engine", {}).values()),
    }
    save_json(out, "suite", info)
    report(out)
    log(f"[suite] done in {walls['total_s']:.0f} s; results in {out}")
    return info


if __name__ == "__main__":
    main()
