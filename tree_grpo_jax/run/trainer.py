"""The trainer: one iteration's jobs on arrays the run has already built.

prompts -> tree rollout -> rewards -> advantages -> PPO updates, in order:
  1. draw a prompt batch and encode it once;
  2. roll out the iteration's tree (the window of windowed methods slides with the count);
  3. decode the leaves and score them;
  4. turn leaf rewards into per-edge advantages, and the method's edge masks (pruning);
  5. gather the trainable edges into rows and run `inner_epochs` of shuffled minibatches
     through one jitted, sharded train step.
Every random draw comes from `fold_in(seed key, iteration)`, so a resumed run draws exactly
what an uninterrupted one would. The evaluation (fixed prompts, fixed noise, the deterministic
sampler) is the trainer's `evaluator` (`run.evaluation`).

`build.setup` makes a `Trainer` from a config; `train` runs the loop (signals, resume,
checkpoints, summary) around `Trainer.iteration`. The trainer's methods (`rollout`,
`update`, `iteration`, `reseed`) and its `evaluator.evaluate` are also the seam the
benchmarks use.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax import lora, methods, sharding
from tree_grpo_jax.core import rollout, transitions
from tree_grpo_jax.models.base import TextToImageModel, schedule_for
from tree_grpo_jax.run import node_scoring, reporting, scoring, tracking
from tree_grpo_jax.run.host_state import HostState
from tree_grpo_jax.run.input_images import encode_prompts
from tree_grpo_jax.run.program_store import exported_program
from tree_grpo_jax.run.prompts import leaf_metadata
from tree_grpo_jax.run.scoring import DivergenceError
from tree_grpo_jax.run.train_step import TrainState, learning_rate, old_params

if TYPE_CHECKING:
    from tree_grpo_jax.run.evaluation import Evaluator


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
    node_values: Any = None  # node rewards: the kept x0 estimates' scores (node_scoring.py)


@functools.cache  # once per run (per count), not once per iteration
def _note_fewer_updates(asked: int, total: int) -> None:
    print(
        f"note: train.updates_per_iteration={asked} is more than the {total} minibatch(es) "
        f"an iteration trains on; each minibatch is one update ({total} per iteration).",
        file=sys.stderr,
        flush=True,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """Everything an iteration needs that does not change between iterations.

    Its mutable parts (`host_state`: the prompt iterator's position, the stat tracker, the
    replay buffer) belong to one trainer; `reseed` gives a trainer with its own, sharing the
    model and the compiled step.
    """

    config: ml_collections.ConfigDict
    workdir: str
    model: TextToImageModel
    mesh: Any
    method: methods.Method
    reward: Any
    evaluator: Evaluator  # the run's evaluation (`run.evaluation`), sharing the model
    host_state: HostState  # changed in place by every iteration
    uncond: jax.Array | None
    train_step: Any
    accumulating: Any  # train_step.AccumulatingStep: updates that span several minibatches
    init_state: Any  # params -> a fresh TrainState, laid out on the mesh
    ref_params: Any
    key: jax.Array
    adapter: lora.Adapter | None = None  # LoRA: the frozen base the trained factors adapt
    # the rollout's and the evaluation's denoiser (`run.denoiser.sampling_denoise`; built once:
    # the programs take it as a static argument); None: the model's own
    sampling_denoise: Any = None
    # the empty prompt's embedding for the loss alone, in a run that samples without guidance
    # (`Objective.loss_reads_empty_prompt`); None: the loss gets `uncond`
    loss_uncond: jax.Array | None = None
    # latents -> images, each device its own rows (`scoring.shared_decode`; the evaluator's)
    device_decode: Any = None
    # programs made ahead, run in place of tracing them (`run.program_store`, by `precompile`;
    # the evaluator's dict)
    programs: dict = dataclasses.field(default_factory=dict)

    @property
    def train_uncond(self) -> jax.Array | None:
        """What the loss receives as `uncond`: the guided rollout's, else the loss's own."""
        return self.uncond if self.uncond is not None else self.loss_uncond

    @property
    def denoise(self):
        return self.model.denoise if self.sampling_denoise is None else self.sampling_denoise

    @property
    def guidance(self) -> bool:
        return self.uncond is not None

    def model_params(self, params):
        """The denoiser's weights for the trained `params` (LoRA: the base with the factors,
        merged block by block in scanned runs, `lora.attach`)."""
        return params if self.adapter is None else self.adapter.weights(params)

    def step_args(self, batch, cond, schedule, lr=None) -> tuple:
        """The train step's arguments after the state, in one place for every caller: the
        minibatch, its conditioning, the schedule, the loss's `uncond`, the reference weights,
        the learning rate (`lr`; None for `accumulate`, which takes none) and, with LoRA, the
        frozen base the step merges the factors into."""
        rate = () if lr is None else (jnp.float32(lr),)
        frozen = () if self.adapter is None else (self.adapter.base,)
        return (batch, cond, schedule, self.train_uncond, self.ref_params, *rate, *frozen)

    # -- pieces of an iteration ------------------------------------------------------------
    def spec(self):
        """The run's tree spec, the same at every iteration (windowed methods: a family)."""
        return self.method.run_spec(self.config)

    def window_start(self, iteration: int) -> int:
        return self.method.window_start_at(self.config, iteration)

    def schedule(self):
        s = self.config.sampling
        return schedule_for(self.model, s.num_steps, s, "sampling.num_steps")

    def rollout(
        self, params, prompts: Sequence[str], key: jax.Array, iteration: int = 0
    ) -> Rollout:
        """The iteration's trees for the global batch `prompts` from `params` (no gradient,
        no update), its prompts split over the mesh's batch axes: every device rolls out its
        own. With several processes each encodes, and keeps, its own rows."""
        metadata = leaf_metadata(prompts)  # a family conditioning on input images reads them
        prompts = list(prompts)
        rows = sharding.process_rows(len(prompts))
        mine = encode_prompts(self.model, prompts[rows], metadata[rows])
        cond = sharding.global_batch(self.mesh, mine)
        start = self.window_start(iteration)
        tree = self._rollout_program(self.model_params(params), cond, key, start)
        if sharding.multi_process():
            tree = sharding.local_tree(tree, rows)
        cond = sharding.replicate(self.mesh, cond)  # a minibatch row may meet any prompt
        return Rollout(prompts, cond, self.spec(), start, tree, rows)

    def _rollout_program(
        self, weights, cond, key, window_start: int, lower: bool = False, export: bool = False
    ):
        c = self.config
        return rollout.rollout(
            self.denoise,
            weights,
            cond,
            key,
            self.schedule(),
            spec=self.spec(),
            sample_shape=self.model.sample_shape,
            uncond=self.uncond,
            guidance_scale=c.sampling.guidance_scale,
            reduce=c.sampling.log_prob_reduce,
            window_start=jnp.int32(window_start),  # data: one program for every position
            split_log_prob=c.tree.split_log_prob,
            lower=lower,
            export=export,
            program=None if export else self.programs.get("rollout"),
            **self.method.objective.rollout_options(c),
        )

    def trainable_rows(
        self, sampled: Rollout, rewards, iteration: int = 0, key: jax.Array | None = None
    ):
        """This process's training rows of a rollout (rewards [P, L] of the global batch), as
        the method's objective makes them: PPO's trainable edges with their advantages
        (updating the stat tracker when the method uses one), DiffusionNFT's leaves noised
        again, drawn with `key`. A row's `prompt` indexes the global batch (`sampled.cond`)."""
        rewards = np.asarray(rewards, np.float32)
        tracker = self.host_state.tracker
        if tracker is not None:
            tracker = tracking.TrackerRows(tracker, sampled.prompts, rewards, sampled.rows)
        source = methods.RowSource(
            spec=sampled.spec,
            window_start=sampled.window_start,
            tree=sampled.tree,
            rows=sampled.rows,
            prompts=sampled.prompts,
            rewards=rewards,
            iteration=iteration,
            tracker=tracker,
            schedule=self.schedule(),
            node_values=sampled.node_values,
        )
        return self.method.objective.rows(self.method, self.config, source, key)

    def sampling_params(self, state: TrainState, iteration: int = 0):
        """The trained weights the rollout samples with: the old policy where the method
        keeps one and samples with it at `iteration` (DiffusionNFT; AWM off-policy; DGPO
        after its switch), else the current ones."""
        old = old_params(state)
        if old is None or not self.method.objective.samples_with_old_policy(self.config, iteration):
            return state.params
        return old

    def update(
        self, state: TrainState, sampled: Rollout, rewards, iteration: int, key: jax.Array
    ) -> tuple[TrainState, dict]:
        """Advantages, pruning and every minibatch step of one iteration's rollout (and,
        for a method that keeps one, the old policy's move towards the new weights)."""
        c = self.config
        objective = self.method.objective
        rows_key = None
        if objective.draws_rows:
            rows_key, key = jax.random.split(key)
        fresh = rows = self.trainable_rows(sampled, rewards, iteration, rows_key)
        cond = sampled.cond
        held = self.host_state.replay
        if held is not None:  # the held iterations' rows beside this one's
            rows, cond = held.mixed(fresh, cond)
            cond = sharding.replicate_host(self.mesh, cond)  # the same on every process
        lr = learning_rate(c.train, iteration)
        schedule = self.schedule()
        # Each process cuts its own rows; a global minibatch is every process's part, and
        # all processes run as many minibatches as the one with the most rows needs.
        per_process = c.train.rows_per_minibatch // jax.process_count()
        count = int(sharding.agree(transitions.num_minibatches(rows.num_rows, per_process)))
        total = count * c.train.inner_epochs
        asked = c.train.updates_per_iteration
        if asked > total:
            _note_fewer_updates(asked, total)
        updates = min(asked, total)
        step_metrics, update_metrics, acc = [], [], None
        for index, batch in enumerate(self._minibatches(rows, key, per_process, count)):
            batch = sharding.shard_batch(self.mesh, batch)
            if not updates:  # one update per minibatch (or per grad_accumulation of them)
                state, m = self.programs.get("train_step", self.train_step)(
                    state, *self.step_args(batch, cond, schedule, lr)
                )
                step_metrics.append(m)
                continue
            # `updates` updates, each over a run of consecutive minibatches
            group = index * updates // total
            acc = self.accumulating.start(state) if acc is None else acc
            acc, m = self.accumulating.accumulate(
                acc, state, *self.step_args(batch, cond, schedule)
            )
            step_metrics.append(m)
            if index + 1 == total or (index + 1) * updates // total != group:
                state, m = self.accumulating.apply(state, acc, jnp.float32(lr))
                update_metrics.append(m)
                acc = None
        step_metrics, update_metrics = jax.device_get((step_metrics, update_metrics))
        if not all(m["finite"] for m in (*step_metrics, *update_metrics)):
            what = f"the loss or gradient of iteration {iteration}"
            raise DivergenceError.in_run(what, self.workdir)
        if update_metrics:  # the norm of each update's gradient, not of its minibatches'
            grad_norm = float(np.mean([m["grad_norm"] for m in update_metrics]))
            step_metrics = [{**m, "grad_norm": grad_norm} for m in step_metrics]
        metrics = {
            "trained_edges": int(sharding.agree(rows.num_edges, "sum")),
            "train_rows": int(sharding.agree(rows.num_rows, "sum")),
            "minibatches": len(step_metrics),
            "learning_rate": lr,
        }
        if step_metrics:
            means = ("loss", "approx_kl", "clip_fraction", "ratio_mean", "grad_norm", "kl")
            for name in (*means, "old_deviation", *objective.reported_metrics):
                if name in step_metrics[0]:
                    metrics[name] = float(np.mean([m[name] for m in step_metrics]))
            if "ratio_min" in step_metrics[0]:
                metrics["ratio_min"] = float(np.min([m["ratio_min"] for m in step_metrics]))
                metrics["ratio_max"] = float(np.max([m["ratio_max"] for m in step_metrics]))
        if held is not None:  # this iteration's own rows are held for the next ones
            metrics["replayed_rows"] = int(sharding.agree(rows.num_rows - fresh.num_rows, "sum"))
            held.push(iteration, fresh, sampled.cond)
        if old_params(state) is not None:  # the old policy's move towards the new weights
            old, moved = objective.after_update(c, old_params(state), state.params, iteration)
            state = state.replace(old_params=old)
            metrics.update(moved)
        return state, metrics

    def _minibatches(self, rows, key, per_process: int, count: int):
        """Every epoch's shuffled minibatches of this process's rows, in order."""
        for epoch in range(self.config.train.inner_epochs):
            yield from transitions.minibatches(
                rows, jax.random.fold_in(key, epoch), per_process, count
            )

    def prompt_metadata(self, batch, rows: slice = slice(None), repeat: int = 1) -> list[dict]:
        """The rewards' metadata: of the global batch `batch` (`host_state.prompts`' draw, which
        carries it), the metadata of prompts `rows` (a process's, `Rollout.rows`), each
        repeated `repeat` times (a prompt's leaves), in the order of the prompts the rewards
        are given with the images. A plain list of prompts gives {} for each."""
        return leaf_metadata(batch, rows, repeat)

    def iteration(self, state: TrainState, iteration: int) -> tuple[TrainState, dict]:
        """One whole iteration; returns the new state and its metrics."""
        timings = {}
        t0 = time.perf_counter()
        rollout_key, shuffle_key = jax.random.split(jax.random.fold_in(self.key, iteration))
        prompts = self.host_state.prompts.next_global_batch()
        sampled = self.rollout(
            self.sampling_params(state, iteration), prompts, rollout_key, iteration
        )
        finite = bool(jnp.all(jnp.isfinite(sampled.tree.leaves)))
        if not sharding.agree(finite, "min"):
            raise DivergenceError.in_run(f"the samples of iteration {iteration}", self.workdir)
        timings["time_rollout"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        leaves = sampled.tree.leaves
        num_prompts, num_leaves = leaves.shape[:2]
        images = scoring.decode(
            self.device_decode,
            leaves.reshape(num_prompts * num_leaves, *leaves.shape[2:]),
            groups=num_prompts,  # parts cut along the leaves keep the prompts' devices
            parts=scoring.decode_parts(self.config.reward_options, self.reward.on_host),
        )
        leaf_prompts = [p for p in sampled.prompts[sampled.rows] for _ in range(num_leaves)]
        metadata = self.prompt_metadata(prompts, sampled.rows, num_leaves)
        rewards, parts, frames = scoring.score(
            self.reward, images, leaf_prompts, f"at iteration {iteration}", metadata
        )
        rewards = rewards.reshape(len(sampled.prompts), num_leaves)
        sampled = node_scoring.with_node_values(self, sampled, prompts, iteration)
        timings["time_reward"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        state, update_metrics = self.update(state, sampled, rewards, iteration, shuffle_key)
        timings["time_update"] = time.perf_counter() - t2
        timings["time_iteration"] = time.perf_counter() - t0
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **{f"reward_{n}": float(v.mean()) for n, v in parts.items() if len(parts) > 1},
            **reporting.frame_rewards(frames),
            **update_metrics,
            **node_scoring.node_metrics(self, sampled),
            "window_start": self.window_start(iteration),
            **timings,
        }
        return state, metrics

    def program_inputs(self) -> tuple[jax.Array, tuple]:
        """What the run passes its programs besides the state: a prompt batch's conditioning
        (split over the mesh) and the evaluation's arguments after the weights
        (`Evaluator.sampler_args`)."""
        c = self.config
        texts, metadata = self.host_state.prompts.prompts, self.host_state.prompts.metadata
        picked = [i % len(texts) for i in range(c.prompts.batch_size * jax.process_count())]
        rows = sharding.process_rows(len(picked))
        batch, batch_metadata = [texts[i] for i in picked], [metadata[i] for i in picked]
        mine = encode_prompts(self.model, batch[rows], batch_metadata[rows])
        cond = sharding.global_batch(self.mesh, mine)
        eval_rows = (*self.evaluator.inputs(), self.evaluator.inputs_metadata())
        _, _, eval_args = self.evaluator.sampler_args(*eval_rows)
        return cond, eval_args

    def lower_programs(self, state, cond, eval_args, accumulating=False, export=False):
        """The programs the run calls, lowered for `state`, the prompt batch's conditioning
        `cond` (split over the mesh) and the evaluation's arguments after the weights (see
        `Evaluator.sampler_args`): arrays, or shapes that carry their shardings (the memory
        plan). Yields (name, lowered) as each is ready: "rollout", "evaluate" and either
        "train_step" or, for a run with `train.updates_per_iteration` and when `accumulating`,
        "accumulate" and "apply". `export=True` first exports each of the three
        (`jax.export`), keeps it in `programs` and lowers that: the program store's programs
        (`run.program_store`)."""
        c = self.config
        weights = state.params
        if self.adapter is not None:  # the base with the factors, laid out as the params are
            adapter = self.adapter
            weights = jax.eval_shape(
                lambda base, p: dataclasses.replace(adapter, base=base).weights(p),
                adapter.base,
                state.params,
            )
            weights = jax.tree_util.tree_map(
                lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                weights,
                sharding.param_shardings(self.mesh, weights),
            )
        key = jax.random.split(jax.random.fold_in(self.key, 0))[0]

        def staged(name, stage):  # stage(lower=..., export=...): the program lowered or exported
            if export:
                self.programs.update(exported_program(name, lambda: stage(export=True)))
            return stage(lower=True)

        first = staged("rollout", lambda **s: self._rollout_program(weights, cond, key, 0, **s))
        yield "rollout", first
        sample, kl = self.evaluator.sampler_program, self.evaluator.kl_reference is not None
        yield "evaluate", staged("evaluate", lambda **s: sample(weights, eval_args, kl, **s))
        rest = (self._zero_minibatch(first.out_info), self._train_cond_like(cond), self.schedule())
        lr = jnp.float32(learning_rate(c.train, 0))
        if not c.train.updates_per_iteration:

            def step(lower=False, export=False):
                stored = self.programs.get("train_step", self.train_step)
                staging = jax.export.export(self.train_step) if export else stored.lower
                return staging(state, *self.step_args(*rest, lr))

            yield "train_step", staged("train_step", step)
        elif accumulating:
            step = self.accumulating
            acc = jax.eval_shape(step.start, state)
            yield "accumulate", step.accumulate.lower(acc, state, *self.step_args(*rest))
            yield "apply", step.apply.lower(state, acc, lr)

    def _train_cond_like(self, cond):
        """The train step's conditioning for a prompt batch's `cond`: replicated, with
        replay the held iterations' batches after it (`ReplayBuffer.train_cond`)."""
        if self.host_state.replay is not None:
            shape = self.host_state.replay.cond_shape(cond.shape)
            cond = jax.ShapeDtypeStruct(shape, cond.dtype)
        return sharding.replicate_like(self.mesh, cond)

    def _zero_minibatch(self, tree):
        """The shapes of a minibatch as `transitions.minibatches` cuts them from `tree`
        (shapes), split over the mesh as `update` lays it out (every process's rows)."""
        k = max((seg.k for seg in tree.segments), default=1)
        batch = self.method.objective.zero_rows(
            self.config,
            self.config.train.rows_per_minibatch,
            tree.leaves.shape[2:],
            k,
            tree.leaves.dtype,
            make=jax.ShapeDtypeStruct,
        )
        split = sharding.batch_sharding(self.mesh)
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split), batch
        )

    def reseed(self, seed: int) -> Trainer:
        """The same trainer started over with `seed`: its own key, prompt order and a fresh
        stat tracker; the model and the compiled step are shared."""
        config = self.config.copy_and_resolve_references()
        config.seed = seed
        return dataclasses.replace(
            self,
            config=config,
            host_state=HostState.fresh(config, self.method),
            key=jax.random.PRNGKey(seed),
        )
