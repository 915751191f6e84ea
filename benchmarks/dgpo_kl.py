"""DGPO with a KL term on the flow twin: where the reward goes, and why.

    python -m benchmarks.dgpo_kl --runs ema,ema_kl --seeds 0 --iterations 24
    python -m benchmarks.dgpo_kl --batch              # the KL term on one batch (no training)
    python -m benchmarks.dgpo_kl --smoke --out /tmp/dgpo_kl   # 2 iterations, 5 steps, 2 prompts

Every run is `benchmarks.tree_study`'s "dgpo_lr3e-4" setting (the flow twin, 4 prompts x 16
samples per iteration, 10 steps, one optimizer update per iteration, lr 3e-4, 4 rows per
minibatch) with the overrides of `RUNS`. After every iteration it evaluates the reward on
the fixed prompts and noises and records the loss's metrics and where the weights are:
their distance from the initial weights, and the cosine between the iteration's update and
the way back to them (negative: the update leads away from the start).

`--batch` takes one iteration's rows of a run at its peak and splits the gradient into the
DGPO term's and the KL term's: their norms, the cosine between them and between each and the
way back to the initial weights, and the KL term in float64 numpy from the velocities (the
release's `beta * mean((v - v_ref)^2)`) beside the package's value.

Results: `<out>/dgpo_kl.json` (written after every run) and `<out>/dgpo_kl.png`; `<out>`
is `runs/benchmarks/dgpo_kl` unless --out is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import training
from benchmarks.common import _plain, default_out, machine, pyplot, smoke_rng
from benchmarks.presets import Settings, load_model
from benchmarks.tree_study import config_of
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.run import compile_cache
from tree_grpo_jax.run import loop as train

# overrides of tree_study's "dgpo_lr3e-4" (which has the initial model as reference, KL 0.02)
RUNS = {
    "initial_kl": {},
    "ema": {"dgpo.reference": "ema", "train.kl_beta": 0.0},
    "ema_kl": {"dgpo.reference": "ema", "train.kl_beta": 0.02},
}
REWARD = "jpeg_compressibility"


def run_config(name: str, settings: Settings):
    c = config_of("dgpo_lr3e-4", settings)
    c.name = f"dgpo_kl_{name}"
    for path, value in RUNS[name].items():
        section, field = path.split(".")
        c[section][field] = value
    return c


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0


LOSS_METRICS = ("policy_loss", "kl", "dsm", "dsm_gap", "group_weight", "clip_fraction", "loss")


def train_run(config, model, workdir: str, seed: int, iterations: int, log) -> dict:
    trainer, state = train.setup(config, workdir, model=model)
    trainer = trainer.reseed(seed)
    initial = _flat(state.params)
    curve = []

    def point(params, iteration, metrics):
        reward = float(trainer.evaluate(params)[0]["reward_mean"])
        flat = _flat(params)
        entry = {"iteration": iteration, "reward": reward}
        entry["distance"] = float(np.linalg.norm(flat - initial))
        entry.update({k: float(metrics[k]) for k in LOSS_METRICS if k in metrics})
        return entry, flat

    entry, before = point(state.params, 0, {})
    curve.append(entry)
    for iteration in range(iterations):
        state, metrics = trainer.iteration(state, iteration)
        entry, after = point(state.params, iteration + 1, metrics)
        # the update against the way back to the initial weights
        entry["update_cos_home"] = _cos(after - before, initial - before)
        before = after
        curve.append(entry)
        log(
            f"  {config.name} seed {seed} it {iteration + 1}: reward {entry['reward']:.4f} "
            f"kl {entry.get('kl', 0):.3g} dsm_gap {entry.get('dsm_gap', 0):.3g} "
            f"w {entry.get('group_weight', 0):.3f} clip {entry.get('clip_fraction', 0):.2f} "
            f"|d| {entry['distance']:.3g} cos_home {entry['update_cos_home']:+.2f}"
        )
    return {"seed": seed, "curve": curve}


def summary_line(name: str, run: dict) -> str:
    rewards = [p["reward"] for p in run["curve"]]
    peak = int(np.argmax(rewards))
    return (
        f"{name} seed {run['seed']}: start {rewards[0]:.4f}, peak {rewards[peak]:.4f} "
        f"(iteration {peak}), end {rewards[-1]:.4f}"
    )


def plot(payload: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, (name, runs) in enumerate(payload["runs"].items()):
        for run in runs:
            c = run["curve"]
            it = [p["iteration"] for p in c]
            kw = dict(color=f"C{i}", alpha=0.8, label=f"{name} s{run['seed']}")
            axes[0].plot(it, [p["reward"] for p in c], **kw)
            axes[1].plot(it, [p["distance"] for p in c], **kw)
            axes[2].plot(it[1:], [p["update_cos_home"] for p in c[1:]], **kw)
    for ax, title in zip(
        axes,
        ("eval reward", "|params - initial|", "cos(update, initial - params)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default="ema,ema_kl", help=f"comma-separated, of {tuple(RUNS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--smoke", action="store_true", help="a small run; checks the code")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = tuple(n.strip() for n in args.runs.split(","))
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}.")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    iterations = 2 if args.smoke else args.iterations
    smoke_dir = os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks", "dgpo_kl_smoke")
    out = args.out or (smoke_dir if args.smoke else default_out("dgpo_kl"))
    os.makedirs(out, exist_ok=True)
    if not args.smoke:
        compile_cache.enable()
    settings = Settings(
        model="tiny_flow",
        reward=REWARD,
        num_steps=5 if args.smoke else 10,
        prompts=2 if args.smoke else 4,
        eval_count=10 if args.smoke else 50,
    )
    payload = {
        "command": "python -m benchmarks.dgpo_kl " + " ".join(argv or []),
        "machine": machine(),
        "reward": settings.reward,
        "iterations": iterations,
        "overrides": {n: RUNS[n] for n in names},
        "runs": {n: [] for n in names},
    }
    start = time.perf_counter()
    rng = smoke_rng() if args.smoke else contextlib.nullcontext()
    with rng, tempfile.TemporaryDirectory() as workdir:
        model = load_model(settings)
        for seed in seeds:
            for name in names:
                run = train_run(run_config(name, settings), model, workdir, seed, iterations, print)
                payload["runs"][name].append(run)
                print(summary_line(name, run), flush=True)
                payload["elapsed_s"] = time.perf_counter() - start
                with open(os.path.join(out, "dgpo_kl.json"), "w") as f:
                    json.dump(_plain(payload), f, separators=(",", ":"))
                    f.write("\n")
    plot(payload, os.path.join(out, "dgpo_kl.png"))
    for name, runs in payload["runs"].items():
        for run in runs:
            print(summary_line(name, run))
    print(f"wrote {out}/dgpo_kl.* in {time.perf_counter() - start:.0f} s")
    return payload


if __name__ == "__main__":
    main()
