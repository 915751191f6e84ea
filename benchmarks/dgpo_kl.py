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
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import _plain, default_out, machine, pyplot, smoke_rng
from benchmarks.presets import Settings, load_model
from benchmarks.tree_study import config_of
from tree_grpo_jax.core.loss import LossInputs
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.run import compile_cache, scoring
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


def step_drift(trainer, config, model, rows, cond):
    """f(params, initial) -> [num_steps]: the mean squared gap between the velocities of
    `params` and of `initial` on fixed samples (`rows`' first group of each prompt, from the
    initial model) noised to each sampler step's sigma with fixed noise: where the weights
    have moved in what the flow predicts, step by step (the DGPO and KL terms see only the
    first dgpo.trunc_steps + 1 steps)."""
    from tree_grpo_jax.run import denoiser

    denoise = denoiser.training_denoise(model, config, trainer.mesh)
    schedule = trainer.schedule()
    x0 = jnp.asarray(rows.x0[:, 0])  # [R, *S]
    eps = jax.random.normal(jax.random.PRNGKey(7), x0.shape, x0.dtype)
    row_cond = jnp.asarray(cond)[jnp.asarray(rows.prompt)]
    shape = (-1, *([1] * (x0.ndim - 1)))

    @jax.jit
    def gap(params, initial, sigma):
        s = jnp.full((x0.shape[0],), sigma)
        xt = (1 - s.reshape(shape)) * x0 + s.reshape(shape) * eps
        t = s * schedule.timestep_scale
        v, v0 = denoise(params, xt, t, row_cond), denoise(initial, xt, t, row_cond)
        return jnp.mean((v.astype(jnp.float32) - v0.astype(jnp.float32)) ** 2)

    sigmas = np.asarray(schedule.sigmas)[: config.sampling.num_steps]
    return lambda params, initial: [float(gap(params, initial, s)) for s in sigmas]


def train_run(config, model, workdir: str, seed: int, iterations: int, log, every=1) -> dict:
    trainer, state = train.setup(config, workdir, model=model)
    trainer = trainer.reseed(seed)
    initial_params = jax.tree.map(jnp.copy, state.params)
    initial = _flat(initial_params)
    rows, cond = one_batch(trainer.reseed(10_000 + seed), state, 0)
    drift = step_drift(trainer, config, model, rows, cond)
    curve = []

    def point(params, iteration, metrics):
        evaluated = trainer.evaluator.evaluate(params)[0]
        flat = _flat(params)
        entry = {"iteration": iteration, "reward": float(evaluated["reward_mean"])}
        entry["distance"] = float(np.linalg.norm(flat - initial))
        entry["step_drift"] = drift(params, initial_params)
        entry.update({k: float(metrics[k]) for k in LOSS_METRICS if k in metrics})
        return entry, flat

    entry, before = point(state.params, 0, {})
    curve.append(entry)
    for iteration in range(iterations):
        state, metrics = trainer.iteration(state, iteration)
        if (iteration + 1) % every and iteration + 1 != iterations:
            continue
        entry, after = point(state.params, iteration + 1, metrics)
        # the last iterations' update against the way back to the initial weights
        entry["update_cos_home"] = _cos(after - before, initial - before)
        before = after
        curve.append(entry)
        trained = config.dgpo.trunc_steps + 1
        d = entry["step_drift"]
        log(
            f"  {config.name} seed {seed} it {iteration + 1}: reward {entry['reward']:.4f} "
            f"kl {entry.get('kl', 0):.3g} w {entry.get('group_weight', 0):.3f} "
            f"clip {entry.get('clip_fraction', 0):.2f} |d| {entry['distance']:.3g} "
            f"cos_home {entry['update_cos_home']:+.2f} drift trained "
            f"{np.mean(d[:trained]):.3g} untrained {np.mean(d[trained:]):.3g} "
            f"[{' '.join(f'{x:.2g}' for x in d)}]"
        )
    return {"seed": seed, "curve": curve}


def summary_line(name: str, run: dict) -> str:
    rewards = [p["reward"] for p in run["curve"]]
    peak = int(np.argmax(rewards))
    return (
        f"{name} seed {run['seed']}: start {rewards[0]:.4f}, peak {rewards[peak]:.4f} "
        f"(iteration {run['curve'][peak]['iteration']}), end {rewards[-1]:.4f}"
    )


# ---------------------------------------------------------------------------------------------
# One batch: the KL term as the package computes it, beside the release's form in float64.


