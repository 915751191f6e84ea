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

`setup(config, workdir, model=None)` gives a `Trainer` and its initial state; the trainer's
methods (`rollout`, `update`, `iteration`, `evaluate`, `reseed`) are the seam that the loop
below and the benchmarks use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax.traverse_util import flatten_dict

from tree_grpo_jax import advantages as adv
from tree_grpo_jax import config as cfg
from tree_grpo_jax import lora, methods, pruning, reporting, rollout, sharding, transitions
from tree_grpo_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    check_writable,
    fingerprint_mismatch,
)
from tree_grpo_jax.models import DTYPES, load_model
from tree_grpo_jax.models.base import ModelLoadError, TextToImageModel, cast_floats
from tree_grpo_jax.prompts import PromptIterator, load_prompts
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.train_step import TrainState, learning_rate, make_optimizer, make_train_step
from tree_grpo_jax.workdir import WorkdirBusy, WorkdirLock


class RewardError(RuntimeError):
    """Rewards that cannot be trained on (NaN or infinite); one sentence for the user."""


class DivergenceError(RuntimeError):
    """Training produced non-finite numbers; the last checkpoint is kept as it was."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One iteration's sampled trees with what produced them.

    `prompts` and `cond` are the global batch (every process's prompts, in process order);
    `tree` holds this process's `rows` of it (all of them with one process).
    """

    prompts: list[str]
    cond: jax.Array  # [P, L, D]
    spec: Any  # the TreeSpec rolled out (a windowed method's family)
    window_start: int  # the family's window position in this rollout
    tree: rollout.Tree  # this process's rows
    rows: slice  # which rows of the global batch `tree` holds


@dataclasses.dataclass(frozen=True)
class _TrackerRows:
    """The stat tracker as one process's advantages see it: updated with the whole batch,
    so every process keeps the same statistics, and answering this process's rows."""

    tracker: adv.PerPromptStatTracker
    prompts: list[str]  # the global batch
    rewards: np.ndarray  # [P, L], the global batch
    rows: slice

    def update(self, prompt_ids, rewards) -> np.ndarray:
        del prompt_ids, rewards  # this process's part of the global values held here
        return self.tracker.update(self.prompts, self.rewards)[self.rows]


def _local_tree(tree: rollout.Tree, rows: slice) -> rollout.Tree:
    """This process's prompt rows of a tree rolled out over every process's devices."""
    segments = tuple(
        seg.replace(
            parents=sharding.local_rows(seg.parents, rows, axis=1),
            children=sharding.local_rows(seg.children, rows, axis=1),
            log_probs=sharding.local_rows(seg.log_probs, rows, axis=1),
            steps=sharding.to_host(seg.steps),
            active=sharding.to_host(seg.active),
        )
        for seg in tree.segments
    )
    return tree.replace(segments=segments, leaves=sharding.local_rows(tree.leaves, rows))


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """LoRA: the trainer's params are low-rank factors on these frozen base weights."""

    base: Any  # the model's denoiser weights, on the mesh, never updated
    paths: tuple  # the adapted kernels
    rank: int
    alpha: float
    base_fingerprint: str  # a checksum of `base`: a resume must find the same weights

    def merged(self, factors):
        return _merge(self.base, factors, self.alpha, self.rank)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _merge(base, factors, alpha, rank):
    return lora.merge(base, factors, alpha, rank)


