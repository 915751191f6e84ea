"""The batched tree rollout engine.

The live nodes of a level are one array `[prompts, nodes, *sample_shape]`. Runs of identical
ODE or SDE steps are one `lax.scan`; a BRANCH(k) step computes the level's Gaussian once and
broadcasts it along a new child axis, so a shared prefix is never recomputed. The static
Python loop is over the spec's runs, a handful per tree.

What comes back is the tree as the trainer needs it: for every stochastic step, the parent
states, the children drawn from them (node j's children at j*k .. j*k + k - 1), and the
children's log-probs under the sampling parameters; and the leaves.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax import sampling
from tree_grpo_jax.guidance import guided_prediction
from tree_grpo_jax.models.base import DenoiseFn, PyTree
from tree_grpo_jax.tree_spec import Kind, Step, TreeSpec


@struct.dataclass
class Segment:
    """T consecutive stochastic steps with the same node count (or one BRANCH step).

    parents:   [T, P, n, *S]      the states the steps start from
    children:  [T, P, n * k, *S]  the sampled next states (the actions)
    log_probs: [T, P, n * k]      log-prob of each child under the rollout's parameters
    """

    parents: jax.Array
    children: jax.Array
    log_probs: jax.Array
    first_step: int = struct.field(pytree_node=False)
    k: int = struct.field(pytree_node=False)
    noise_scale: float = struct.field(pytree_node=False)

    @property
    def num_steps(self) -> int:
        return self.parents.shape[0]

    @property
    def step_indices(self) -> np.ndarray:
        return np.arange(self.first_step, self.first_step + self.num_steps)


@struct.dataclass
class Tree:
    segments: tuple[Segment, ...]  # in step order, one per stochastic run of the spec
    leaves: jax.Array  # [P, leaves, *S]


def initial_noise(key: jax.Array, num_prompts: int, spec: TreeSpec, sample_shape) -> jax.Array:
    """The roots, [P, num_trees, *S]; with shared noise every tree of a prompt starts alike."""
    trees = 1 if spec.shared_init_noise else spec.num_trees
    noise = jax.random.normal(key, (num_prompts, trees, *sample_shape), jnp.float32)
    return jnp.broadcast_to(noise, (num_prompts, spec.num_trees, *sample_shape))


def step_noise(key: jax.Array, step_index, shape) -> jax.Array:
    """Standard normal noise of step `step_index`, shaped [P, n, k, *S]."""
    return jax.random.normal(jax.random.fold_in(key, step_index), shape, jnp.float32)


def split_rollout_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(key for the roots, key folded with the step index for each step's noise)."""
    init_key, step_key = jax.random.split(key)
    return init_key, step_key


def _level_prediction(denoise_fn, params, schedule, i, x, cond, uncond, guidance_scale):
    """The denoiser on a whole level [P, n, *S] as one flat batch."""
    num_prompts, n = x.shape[:2]
    flat_x = x.reshape(num_prompts * n, *x.shape[2:])
    flat_t = jnp.full((num_prompts * n,), schedule.timesteps[i])
    flat_cond = jnp.repeat(cond, n, axis=0)
    pred = guided_prediction(denoise_fn, params, flat_x, flat_t, flat_cond, uncond, guidance_scale)
    return pred.reshape(x.shape)


def _stochastic_step(predict, schedule, step: Step, step_key, i, x, event_ndim, reduce):
    """One SDE/BRANCH step on a level: (children [P, n*k, *S], log-probs [P, n*k])."""
    num_prompts, n = x.shape[:2]
    sample_shape = x.shape[2:]
    pred = predict(i, x)
    noise = step_noise(step_key, i, (num_prompts, n, step.k, *sample_shape))
    # [P, n, 1, *S] against [P, n, k, *S]: one mean per parent, k draws around it.
    out = sampling.sample_step(
        schedule,
        i,
        x[:, :, None],
        pred[:, :, None],
        noise,
        event_ndim=event_ndim,
        noise_scale=step.noise_scale,
        reduce=reduce,
    )
    children = out.sample.reshape(num_prompts, n * step.k, *sample_shape)
    return children, out.log_prob.reshape(num_prompts, n * step.k)


@functools.partial(jax.jit, static_argnames=("denoise_fn", "spec", "sample_shape", "reduce"))
def rollout(
    denoise_fn: DenoiseFn,
    params: PyTree,
    cond: jax.Array,
    key: jax.Array,
    schedule: sampling.Schedule,
    *,
    spec: TreeSpec,
    sample_shape: tuple[int, ...],
    uncond: jax.Array | None = None,
    guidance_scale: jax.Array | float = 1.0,
    reduce: str = "mean",
) -> Tree:
    """Rolls out `spec.num_trees` trees for each of the P prompts in `cond` [P, L, D].

    Guidance is on when `uncond` ([L, D]) is given. Compiles once per spec, batch shape and
    denoiser; the same key gives the same tree.
    """
    chex.assert_rank(cond, 3)
    if schedule.num_steps != spec.num_steps:
        raise ValueError(
            f"the schedule has {schedule.num_steps} steps but the tree spec has {spec.num_steps}."
        )
    num_prompts = cond.shape[0]
    event_ndim = len(sample_shape)
    init_key, step_key = split_rollout_key(key)
    predict = functools.partial(_level_prediction, denoise_fn, params, schedule)

    def level_predict(i, x):
        return predict(i, x, cond, uncond, guidance_scale)

    x = initial_noise(init_key, num_prompts, spec, sample_shape)
    segments = []
    for run in spec.runs:
        steps = jnp.arange(run.first_step, run.first_step + run.num_steps)
        if run.step.kind is Kind.ODE:

            def ode_body(x, i):
                return schedule.deterministic_step(i, x, level_predict(i, x)), None

            x, _ = jax.lax.scan(ode_body, x, steps)
            continue

        def stochastic_body(x, i, step=run.step):
            children, log_probs = _stochastic_step(
                level_predict, schedule, step, step_key, i, x, event_ndim, reduce
            )
            return children, (x, children, log_probs)

        if run.step.kind is Kind.BRANCH:  # changes the level's size: no scan, one step
            x, record = stochastic_body(x, run.first_step)
            record = jax.tree_util.tree_map(lambda a: a[None], record)
        else:
            x, record = jax.lax.scan(stochastic_body, x, steps)
        parents, children, log_probs = record
        segments.append(
            Segment(parents, children, log_probs, run.first_step, run.step.k, run.step.noise_scale)
        )

    chex.assert_shape(x, (num_prompts, spec.leaves, *sample_shape))
    return Tree(segments=tuple(segments), leaves=x)


def sample_deterministic(
    denoise_fn: DenoiseFn,
    params: PyTree,
    cond: jax.Array,
    noise: jax.Array,
    schedule: sampling.Schedule,
    *,
    uncond: jax.Array | None = None,
    guidance_scale: jax.Array | float = 1.0,
) -> jax.Array:
    """The deterministic sampler (DDIM eta 0 / Euler) from given noise [P, *S]: evaluation."""
    return _sample_deterministic(denoise_fn, params, cond, noise, schedule, uncond, guidance_scale)


@functools.partial(jax.jit, static_argnums=(0,))
def _sample_deterministic(denoise_fn, params, cond, noise, schedule, uncond, guidance_scale):
    def body(x, i):
        t = jnp.full((x.shape[0],), schedule.timesteps[i])
        pred = guided_prediction(denoise_fn, params, x, t, cond, uncond, guidance_scale)
        return schedule.deterministic_step(i, x, pred), None

    x, _ = jax.lax.scan(body, noise.astype(jnp.float32), jnp.arange(schedule.num_steps))
    return x