def one_batch(trainer, state, iteration: int):
    """(rows, cond) of one iteration's rollout from `state`, drawn as `Trainer.iteration`
    draws them (no update)."""
    rollout_key, shuffle_key = jax.random.split(jax.random.fold_in(trainer.key, iteration))
    prompts = trainer.host_state.prompts.next_global_batch()
    sampled = trainer.rollout(
        trainer.sampling_params(state, iteration), prompts, rollout_key, iteration
    )
    leaves = sampled.tree.leaves
    num_prompts, num_leaves = leaves.shape[:2]
    images = trainer.model.decode(leaves.reshape(num_prompts * num_leaves, *leaves.shape[2:]))
    leaf_prompts = [p for p in sampled.prompts[sampled.rows] for _ in range(num_leaves)]
    metadata = trainer.prompt_metadata(prompts, sampled.rows, num_leaves)
    decoded = scoring.Decoded((images,), groups=1)  # one part: scored whole
    where = "in the batch check"
    rewards = scoring.score(trainer.reward, decoded, leaf_prompts, where, metadata)[0]
    rows_key = jax.random.split(shuffle_key)[0]
    rows = trainer.trainable_rows(
        sampled, rewards.reshape(num_prompts, num_leaves), iteration, rows_key
    )
    return jax.tree.map(jnp.asarray, rows), sampled.cond


def release_velocity_gradient(v, v_init, v_ema, target, advantage, mask, c) -> tuple:
    """The release's loss (compute_group_dgpo_loss_allreduce, its DSM clip against the EMA
    copy and `train.beta * mean((v - v_ref)^2)` against the initial model) and its gradient
    in the velocity, sample by sample in float64: (loss, dL/dv, the KL term's share of it).
    v*, target: [R, G, D]; advantage, mask: [R, G]; c: the run's config."""
    d = c.dgpo
    v, v_init, v_ema, target = (np.asarray(x, np.float64) for x in (v, v_init, v_ema, target))
    a = np.asarray(advantage, np.float64)
    n = int(np.sum(mask))
    size = v.shape[-1]
    dsm = np.mean((target - v) ** 2, axis=-1)
    dsm_ema = np.mean((target - v_ema) ** 2, axis=-1)
    ref = dsm_ema if d.reference == "ema" else np.mean((target - v_init) ** 2, axis=-1)
    ratio = np.exp(dsm_ema - dsm)
    clip = np.where(a > 0, ratio > 1 + d.clip_range, ratio < 1 - d.clip_range) & d.clip_dsm
    loss, grad, grad_kl = 0.0, np.zeros_like(v), np.zeros_like(v)
    beta = float(c.train.kl_beta)
    for r in range(v.shape[0]):
        real = [g for g in range(v.shape[1]) if mask[r, g]]
        group_sum = sum(a[r, g] * d.beta_dpo * (dsm[r, g] - ref[r, g]) for g in real)
        w = 1.0 / (1.0 + np.exp(-group_sum / c.tree.group_size))
        for g in real:
            kl = np.mean((v[r, g] - v_init[r, g]) ** 2)
            loss += (w * a[r, g] * dsm[r, g] + beta * kl) / n
            grad_kl[r, g] = beta * 2.0 * (v[r, g] - v_init[r, g]) / size / n
            held = 0.0 if clip[r, g] else 1.0
            grad[r, g] = held * w * a[r, g] * -2.0 * (target[r, g] - v[r, g]) / size / n
    return loss, grad + grad_kl, grad_kl


def _adam_nu(opt_state):
    """The second moments of the state's Adam (the run's preconditioner)."""
    import optax

    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(x, optax.ScaleByAdamState)
    ]
    return found[0].nu


def batch_check(config, model, workdir: str, seed: int, warm: int, log) -> dict:
    """`warm` iterations of the run, then one batch: the package's loss and gradient split
    into the DGPO term's and the KL term's, beside the release's form from the velocities."""
    from tree_grpo_jax.run import denoiser

    trainer, state = train.setup(config, workdir, model=model)
    trainer = trainer.reseed(seed)
    # a run without the KL or the initial reference keeps no copy: take one before training
    initial = trainer.ref_params
    if initial is None:
        initial = jax.tree.map(jnp.copy, state.params)
    for iteration in range(warm):
        state, _ = trainer.iteration(state, iteration)
    rows, cond = one_batch(trainer, state, warm)
    loss_fn, settings = trainer.method.objective.loss(
        config, denoiser.training_denoise(model, config, trainer.mesh)
    )
    schedule = trainer.schedule()
    inputs = LossInputs(schedule, cond, ref_params=initial, old_params=state.old_params)

    def loss_of(params, s):
        return loss_fn(params, rows, s, inputs)

    no_kl = dataclasses.replace(settings, kl_beta=0.0)
    (loss, metrics), g_total = jax.value_and_grad(loss_of, has_aux=True)(state.params, settings)
    g_dgpo = jax.grad(lambda p: loss_of(p, no_kl)[0])(state.params)

    # the gradient in the velocity: a zero offset added to the trained velocity
    base = settings.denoise_fn
    rows_n, group = rows.x0.shape[:2]
    offset0 = jnp.zeros((rows_n * group, *rows.x0.shape[2:]), jnp.float32)

    def offset_denoise(p, x, t, c):
        return base(p["model"], x, t, c) + p["offset"]

    aug = dataclasses.replace(settings, denoise_fn=offset_denoise)

    def with_offset(params, offset):
        return {"model": params, "offset": offset}

    def loss_in_v(offset):
        return loss_fn(
            with_offset(state.params, offset),
            rows,
            aug,
            inputs.replace(
                old_params=with_offset(state.old_params, offset0),
                ref_params=with_offset(initial, offset0),
            ),
        )[0]

    dl_dv = np.asarray(jax.grad(loss_in_v)(offset0), np.float64).reshape(rows_n, group, -1)
    # the velocities, as the release computes them (the model's own forwards)
    sig = jnp.repeat(schedule.sigmas[rows.step], group).reshape(-1, *([1] * (rows.x0.ndim - 2)))
    x0 = rows.x0.reshape(rows_n * group, *rows.x0.shape[2:])
    eps = rows.noise.reshape(x0.shape)
    xt = (1 - sig) * x0 + sig * eps
    t = sig.reshape(-1) * schedule.timestep_scale
    row_cond = jnp.repeat(cond[rows.prompt], group, axis=0)

    def vel(p):
        return np.asarray(base(p, xt, t, row_cond), np.float64).reshape(rows_n, group, -1)

    v, v_init, v_ema = vel(state.params), vel(initial), vel(state.old_params)
    target = np.asarray(eps - x0, np.float64).reshape(rows_n, group, -1)
    mask = np.asarray(rows.mask, bool)
    ref_loss, ref_grad, ref_grad_kl = release_velocity_gradient(
        v, v_init, v_ema, target, np.asarray(rows.advantage), mask, config
    )
    real = mask[..., None]
    grad_err = float(np.max(np.abs(dl_dv - ref_grad) * real) / np.max(np.abs(ref_grad)))

    flat = {k: _flat(x) for k, x in (("total", g_total), ("dgpo", g_dgpo))}
    flat["kl"] = flat["total"] - flat["dgpo"]
    theta, theta0 = _flat(state.params), _flat(initial)
    home = theta0 - theta
    nu = np.sqrt(_flat(_adam_nu(state.opt_state))) + float(config.train.adam_eps)
    out = {
        "warm_iterations": warm,
        "loss": float(loss),
        "release_loss": float(ref_loss),
        "kl": float(metrics["kl"]),
        "release_kl": float(np.sum(((v - v_init) ** 2).mean(-1) * mask) / mask.sum()),
        "velocity_gradient_max_rel_error": grad_err,
        "kl_share_of_velocity_gradient": float(
            np.linalg.norm(ref_grad_kl) / np.linalg.norm(ref_grad)
        ),
        "distance": float(np.linalg.norm(home)),
        "norm_dgpo": float(np.linalg.norm(flat["dgpo"])),
        "norm_kl": float(np.linalg.norm(flat["kl"])),
        "cos_dgpo_kl": _cos(flat["dgpo"], flat["kl"]),
        # a descent step is -g: its cosine with the way home
        "cos_kl_step_home": _cos(-flat["kl"], home),
        "cos_dgpo_step_home": _cos(-flat["dgpo"], home),
        "adam_norm_dgpo": float(np.linalg.norm(flat["dgpo"] / nu)),
        "adam_norm_kl": float(np.linalg.norm(flat["kl"] / nu)),
        "adam_cos_kl_step_home": _cos(-flat["kl"] / nu, home),
        "group_weight": float(metrics["group_weight"]),
        "clip_fraction": float(metrics["clip_fraction"]),
    }
    log("  " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()))
    return out


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
    p.add_argument("--reward", default=REWARD, help="the twin's reward (a JPEG reward)")
    p.add_argument("--every", type=int, default=1, help="evaluate every this many iterations")
    p.add_argument("--batch", action="store_true", help="the one-batch check, no curves")
    p.add_argument("--warm", default="0,4,8", help="--batch: iterations trained before it")
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
        reward=args.reward,
        num_steps=5 if args.smoke else 10,
        prompts=2 if args.smoke else 4,
        eval_count=10 if args.smoke else 50,
    )
    payload = {
        "command": "python -m benchmarks.dgpo_kl "
        + " ".join(sys.argv[1:] if argv is None else argv),
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
        if args.batch:
            payload["batch"] = {n: [] for n in names}
            for name in names:
                for warm in (int(w) for w in args.warm.split(",")):
                    config = run_config(name, settings)
                    print(f"[batch] {name} seed {seeds[0]} after {warm} iterations", flush=True)
                    check = batch_check(config, model, workdir, seeds[0], warm, print)
                    payload["batch"][name].append(check)
                    with open(os.path.join(out, "dgpo_kl_batch.json"), "w") as f:
                        json.dump(_plain(payload), f, indent=1)
            return payload
        for seed in seeds:
            for name in names:
                run = train_run(
                    run_config(name, settings), model, workdir, seed, iterations, print, args.every
                )
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