def weights_fingerprint(params) -> str:
    """A cheap checksum of a params tree: its paths, shapes and a few sums per leaf."""
    digest = hashlib.sha256()
    for path, leaf in sorted(flatten_dict(jax.device_get(params)).items()):
        x = np.asarray(leaf, np.float64)
        digest.update("/".join(map(str, path)).encode())
        digest.update(str(x.shape).encode())
        digest.update(
            np.asarray(
                [x.sum(), np.abs(x).sum(), x.ravel()[:: max(1, x.size // 7)].sum()]
            ).tobytes()
        )
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# The trainer.


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """Everything an iteration needs that does not change between iterations.

    Mutable parts (the prompt iterator's position, the stat tracker) belong to one trainer;
    `reseed` gives a trainer with its own, sharing the model and the compiled step.
    """

    config: ml_collections.ConfigDict
    workdir: str
    model: TextToImageModel
    mesh: Any
    method: methods.Method
    reward: Any
    eval_rewards: dict
    prompts: PromptIterator
    eval_prompts: list[str]
    uncond: jax.Array | None
    train_step: Any
    init_state: Any  # params -> a fresh TrainState, laid out on the mesh
    tracker: adv.PerPromptStatTracker | None
    ref_params: Any
    key: jax.Array
    adapter: Adapter | None = None  # LoRA: the frozen base the trained factors adapt

    @property
    def guidance(self) -> bool:
        return self.uncond is not None

    def model_params(self, params):
        """The denoiser's weights for the trained `params` (LoRA: the base, factors merged)."""
        return params if self.adapter is None else self.adapter.merged(params)

    def _step_args(self) -> tuple:
        return () if self.adapter is None else (self.adapter.base,)

    # -- pieces of an iteration ------------------------------------------------------------
    def spec(self):
        """The run's tree spec, the same at every iteration (windowed methods: a family)."""
        return methods.build_spec(self.config)

    def window_start(self, iteration: int) -> int:
        return methods.window_start(self.config, iteration)

    def schedule(self, num_steps: int | None = None):
        s = self.config.sampling
        return self.model.make_schedule(num_steps or s.num_steps, s)

    def rollout(
        self, params, prompts: Sequence[str], key: jax.Array, iteration: int = 0
    ) -> Rollout:
        """The iteration's trees for the global batch `prompts` from `params` (no gradient,
        no update). With several processes each encodes, and keeps, its own rows."""
        c = self.config
        prompts = list(prompts)
        rows = sharding.process_rows(len(prompts))
        cond = self.model.encode_prompts(prompts[rows])
        if sharding.multi_process():
            cond = sharding.global_batch(self.mesh, cond)
        spec = self.spec()
        start = self.window_start(iteration)
        tree = rollout.rollout(
            self.model.denoise,
            self.model_params(params),
            cond,
            key,
            self.schedule(),
            spec=spec,
            sample_shape=self.model.sample_shape,
            uncond=self.uncond,
            guidance_scale=c.sampling.guidance_scale,
            reduce=c.sampling.log_prob_reduce,
            window_start=jnp.int32(start),  # data: one compiled rollout for every position
            split_log_prob=c.tree.split_log_prob,
        )
        if sharding.multi_process():
            tree = _local_tree(tree, rows)
            cond = sharding.replicate(self.mesh, cond)  # every row may meet any prompt
        return Rollout(prompts, cond, spec, start, tree, rows)

    def score(self, images, prompts: list[str], where: str) -> tuple[np.ndarray, dict]:
        """Rewards of this process's images, then every process's, in process order: all
        processes check, log and normalise the same values."""
        total, parts = self.reward(images, prompts, return_components=True)
        total = sharding.gather(np.asarray(total, np.float64))
        parts = {n: sharding.gather(np.asarray(v, np.float64)) for n, v in parts.items()}
        bad = ~np.isfinite(total)
        if bad.any():
            raise RewardError(
                f"reward {self.reward.name} returned {int(bad.sum())} non-finite value(s) out "
                f"of {total.size} {where}; fix the reward (or its weights) before training on it."
            )
        return total, parts

    def trainable_rows(
        self, sampled: Rollout, rewards, iteration: int = 0
    ) -> transitions.Transitions:
        """This process's trainable edges of a rollout as rows, with their advantages
        (rewards [P, L] of the global batch); updates the stat tracker when the method uses
        one. A row's `prompt` indexes the global batch (`sampled.cond`)."""
        c = self.config
        rewards = np.asarray(rewards, np.float32)
        tracker = self.tracker
        if tracker is not None:
            tracker = _TrackerRows(tracker, sampled.prompts, rewards, sampled.rows)
        advantages = methods.compute_advantages(
            c,
            sampled.spec,
            sampled.tree,
            jnp.asarray(rewards[sampled.rows]),
            prompt_ids=sampled.prompts[sampled.rows],
            tracker=tracker,
        )
        masks = edge_masks(c, self.method, sampled, advantages, iteration)
        rows = transitions.gather_transitions(sampled.tree, advantages, masks)
        return rows.replace(prompt=rows.prompt + np.int32(sampled.rows.start))

    def update(
        self, state: TrainState, sampled: Rollout, rewards, iteration: int, key: jax.Array
    ) -> tuple[TrainState, dict]:
        """Advantages, pruning and every minibatch step of one iteration's rollout."""
        c = self.config
        rows = self.trainable_rows(sampled, rewards, iteration)
        lr = learning_rate(c.train, iteration)
        schedule = self.schedule()
        # Each process cuts its own rows; a global minibatch is every process's part, and
        # all processes run as many minibatches as the one with the most rows needs.
        per_process = c.train.rows_per_minibatch // jax.process_count()
        count = int(sharding.agree(transitions.num_minibatches(rows.num_rows, per_process)))
        step_metrics = []
        for epoch in range(c.train.inner_epochs):
            epoch_key = jax.random.fold_in(key, epoch)
            for batch in transitions.minibatches(rows, epoch_key, per_process, count):
                state, metrics = self.train_step(
                    state,
                    sharding.shard_batch(self.mesh, batch),
                    sampled.cond,
                    schedule,
                    self.uncond,
                    self.ref_params,
                    jnp.float32(lr),
                    *self._step_args(),
                )
                step_metrics.append(metrics)
        step_metrics = jax.device_get(step_metrics)
        if not all(m["finite"] for m in step_metrics):
            raise DivergenceError(self._diverged(f"the loss or gradient of iteration {iteration}"))
        metrics = {
            "trained_edges": int(sharding.agree(rows.num_edges, "sum")),
            "train_rows": int(sharding.agree(rows.num_rows, "sum")),
            "minibatches": len(step_metrics),
            "learning_rate": lr,
        }
        if step_metrics:
            for name in ("loss", "approx_kl", "clip_fraction", "ratio_mean", "grad_norm", "kl"):
                if name in step_metrics[0]:
                    metrics[name] = float(np.mean([m[name] for m in step_metrics]))
            metrics["ratio_min"] = float(np.min([m["ratio_min"] for m in step_metrics]))
            metrics["ratio_max"] = float(np.max([m["ratio_max"] for m in step_metrics]))
        return state, metrics

    def iteration(self, state: TrainState, iteration: int) -> tuple[TrainState, dict]:
        """One whole iteration; returns the new state and its metrics."""
        timings = {}
        t0 = time.perf_counter()
        rollout_key, shuffle_key = jax.random.split(jax.random.fold_in(self.key, iteration))
        prompts = self.prompts.next_global_batch()
        sampled = self.rollout(state.params, prompts, rollout_key, iteration)
        finite = bool(jnp.all(jnp.isfinite(sampled.tree.leaves)))
        if not sharding.agree(finite, "min"):
            raise DivergenceError(self._diverged(f"the samples of iteration {iteration}"))
        timings["time_rollout"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        leaves = sampled.tree.leaves
        num_prompts, num_leaves = leaves.shape[:2]
        images = self.model.decode(leaves.reshape(num_prompts * num_leaves, *leaves.shape[2:]))
        leaf_prompts = [p for p in sampled.prompts[sampled.rows] for _ in range(num_leaves)]
        rewards, parts = self.score(images, leaf_prompts, f"at iteration {iteration}")
        rewards = rewards.reshape(len(sampled.prompts), num_leaves)
        timings["time_reward"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        state, update_metrics = self.update(state, sampled, rewards, iteration, shuffle_key)
        timings["time_update"] = time.perf_counter() - t2
        timings["time_iteration"] = time.perf_counter() - t0
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **{f"reward_{n}": float(v.mean()) for n, v in parts.items() if len(parts) > 1},
            **update_metrics,
            "window_start": self.window_start(iteration),
            **timings,
        }
        return state, metrics

    def evaluate(self, params) -> tuple[dict, np.ndarray]:
        """Mean reward of fixed prompts from fixed noise with the deterministic sampler."""
        c = self.config
        prompts = self.eval_prompts
        noise = _eval_noise(c.eval.seed, len(prompts), self.model.sample_shape)
        samples = rollout.sample_deterministic(
            self.model.denoise,
            self.model_params(params),
            np.asarray(self.model.encode_prompts(prompts)),
            noise,
            self.schedule(c.eval.num_steps or None),
            uncond=self.uncond,
            guidance_scale=c.sampling.guidance_scale,
        )
        samples = sharding.to_host(samples)
        if not np.isfinite(samples).all():
            raise DivergenceError(self._diverged("the evaluation samples"))
        # Every process decodes and scores its share (the last share topped up with repeats
        # so all are the same size); the values come back in order and are cut to size.
        count = len(prompts)
        share = -(-count // jax.process_count())
        mine = np.arange(jax.process_index() * share, (jax.process_index() + 1) * share) % count
        local = np.asarray(self.model.decode(samples[mine]))
        mine_prompts = [prompts[i] for i in mine]
        total, parts = self.score(local, mine_prompts, "in evaluation")
        total, parts = total[:count], {n: v[:count] for n, v in parts.items()}
        metrics = {"reward_mean": float(total.mean()), "reward_std": float(total.std())}
        if len(parts) > 1:
            metrics.update({f"reward_{n}": float(v.mean()) for n, v in parts.items()})
        for name, reward in self.eval_rewards.items():
            values = sharding.gather(np.asarray(reward(local, mine_prompts), np.float64))
            metrics[name] = float(np.mean(values[:count]))
        return metrics, sharding.gather(local)[:count]

    def _diverged(self, what: str) -> str:
        return (
            f"{what} are not finite: training diverged (a lower train.learning_rate or "
            f"train.max_grad_norm may help); the checkpoints in {self.workdir}/checkpoints "
            "are kept as they were."
        )

    def reseed(self, seed: int) -> Trainer:
        """The same trainer started over with `seed`: its own key, prompt order and a fresh
        stat tracker; the model and the compiled step are shared."""
        config = self.config.copy_and_resolve_references()
        config.seed = seed
        return dataclasses.replace(
            self,
            config=config,
            prompts=_prompt_iterator(config),
            tracker=_make_tracker(config, self.method),
            key=jax.random.PRNGKey(seed),
        )


def edge_masks(c, method: methods.Method, sampled: Rollout, advantages, iteration):
    """Pruning masks for methods that prune, while pruning is on; None (train every edge)
    otherwise."""
    a = c.advantage
    if not method.pruning or not pruning.pruning_active(
        iteration, c.train.iterations, a.pruning_step_ratio
    ):
        return None
    masks = None
    if a.depth_pruning:
        masks = pruning.depth_pruning_mask(
            sampled.spec,
            sampled.tree,
            tuple(a.depth_pruning),
            iteration=iteration,
            slide_every=a.depth_pruning_slide_every or None,
            stop_depth=None if a.depth_pruning_stop < 0 else a.depth_pruning_stop,
            count_from=a.depth_pruning_count_from,
            window_start=sampled.window_start,
        )
    if a.width_pruning != "none":
        width = pruning.width_pruning_mask(
            sampled.spec,
            sampled.tree,
            advantages,
            mode=a.width_pruning,
            ratio=a.width_pruning_ratio,
        )
        masks = pruning.combine_masks(masks, width)
    return masks


def _prompt_iterator(config) -> PromptIterator:
    return PromptIterator(
        load_prompts(config.prompts.source),
        config.prompts.batch_size,
        seed=config.seed,
        shard_index=jax.process_index(),
        num_shards=jax.process_count(),
    )


def _make_tracker(config, method: methods.Method) -> adv.PerPromptStatTracker | None:
    if not (config.advantage.stat_tracker and method.stat_tracker):
        return None
    return adv.PerPromptStatTracker(
        config.advantage.tracker_buffer, config.advantage.tracker_min_count
    )


@functools.lru_cache(maxsize=8)
def _eval_noise(seed: int, count: int, sample_shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (count, *sample_shape)))


def _memory_limit() -> tuple[int, str]:
    """Bytes this process's first device can hold (host memory for CPU devices), and what
    it is."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def check_sizes(config, spec, sample_shape) -> None:
    """Refuses, before anything is compiled, a rollout or eval set whose stored samples
    alone cannot fit in memory (float32 states of every trained step, and the leaves)."""
    sample_bytes = 4 * int(np.prod(sample_shape))
    prompts = config.prompts.batch_size
    states = spec.recorded_states
    rollout_bytes = prompts * (states + spec.leaves) * sample_bytes
    eval_bytes = 2 * config.prompts.eval_count * sample_bytes
    limit, where = _memory_limit()
    gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
    if rollout_bytes > limit:
        raise cfg.ConfigError(
            f"one rollout stores about {gib(rollout_bytes)} of samples ({prompts} prompts x "
            f"{spec.leaves} leaves, {states} stored states per prompt), more than the "
            f"{gib(limit)} of {where}; lower prompts.batch_size or the tree's size."
        )
    if eval_bytes > limit:
        raise cfg.ConfigError(
            f"prompts.eval_count={config.prompts.eval_count} needs about {gib(eval_bytes)} of "
            f"samples, more than the {gib(limit)} of {where}; lower prompts.eval_count."
        )


def setup(
    config: ml_collections.ConfigDict, workdir: str, model: TextToImageModel | None = None
) -> tuple[Trainer, TrainState]:
    """Checks the config, builds the rewards, mesh, model (or takes `model`), optimizer and
    the initial state (fresh; `resume` may replace it)."""
    reward_weights = cfg.validate(config, known_rewards=reward_registry.available_rewards())
    return _build(config, workdir, reward_weights, model)


def load_rewards(config, names, mesh=None) -> dict[str, reward_registry.Reward]:
    """Each named reward built once, the model-based ones from `config.reward_models`."""
    loaded = {}
    for name in dict.fromkeys(names):
        if reward_registry.needs_weights(name):
            opts = config.reward_options
            options = dict(dtype=opts.dtype, chunk_size=opts.chunk_size, mesh=mesh)
            if name == "pickscore":
                options["divisor"] = opts.pickscore_divisor
            path = config.reward_models.get(name) or None
            loaded[name] = reward_registry.load_reward(name, path, **options)
        else:
            loaded[name] = reward_registry.load_reward(name)
    return loaded


def model_family(model_name: str) -> str:
    """ "tiny", "sd" or "sd3": which parameter tree (and LoRA defaults) a model has."""
    return "tiny" if "tiny" in model_name else model_name


def _make_adapter(config, model: TextToImageModel, mesh) -> Adapter | None:
    """LoRA on the model's weights when `lora.rank > 0`: the base in the compute dtype."""
    spec = config.lora
    if spec.rank == 0:
        return None
    base = cast_floats(model.params, DTYPES[config.model.compute_dtype])
    targets = tuple(spec.targets) or lora.DEFAULT_TARGETS[model_family(config.model.name)]
    paths = lora.target_paths(base, targets)
    # The checksum is taken on the host before the base is laid out on the mesh, so a resume
    # on another mesh (allowed) finds the same value.
    fingerprint = weights_fingerprint(base)
    return Adapter(
        base=jax.device_put(base, sharding.param_shardings(mesh, base)),
        paths=paths,
        rank=int(spec.rank),
        alpha=float(spec.alpha or spec.rank),
        base_fingerprint=fingerprint,
    )


def _build(config, workdir, reward_weights, model) -> tuple[Trainer, TrainState]:
    sharding.maybe_initialize_distributed()
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp)
    shards = sharding.num_batch_shards(mesh)
    if config.train.rows_per_minibatch % shards:
        raise cfg.ConfigError(
            f"train.rows_per_minibatch ({config.train.rows_per_minibatch}) must be a multiple "
            f"of the {shards} devices the batch is split over."
        )
    local_devices = jax.local_device_count()
    if sharding.multi_process() and config.prompts.batch_size % local_devices:
        raise cfg.ConfigError(
            f"prompts.batch_size ({config.prompts.batch_size}, per process) must be a multiple "
            f"of the {local_devices} devices of each process the rollout is split over."
        )
    method = methods.get(config.tree.method)
    # Rewards score the images where they were decoded: each process has its own copy.
    reward_mesh = sharding.local_mesh(mesh)
    loaded = load_rewards(config, (*reward_weights, *config.eval.extra_rewards), reward_mesh)
    reward = reward_registry.combined_reward(reward_weights, loaded)
    eval_rewards = {n: loaded[n] for n in config.eval.extra_rewards}
    prompts = _prompt_iterator(config)
    eval_set = load_prompts(config.prompts.eval_source or config.prompts.source)
    if model is None:
        model = load_model(config.model, seed=config.seed)
    check_sizes(config, methods.build_spec(config), model.sample_shape)
    eval_prompts = [eval_set[i % len(eval_set)] for i in range(config.prompts.eval_count)]
    if model.prepare_prompts is not None:
        said = model.prepare_prompts([*prompts.prompts, *eval_prompts, ""])
        if jax.process_index() == 0 and config.log.progress:
            print(f"text encoders: {said}", flush=True)
    guidance = config.sampling.guidance_scale != 1.0
    uncond = np.asarray(model.encode_prompts([""])[0]) if guidance else None

    adapter = _make_adapter(config, model, mesh)
    if adapter is None:
        params = cast_floats(model.params, DTYPES[config.model.param_dtype])
    else:  # only the factors are trained, optimized and checkpointed
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
        params = lora.init_lora(key, adapter.base, adapter.paths, adapter.rank)
        params = cast_floats(params, DTYPES[config.model.param_dtype])
    tx = make_optimizer(config.train)

    def fresh(p):
        return TrainState(p, tx.init(p), jnp.zeros((), jnp.int32))

    state_shardings = sharding.param_shardings(mesh, jax.eval_shape(fresh, params))
    init_state = jax.jit(fresh, out_shardings=state_shardings)
    state = init_state(params)

    denoise = jax.checkpoint(model.denoise) if config.model.remat else model.denoise
    loss_kwargs = dict(
        denoise_fn=denoise,
        reduce=config.sampling.log_prob_reduce,
        guidance_scale=config.sampling.guidance_scale,
        clip_range=config.train.clip_range,
        kl_beta=config.train.kl_beta,
    )
    use_kl = config.train.kl_beta > 0
    if adapter is None:
        ref_params = jax.tree_util.tree_map(jnp.copy, state.params) if use_kl else None
        train_step = make_train_step(tx, loss_kwargs, mesh, state_shardings)
    else:  # the KL reference is the base itself: no second copy
        ref_params = adapter.base if use_kl else None
        base_shardings = sharding.param_shardings(mesh, adapter.base)
        train_step = make_train_step(
            tx,
            loss_kwargs,
            mesh,
            state_shardings,
            merge=functools.partial(lora.merge, alpha=adapter.alpha, rank=adapter.rank),
            frozen_shardings=base_shardings,
            ref_shardings=base_shardings if use_kl else None,
        )
    trainer = Trainer(
        config=config,
        workdir=workdir,
        model=model,
        mesh=mesh,
        method=method,
        reward=reward,
        eval_rewards=eval_rewards,
        prompts=prompts,
        eval_prompts=eval_prompts,
        uncond=uncond,
        train_step=train_step,
        init_state=init_state,
        tracker=_make_tracker(config, method),
        ref_params=ref_params,
        key=jax.random.PRNGKey(config.seed),
        adapter=adapter,
    )
    return trainer, state


# ---------------------------------------------------------------------------------------------
# Resume and the loop.

BAD_INPUT = (
    cfg.ConfigError,
    CheckpointError,
    ModelLoadError,
    WorkdirBusy,
    FileNotFoundError,
    ValueError,  # prompt files, reward names, shapes of user inputs
)


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; the iteration then running finished and was saved."""

    def __init__(self, signal_name: str, iteration: int, workdir: str):
        self.signal_name = signal_name
        super().__init__(
            f"{signal_name} received; stopped after iteration {iteration}, saved in "
            f"{workdir}/checkpoints; the same command resumes it exactly."
        )


class Stopped(BaseException):
    """A signal stopped the run at once (while starting, or a second signal); nothing was
    saved beyond the last checkpoint. A BaseException, so no `except Exception` swallows it."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(signal_name)


class _Signals:
    """SIGINT and SIGTERM as the run wants them.

    `defer=True` (the training loop): the first signal only asks the loop to stop after the
    iteration in progress (a half-done iteration cannot be saved: its update has consumed the
    previous state); a second one stops at once. `defer=False` (starting up, nothing to save
    yet): stop at once. A signal the parent process ignores stays ignored.
    """

    NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}

    def __init__(self, defer: bool = True):
        self.defer = defer
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        name = self.NAMES[signum]
        if not self.defer or self.received:
            raise Stopped(name)
        self.received = name
        print(
            f"\n{name}: finishing the current iteration, then saving "
            "(send it again to stop at once).",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.NAMES:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _host_state(trainer: Trainer) -> dict:
    """What besides the arrays decides the next iteration, taken between iterations."""
    return {
        "prompt_iterator": trainer.prompts.state_dict(),
        "stat_tracker": trainer.tracker.state_dict() if trainer.tracker else None,
    }


def _meta(trainer: Trainer, next_iteration: int, history: dict, host: dict) -> dict:
    return {
        "next_iteration": next_iteration,
        "seed": trainer.config.seed,
        "rng_key": np.asarray(jax.random.key_data(trainer.key)).tolist(),
        "window_start": methods.window_start(trainer.config, next_iteration),
        "fingerprint": cfg.fingerprint(trainer.config),
        "base_weights": trainer.adapter.base_fingerprint if trainer.adapter else None,
        "history": history,
        **host,
    }


def check_resume(config: ml_collections.ConfigDict, ckpt: Checkpointer) -> None:
    """Refuses to resume checkpoints of another run, before anything heavy loads."""
    if ckpt.latest_step is None:
        return
    saved = ckpt.read_meta().get("fingerprint")
    if saved is None:
        raise CheckpointError(
            f"the checkpoints in {ckpt.directory} carry no run fingerprint, so they cannot be "
            "checked against this config; use another --workdir."
        )
    differs = fingerprint_mismatch(saved, cfg.fingerprint(config))
    if differs:
        raise CheckpointError(
            f"{ckpt.directory} holds another run ({differs}); resume it with its own config "
            "or choose another --workdir."
        )


def resume(trainer: Trainer, state: TrainState, ckpt: Checkpointer):
    """Restores the newest readable checkpoint in the workdir; a fresh start if none."""
    if ckpt.latest_step is None:
        return state, 0, {"eval": [], "wall_time": 0.0}
    saved_base = ckpt.read_meta().get("base_weights")
    if trainer.adapter is not None and saved_base != trainer.adapter.base_fingerprint:
        raise CheckpointError(
            f"the LoRA checkpoints in {ckpt.directory} were trained on other base weights "
            f"than {trainer.config.model.name} {trainer.config.model.path!r} holds now "
            "(their checksums differ); resume with the base weights they were trained on."
        )
    state, meta, _ = ckpt.restore(state)
    trainer.prompts.load_state_dict(meta["prompt_iterator"])
    if trainer.tracker is not None and meta.get("stat_tracker"):
        trainer.tracker.load_state_dict(meta["stat_tracker"])
    return state, int(meta["next_iteration"]), meta["history"]


def save_eval(trainer: Trainer, iteration: int, params, history: dict, writer) -> dict:
    """Evaluates (every process takes part); the primary process writes the grid."""
    metrics, images = trainer.evaluate(params)
    path = os.path.join(trainer.workdir, f"eval_{iteration:05d}.png")
    if sharding.is_primary():
        reporting.save_grid(path, images, columns=min(10, len(images)))
    writer.write(iteration, metrics, prefix="eval/")
    history["eval"].append({"iteration": iteration, **metrics})
    if trainer.config.log.progress and sharding.is_primary():
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        print(f"eval after {iteration} iterations: {shown} -> {path}", flush=True)
    return metrics


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) the configured training; returns the final summary."""
    session_start = time.time()
    reward_weights = cfg.validate(config, known_rewards=reward_registry.available_rewards())
    if "://" in workdir:
        raise cfg.ConfigError(
            f"--workdir {workdir} is not a local folder; keep the workdir (logs, pictures) "
            f"local and put the checkpoints there with --config.checkpoint.dir={workdir}."
        )
    # Every process joins before anything is written: the primary one alone holds the
    # workdir's lock and writes its logs; all of them write the checkpoints together.
    sharding.maybe_initialize_distributed()
    _check_same_config(config)
    primary = sharding.is_primary()
    lock = WorkdirLock(workdir) if primary else None
    _on_primary(lambda: (check_writable(workdir), lock.acquire()), "take the workdir")
    with _Signals(defer=False), contextlib.ExitStack() as held:
        if lock is not None:
            held.callback(lock.release)
        ckpt = Checkpointer(checkpoint_dir(config, workdir), keep=config.checkpoint.keep)
        try:
            check_resume(config, ckpt)
            trainer, state = _build(config, workdir, reward_weights, model=None)
            state, start, history = resume(trainer, state, ckpt)
            # Written only once the resume checks have passed: it describes the checkpoints.
            if primary:
                with open(os.path.join(workdir, "config.json"), "w") as f:
                    f.write(config.to_json_best_effort(indent=2))
            summary = _loop(trainer, state, start, history, ckpt)
        finally:
            ckpt.close()
    summary["session_s"] = time.time() - session_start
    return summary


def _on_primary(action, what: str) -> None:
    """Runs `action` on the primary process alone; when it fails there, every process stops
    (the primary with its own sentence, the others naming it) instead of waiting for it."""
    error = None
    if sharding.is_primary():
        try:
            action()
        except BAD_INPUT as e:
            error = e
    if sharding.agree(float(error is not None)) > 0:
        raise error or WorkdirBusy(f"process 0 could not {what}; its error says why.")


def _check_same_config(config) -> None:
    """Processes of one job must compute the same thing: one sentence, on every process,
    when their configs differ in anything a resume would refuse (or in the mesh)."""
    if not sharding.multi_process():
        return
    text = json.dumps([cfg.fingerprint(config), config.mesh.to_dict()], sort_keys=True)
    digest = np.uint32(int(hashlib.sha256(text.encode()).hexdigest()[:8], 16))
    digests = sharding.gather(np.asarray([digest]))
    differ = np.flatnonzero(digests != digests[0])
    if differ.size:
        raise cfg.ConfigError(
            f"the {digests.size} processes of this job were started with different configs "
            f"(process {differ[0]} differs from process 0); give every process the same "
            "config file and overrides."
        )


def checkpoint_dir(config, workdir: str) -> str:
    """`checkpoint.dir` (a local folder or a gs:// URL) or `<workdir>/checkpoints`."""
    return config.checkpoint.dir or os.path.join(workdir, "checkpoints")


def _loop(trainer: Trainer, state, start: int, history: dict, ckpt: Checkpointer) -> dict:
    c, workdir = trainer.config, trainer.workdir
    total = c.train.iterations
    spec = trainer.spec().at(trainer.window_start(0))
    if start >= total and any(e["iteration"] == start for e in history["eval"]):
        return {**summarize(trainer, spec, history, workdir), "already_finished": True}

    primary = sharding.is_primary()
    if primary:
        writer = reporting.MetricsWriter(
            workdir, c.log.tensorboard, c.log.wandb_project, resume_step=start if start else None
        )
    else:
        writer = reporting.NullWriter()
    progress = reporting.Progress(total, start, c.log.progress and primary)
    if c.log.progress and primary:
        print(
            f"{spec.describe()} | {c.prompts.batch_size} prompts x {spec.leaves} leaves | "
            f"model {trainer.model.name} | mesh {dict(trainer.mesh.shape)} | workdir {workdir}",
            flush=True,
        )
        if start:
            print(f"resumed from the checkpoint after iteration {start}", flush=True)
    wall_start = time.time() - history.get("wall_time", 0.0)
    host = _host_state(trainer)

    def save(done: int) -> None:
        history["wall_time"] = time.time() - wall_start
        ckpt.save(done, state, _meta(trainer, done, history, host))

    try:
        with _Signals() as signals:
            if start == 0 and not history["eval"]:
                save_eval(trainer, 0, state.params, history, writer)
            for iteration in range(start, total):
                try:
                    state, metrics = trainer.iteration(state, iteration)
                except RewardError:
                    # The update had not started: `state` still holds `iteration` finished
                    # iterations, and `host` the prompt/tracker state that goes with them.
                    if iteration > start:
                        save(iteration)
                    raise
                done = iteration + 1
                host = _host_state(trainer)
                writer.write(done, metrics, prefix="train/")
                shown = ("reward_mean", "loss", "approx_kl", "clip_fraction")
                progress.update(
                    iteration,
                    metrics["time_iteration"],
                    {k: metrics[k] for k in shown if k in metrics},
                )
                if done == total:
                    break
                if c.eval.every and done % c.eval.every == 0:
                    save_eval(trainer, done, state.params, history, writer)
                # A signal to any process stops them all after the same iteration.
                stop = sharding.agree(float(signals.received is not None)) > 0
                if stop or (c.checkpoint.every and done % c.checkpoint.every == 0):
                    save(done)
                    # one that came during the save stops at this checkpoint
                    stop = sharding.agree(float(signals.received is not None)) > 0
                if stop:
                    raise Interrupted(signals.received or "SIGTERM", done, workdir)
            save_eval(trainer, total, state.params, history, writer)
            save(total)
    finally:
        writer.close()
    return summarize(trainer, spec, history, workdir)


def summarize(trainer: Trainer, spec, history: dict, workdir: str) -> dict:
    evals = history["eval"]
    steps = [e["iteration"] for e in evals]
    rewards = [e["reward_mean"] for e in evals]
    curve = os.path.join(workdir, "eval_reward.png")
    if sharding.is_primary():
        reporting.save_curve(curve, steps, rewards, "eval reward", trainer.config.name)
    summary = {
        "iterations": trainer.config.train.iterations,
        "first_eval_reward": rewards[0],
        "last_eval_reward": rewards[-1],
        "wall_time_s": history["wall_time"],
        "rollout_denoiser_calls_per_leaf": spec.rollout_denoiser_calls(trainer.guidance)
        / spec.leaves,
        "first_grid": os.path.join(workdir, f"eval_{steps[0]:05d}.png"),
        "last_grid": os.path.join(workdir, f"eval_{steps[-1]:05d}.png"),
        "reward_curve": curve,
        "evals": evals,
    }
    if sharding.is_primary():
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary
