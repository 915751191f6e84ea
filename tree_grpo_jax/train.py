"""The training loop: prompts -> tree rollout -> rewards -> advantages -> PPO updates.

One iteration, in order:
  1. draw a prompt batch and encode it once;
  2. roll out the iteration's tree (the window of windowed methods slides with the count);
  3. decode the leaves and score them;
  4. turn leaf rewards into per-edge advantages (and pruning masks);
  5. gather the trainable edges into rows and run `inner_epochs` of shuffled minibatches
     through one jitted, sharded train step.
Evaluation (fixed prompts, fixed noise, deterministic sampler) and checkpoints run between
iterations. Every random draw comes from `fold_in(seed key, iteration)`, so a resumed run
draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax import advantages as adv
from tree_grpo_jax import config as cfg
from tree_grpo_jax import pruning, reporting, rollout, sharding, transitions
from tree_grpo_jax.checkpoint import Checkpointer, check_writable
from tree_grpo_jax.models import DTYPES, load_model
from tree_grpo_jax.models.base import TextToImageModel
from tree_grpo_jax.prompts import PromptIterator, load_prompts
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.train_step import TrainState, learning_rate, make_optimizer, make_train_step


class RewardError(RuntimeError):
    """Rewards that cannot be trained on (NaN or infinite); one sentence for the user."""


# ---------------------------------------------------------------------------------------------
# The run.


@dataclasses.dataclass
class Run:
    """Everything an iteration needs that does not change between iterations."""

    config: ml_collections.ConfigDict
    workdir: str
    model: TextToImageModel
    mesh: Any
    reward: Any
    eval_rewards: dict
    prompts: PromptIterator
    eval_prompts: list[str]
    uncond: jax.Array | None
    train_step: Any
    state_shardings: Any
    tracker: adv.PerPromptStatTracker | None
    ref_params: Any
    key: jax.Array

    @property
    def guidance(self) -> bool:
        return self.uncond is not None


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), tree)


def setup(config: ml_collections.ConfigDict, workdir: str) -> tuple[Run, TrainState]:
    """Builds the model, mesh, optimizer and state (fresh; `resume` may replace it)."""
    sharding.maybe_initialize_distributed()
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp)
    shards = sharding.num_batch_shards(mesh)
    if config.train.rows_per_minibatch % shards:
        raise cfg.ConfigError(
            f"train.rows_per_minibatch ({config.train.rows_per_minibatch}) must be a multiple "
            f"of the {shards} devices the batch is split over."
        )
    reward = reward_registry.combined_reward(cfg.parse_rewards(config.rewards))
    eval_rewards = {n: reward_registry.get_reward(n) for n in config.eval.extra_rewards}

    prompts = load_prompts(config.prompts.source)
    iterator = PromptIterator(
        prompts,
        config.prompts.batch_size,
        seed=config.seed,
        shard_index=jax.process_index(),
        num_shards=jax.process_count(),
    )
    eval_set = load_prompts(config.prompts.eval_source or config.prompts.source)
    eval_prompts = [eval_set[i % len(eval_set)] for i in range(config.prompts.eval_count)]
    model = load_model(config.model, seed=config.seed)

    guidance = config.sampling.guidance_scale != 1.0
    uncond = model.encode_prompts([""])[0] if guidance else None

    params = _cast(model.params, DTYPES[config.model.param_dtype])
    tx = make_optimizer(config.train)
    abstract = jax.eval_shape(lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)), params)
    state_shardings = sharding.param_shardings(mesh, abstract)
    state = jax.jit(
        lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)), out_shardings=state_shardings
    )(params)

    denoise = jax.checkpoint(model.denoise) if config.model.remat else model.denoise
    loss_kwargs = dict(
        denoise_fn=denoise,
        reduce=config.sampling.log_prob_reduce,
        guidance_scale=config.sampling.guidance_scale,
        clip_range=config.train.clip_range,
        adv_clip=config.advantage.clip,
        kl_beta=config.train.kl_beta,
    )
    tracker = None
    if config.advantage.stat_tracker and config.tree.method in ("grpo", "mixgrpo"):
        tracker = adv.PerPromptStatTracker(
            config.advantage.tracker_buffer, config.advantage.tracker_min_count
        )
    ref_params = (
        jax.tree_util.tree_map(jnp.copy, state.params) if config.train.kl_beta > 0 else None
    )
    run = Run(
        config=config,
        workdir=workdir,
        model=model,
        mesh=mesh,
        reward=reward,
        eval_rewards=eval_rewards,
        prompts=iterator,
        eval_prompts=eval_prompts,
        uncond=uncond,
        train_step=make_train_step(tx, loss_kwargs, mesh, state_shardings),
        state_shardings=state_shardings,
        tracker=tracker,
        ref_params=ref_params,
        key=jax.random.PRNGKey(config.seed),
    )
    return run, state


def make_schedule(run: Run, num_steps: int | None = None):
    s = run.config.sampling
    num_steps = num_steps or s.num_steps
    if run.model.schedule_kind == "flow":
        return run.model.make_schedule(num_steps, noise_level=s.noise_level, shift=s.shift)
    return run.model.make_schedule(num_steps, eta=s.eta)


def score(run: Run, images: jax.Array, prompts: list[str], where: str) -> tuple[np.ndarray, dict]:
    total, parts = run.reward(images, prompts, return_components=True)
    total = np.asarray(total, np.float64)
    bad = ~np.isfinite(total)
    if bad.any():
        raise RewardError(
            f"reward {run.reward.name} returned {int(bad.sum())} non-finite value(s) out of "
            f"{total.size} {where}; fix the reward (or its weights) before training on it."
        )
    return total, {n: np.asarray(v, np.float64) for n, v in parts.items()}


def iteration_step(run: Run, state: TrainState, iteration: int) -> tuple[TrainState, dict]:
    """One whole iteration; returns the new state and its metrics."""
    c = run.config
    timings = {}
    t0 = time.perf_counter()
    key = jax.random.fold_in(run.key, iteration)
    rollout_key, shuffle_key = jax.random.split(key)
    spec = cfg.build_spec(c, iteration)
    schedule = make_schedule(run)

    prompts = run.prompts.next_batch()
    cond = run.model.encode_prompts(prompts)
    tree = rollout.rollout(
        run.model.denoise,
        state.params,
        cond,
        rollout_key,
        schedule,
        spec=spec,
        sample_shape=run.model.sample_shape,
        uncond=run.uncond,
        guidance_scale=c.sampling.guidance_scale,
        reduce=c.sampling.log_prob_reduce,
    )
    jax.block_until_ready(tree.leaves)
    timings["time_rollout"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    num_prompts, num_leaves = tree.leaves.shape[:2]
    images = run.model.decode(
        tree.leaves.reshape(num_prompts * num_leaves, *run.model.sample_shape)
    )
    leaf_prompts = [p for p in prompts for _ in range(num_leaves)]
    rewards, parts = score(run, images, leaf_prompts, f"at iteration {iteration}")
    timings["time_reward"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    rewards = rewards.reshape(num_prompts, num_leaves)
    method_kwargs = {}
    if c.tree.method in ("grpo", "mixgrpo"):
        method_kwargs = dict(tracker=run.tracker, prompt_ids=prompts)
    elif c.tree.method in ("branchgrpo", "branchgrpo_mix"):
        method_kwargs = dict(fusion=c.advantage.fusion, alpha=c.advantage.fusion_alpha)
    advantages = adv.compute_advantages(
        c.tree.method,
        spec,
        tree,
        jnp.asarray(rewards, jnp.float32),
        clip=c.advantage.clip,
        **method_kwargs,
    )
    masks = edge_masks(c, spec, tree, advantages, iteration)
    rows = transitions.gather_transitions(tree, advantages, masks)

    step_metrics = []
    for epoch in range(c.train.inner_epochs):
        epoch_key = jax.random.fold_in(shuffle_key, epoch)
        for batch in transitions.minibatches(rows, epoch_key, c.train.rows_per_minibatch):
            batch = sharding.shard_batch(run.mesh, batch)
            state, metrics = run.train_step(
                state,
                batch,
                cond,
                schedule,
                run.uncond,
                run.ref_params,
                jnp.float32(learning_rate(c.train, iteration)),
            )
            step_metrics.append(metrics)
    step_metrics = jax.device_get(step_metrics)
    timings["time_update"] = time.perf_counter() - t2
    timings["time_iteration"] = time.perf_counter() - t0

    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        **{f"reward_{n}": float(v.mean()) for n, v in parts.items() if len(parts) > 1},
        "trained_edges": rows.num_edges,
        "train_rows": rows.num_rows,
        "minibatches": len(step_metrics),
        "learning_rate": learning_rate(c.train, iteration),
        "window_start": cfg.window_start(c, iteration),
        **timings,
    }
    if step_metrics:
        for name in ("loss", "approx_kl", "clip_fraction", "ratio_mean", "grad_norm", "kl"):
            if name in step_metrics[0]:
                metrics[name] = float(np.mean([m[name] for m in step_metrics]))
        metrics["ratio_min"] = float(np.min([m["ratio_min"] for m in step_metrics]))
        metrics["ratio_max"] = float(np.max([m["ratio_max"] for m in step_metrics]))
    return state, metrics


def edge_masks(c, spec, tree, advantages, iteration):
    """Pruning masks for BranchGRPO methods; None (train every edge) otherwise."""
    a = c.advantage
    if c.tree.method not in ("branchgrpo", "branchgrpo_mix"):
        return None
    masks = None
    if a.depth_pruning:
        masks = pruning.depth_pruning_mask(
            spec,
            tree,
            tuple(a.depth_pruning),
            iteration=iteration,
            slide_every=a.depth_pruning_slide_every or None,
            stop_depth=None if a.depth_pruning_stop < 0 else a.depth_pruning_stop,
        )
    if a.width_pruning != "none":
        width = pruning.width_pruning_mask(
            spec, tree, advantages, mode=a.width_pruning, ratio=a.width_pruning_ratio
        )
        masks = pruning.combine_masks(masks, width)
    return masks


# ---------------------------------------------------------------------------------------------
# Evaluation.


@functools.lru_cache(maxsize=8)
def _eval_noise(seed: int, count: int, sample_shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (count, *sample_shape)))


def evaluate(run: Run, params) -> tuple[dict, np.ndarray]:
    """Mean reward of fixed prompts from fixed noise with the deterministic sampler."""
    c = run.config
    schedule = make_schedule(run, c.eval.num_steps or None)
    prompts = run.eval_prompts
    noise = _eval_noise(c.eval.seed, len(prompts), run.model.sample_shape)
    samples = rollout.sample_deterministic(
        run.model.denoise,
        params,
        run.model.encode_prompts(prompts),
        jnp.asarray(noise),
        schedule,
        uncond=run.uncond,
        guidance_scale=c.sampling.guidance_scale,
    )
    images = np.asarray(run.model.decode(samples))
    total, parts = score(run, images, prompts, "in evaluation")
    metrics = {"reward_mean": float(total.mean()), "reward_std": float(total.std())}
    if len(parts) > 1:
        metrics.update({f"reward_{n}": float(v.mean()) for n, v in parts.items()})
    for name, reward in run.eval_rewards.items():
        metrics[name] = float(np.mean(np.asarray(reward(images, prompts))))
    return metrics, images


# ---------------------------------------------------------------------------------------------
# Resume and the loop.


def _meta(run: Run, next_iteration: int, history: dict) -> dict:
    return {
        "next_iteration": next_iteration,
        "seed": run.config.seed,
        "rng_key": np.asarray(jax.random.key_data(run.key)).tolist(),
        "window_start": cfg.window_start(run.config, next_iteration),
        "prompt_iterator": run.prompts.state_dict(),
        "stat_tracker": run.tracker.state_dict() if run.tracker else None,
        "history": history,
    }


def resume(run: Run, state: TrainState, ckpt: Checkpointer) -> tuple[TrainState, int, dict]:
    """Restores the latest checkpoint in the workdir; a fresh start if there is none."""
    if ckpt.latest_step is None:
        return state, 0, {"eval": [], "wall_time": 0.0}
    state, meta = ckpt.restore(state)
    run.prompts.load_state_dict(meta["prompt_iterator"])
    if run.tracker is not None and meta.get("stat_tracker"):
        run.tracker.load_state_dict(meta["stat_tracker"])
    return state, int(meta["next_iteration"]), meta["history"]


def save_eval(run: Run, iteration: int, params, history: dict, writer) -> dict:
    metrics, images = evaluate(run, params)
    path = os.path.join(run.workdir, f"eval_{iteration:05d}.png")
    reporting.save_grid(path, images, columns=min(10, len(images)))
    writer.write(iteration, metrics, prefix="eval/")
    history["eval"].append({"iteration": iteration, **metrics})
    if run.config.log.progress:
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        print(f"eval after {iteration} iterations: {shown} -> {path}", flush=True)
    return metrics


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) the configured training; returns the final summary."""
    cfg.validate(config, known_rewards=reward_registry.available_rewards())
    check_writable(workdir)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    run, state = setup(config, workdir)
    state, start, history = resume(run, state, ckpt)
    c = config
    total = c.train.iterations
    writer = reporting.MetricsWriter(workdir, c.log.tensorboard, c.log.wandb_project)
    progress = reporting.Progress(total, start, c.log.progress)
    spec = cfg.build_spec(c, 0)
    if c.log.progress:
        print(
            f"{spec.describe()} | {c.prompts.batch_size} prompts x {spec.leaves} leaves | "
            f"model {run.model.name} | mesh {dict(run.mesh.shape)} | workdir {workdir}",
            flush=True,
        )
        if start:
            print(f"resumed from the checkpoint after iteration {start}", flush=True)
    if start == 0 and not history["eval"]:
        save_eval(run, 0, state.params, history, writer)

    wall_start = time.time() - history.get("wall_time", 0.0)
    iteration = start
    try:
        for iteration in range(start, total):
            state, metrics = iteration_step(run, state, iteration)
            writer.write(iteration + 1, metrics, prefix="train/")
            shown = {
                k: metrics[k]
                for k in ("reward_mean", "loss", "approx_kl", "clip_fraction")
                if k in metrics
            }
            progress.update(iteration, metrics["time_iteration"], shown)
            done = iteration + 1
            if c.eval.every and done % c.eval.every == 0 and done != total:
                save_eval(run, done, state.params, history, writer)
            if c.checkpoint.every and done % c.checkpoint.every == 0 and done != total:
                history["wall_time"] = time.time() - wall_start
                ckpt.save(done, state, _meta(run, done, history))
            iteration = done
    except (KeyboardInterrupt, RewardError):
        # Keep everything trained so far: the state holds `iteration` finished iterations.
        history["wall_time"] = time.time() - wall_start
        if iteration > start:
            ckpt.save(iteration, state, _meta(run, iteration, history))
        ckpt.close()
        writer.close()
        raise

    save_eval(run, total, state.params, history, writer)
    history["wall_time"] = time.time() - wall_start
    ckpt.save(total, state, _meta(run, total, history))
    ckpt.close()
    writer.close()
    return summarize(run, spec, history, workdir)


def summarize(run: Run, spec, history: dict, workdir: str) -> dict:
    evals = history["eval"]
    steps = [e["iteration"] for e in evals]
    rewards = [e["reward_mean"] for e in evals]
    curve = reporting.save_curve(
        os.path.join(workdir, "eval_reward.png"), steps, rewards, "eval reward", run.config.name
    )
    summary = {
        "first_eval_reward": rewards[0],
        "last_eval_reward": rewards[-1],
        "wall_time_s": history["wall_time"],
        "rollout_denoiser_calls_per_leaf": spec.rollout_denoiser_calls(run.guidance) / spec.leaves,
        "first_grid": os.path.join(workdir, f"eval_{steps[0]:05d}.png"),
        "last_grid": os.path.join(workdir, f"eval_{steps[-1]:05d}.png"),
        "reward_curve": curve,
        "evals": evals,
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
