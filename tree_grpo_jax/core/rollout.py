"""The batched tree rollout engine.

The live nodes of a level are one array `[prompts, nodes, *sample_shape]`. The spec's
`blocks` are the program: an ODE block is one loop, a stochastic block (a run of SDE steps,
or one BRANCH(k) step) is one segment of the tree. A BRANCH(k) step computes the level's
Gaussian once and broadcasts it along a new child axis, so a shared prefix is never
recomputed. The static Python loop is over the blocks, a handful per tree.

The window position is data. For a sliding-window spec (`spec.sliding`) the blocks' bounds
move with `window_start`, an int32 argument: the ODE steps before and after the window are
loops with dynamic bounds, and the window's steps run at dynamic step indices with fixed
shapes (TreeGRPO, MixGRPO); or, with BRANCH steps fixed in the spec (BranchGRPO-Mix), every
non-branch step is recorded and is stochastic or deterministic by a flag computed from the
window start. Either way one compiled rollout serves every window position.

Noise: the roots come from one draw and all stochastic steps' noise from one more, cut into
the segments in order (`segment_noise`), so the same key and spec give the same tree.

What comes back is the tree as the trainer needs it: for every segment, the parent states,
the children drawn from them (node j's children at j*k .. j*k + k - 1), the children's
log-probs under the sampling parameters, and the step indices as data; and the leaves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tree_grpo_jax.core import sampling
from tree_grpo_jax.core.guidance import DenoiseFn, PyTree, guided_prediction, traced_once
from tree_grpo_jax.core.tree_spec import Block, TreeSpec

# How a split child's log-prob is computed. "sampled" (default): under the Gaussian it was
# drawn from, std widened by the split's noise_scale. "unscaled": under the unscaled std,
# as BranchGRPO's released code does; the loss follows through the transitions' noise_scale.
SPLIT_LOG_PROBS = ("sampled", "unscaled")
# Which segments keep their parents' x0 estimates (node rewards): none, every stochastic
# step's ("all_steps") or only the BRANCH steps' ("branch_points").
X0_RECORDS = ("none", "all_steps", "branch_points")


@struct.dataclass
class Segment:
    """T stochastic steps with the same node count (a run of SDE steps, or one BRANCH step).

    parents:   [T, P, n, *S]      the states the steps start from
    children:  [T, P, n * k, *S]  the sampled next states (the actions)
    log_probs: [T, P, n * k]      log-prob of each child under the rollout's parameters
    steps:     [T] int32          the step index of each of the T steps (data: it moves
                                  with a sliding window)
    active:    [T] bool           True where the step was stochastic; False only in the
                                  mixed segments of BranchGRPO-Mix, for steps outside the
                                  window (deterministic: children = the ODE step, log-prob 0,
                                  never trained)

    k, noise_scale: the step's children per parent and std multiplier used to draw them;
    score_scale: the std multiplier of `log_probs` (noise_scale, or 1 with
    split_log_prob="unscaled"); level: the structural level of the children (the number of
    BRANCH steps at or before this segment), which is all the advantages need.

    means:     [T, P, n, *S]      the step Gaussian's mean at each parent under the rollout's
                                  parameters, recorded only when the rollout is asked to
                                  (`record_means`: GRPO-Guard's ratio normalisation); else None
    x0_hats:   [T, P, n, *S]      Tweedie's estimate of the clean sample at each parent, from
                                  the prediction the step already made (`record_x0`: node
                                  rewards); else None
    """

    parents: jax.Array
    children: jax.Array
    log_probs: jax.Array
    steps: jax.Array
    active: jax.Array
    k: int = struct.field(pytree_node=False)
    noise_scale: float = struct.field(pytree_node=False)
    score_scale: float = struct.field(pytree_node=False)
    level: int = struct.field(pytree_node=False)
    means: jax.Array | None = None
    x0_hats: jax.Array | None = None

    @property
    def num_steps(self) -> int:
        return self.parents.shape[0]

    @property
    def step_indices(self) -> np.ndarray:
        """The step indices on the host (not under a trace)."""
        return np.asarray(self.steps)

    @property
    def first_step(self) -> int:
        """The first step index on the host (not under a trace)."""
        return int(np.asarray(self.steps)[0])


@struct.dataclass
class Tree:
    segments: tuple[Segment, ...]  # in step order, one per segment block of the spec
    leaves: jax.Array  # [P, leaves, *S]


# ---------------------------------------------------------------------------------------------
# Noise.


def split_rollout_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(key for the roots, key for every stochastic step's noise)."""
    init_key, noise_key = jax.random.split(key)
    return init_key, noise_key


def initial_noise(key: jax.Array, num_prompts: int, spec: TreeSpec, sample_shape) -> jax.Array:
    """The roots, [P, num_trees, *S]; with shared noise every tree of a prompt starts alike."""
    trees = 1 if spec.shared_init_noise else spec.num_trees
    noise = jax.random.normal(key, (num_prompts, trees, *sample_shape), jnp.float32)
    return jnp.broadcast_to(noise, (num_prompts, spec.num_trees, *sample_shape))


def segment_noise_shapes(spec: TreeSpec, num_prompts: int, sample_shape) -> list[tuple]:
    """[T, P, n, k, *S] for each segment, in order."""
    return [
        (b.num_steps, num_prompts, b.nodes_in, b.step.k, *sample_shape) for b in spec.segment_blocks
    ]


def segment_noise(key: jax.Array, spec: TreeSpec, num_prompts: int, sample_shape) -> list:
    """Standard normal noise of every segment, [T, P, n, k, *S] each: one draw of all of it,
    cut in segment order (row-major within a segment). The same for every window position:
    the segments' shapes do not move with the window."""
    shapes = segment_noise_shapes(spec, num_prompts, sample_shape)
    sizes = [math.prod(s) for s in shapes]
    if not sizes:
        return []
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)
    return [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], shapes)]


def noise_by_step(
    key: jax.Array, spec: TreeSpec, num_prompts: int, sample_shape, window_start: int = 0
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """(roots [P, num_trees, *S], {step: noise [P, n, k, *S]}) exactly as the rollout draws
    them with this key, for every step that is stochastic at `window_start`. Host side: for
    references and node-by-node baselines."""
    init_key, noise_key = split_rollout_key(key)
    roots = initial_noise(init_key, num_prompts, spec, sample_shape)
    plain = spec.at(window_start)
    stochastic = set(plain.trainable_steps)
    out = {}
    for block, noise in zip(
        spec.segment_blocks, segment_noise(noise_key, spec, num_prompts, sample_shape)
    ):
        begin, _ = block.bounds(int(window_start))
        for t in range(block.num_steps):
            if begin + t in stochastic:
                out[begin + t] = noise[t]
    return roots, out


# ---------------------------------------------------------------------------------------------
# The engine.


def _level_prediction(denoise_fn, params, schedule, i, x, cond, uncond, guidance_scale):
    """The denoiser on a whole level [P, n, *S] as one flat batch."""
    num_prompts, n = x.shape[:2]
    flat_x = x.reshape(num_prompts * n, *x.shape[2:])
    flat_t = jnp.full((num_prompts * n,), schedule.timesteps[i])
    flat_cond = jnp.repeat(cond, n, axis=0)
    # The window's first BRANCH step and the ODE steps before it share a width: one trace.
    pred = guided_prediction(
        traced_once(denoise_fn), params, flat_x, flat_t, flat_cond, uncond, guidance_scale
    )
    return pred.reshape(x.shape)


def _draw(schedule, i, x, pred, noise, k, noise_scale, score_scale, event_ndim, reduce):
    """k children per node of a level: (children [P, n*k, *S], log-probs [P, n*k])."""
    num_prompts, n = x.shape[:2]
    # [P, n, 1, *S] against [P, n, k, *S]: one mean per parent, k draws around it.
    out = sampling.sample_step(
        schedule,
        i,
        x[:, :, None],
        pred[:, :, None],
        noise,
        event_ndim=event_ndim,
        noise_scale=noise_scale,
        score_scale=score_scale,
        reduce=reduce,
    )
    children = out.sample.reshape(num_prompts, n * k, *x.shape[2:])
    return children, out.log_prob.reshape(num_prompts, n * k)


def _window_flags(block: Block, spec: TreeSpec, steps: jax.Array, start: jax.Array) -> jax.Array:
    """Which steps of a mixed block are stochastic: the base's SDE steps and the window's."""
    width = spec.window.width
    inside = (steps >= start) & (steps < start + width)
    return inside | jnp.asarray(block.always_stochastic, bool)


class RolloutOptions(NamedTuple):
    """The rollout's static settings besides its spec and denoiser (`rollout`'s keywords)."""

    sample_shape: tuple[int, ...]
    reduce: str
    split_log_prob: str
    record_means: bool
    record_x0: str = "none"  # whose parents' x0 estimates to keep: X0_RECORDS


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
    window_start: jax.Array | int = 0,
    split_log_prob: str = "sampled",
    lower: bool = False,
    record_means: bool = False,
    record_x0: str = "none",
    export: bool = False,
    program: Callable | None = None,
) -> Tree:
    """Rolls out `spec.num_trees` trees for each of the P prompts in `cond` [P, L, D].

    Guidance is on when `uncond` ([L, D]) is given. `window_start` (an int or an int32
    array) places the window of a sliding-window spec and is ignored by other specs; a
    Python int is checked against the spec, a traced one is clipped into range.
    `split_log_prob` is "sampled" (score split children under the widened Gaussian they were
    drawn from) or "unscaled" (under the unscaled std, BranchGRPO's released code).
    `record_means` keeps each parent's step mean in its segment (`Segment.means`);
    `record_x0` each parent's x0 estimate (`Segment.x0_hats`) in every segment
    ("all_steps") or in the BRANCH steps' ("branch_points"): no extra denoiser rows.

    Compiles once per spec, batch shape, denoiser and options, for every window position;
    the same key gives the same tree. `lower=True` returns the program lowered for these
    arguments instead (`.compile()` it ahead: a later call of the same shapes reuses it),
    `export=True` the program exported (`jax.export`); `program`, such a program made ahead
    (`run.program_store.StoredProgram`: its static arguments are part of it), is called (or
    lowered) with the arguments in place of tracing `_rollout`.
    """
    chex.assert_rank(cond, 3)
    if schedule.num_steps != spec.num_steps:
        raise ValueError(
            f"the schedule has {schedule.num_steps} steps but the tree spec has {spec.num_steps}."
        )
    if split_log_prob not in SPLIT_LOG_PROBS:
        raise ValueError(
            f"split_log_prob must be one of {SPLIT_LOG_PROBS}, got {split_log_prob!r}."
        )
    if record_x0 not in X0_RECORDS:
        raise ValueError(f"record_x0 must be one of {X0_RECORDS}, got {record_x0!r}.")
    if spec.sliding and not isinstance(window_start, jax.core.Tracer):
        spec.at(int(window_start))  # raises SpecError for a window that does not fit
    options = RolloutOptions(tuple(sample_shape), reduce, split_log_prob, record_means, record_x0)
    arguments = (
        params,
        cond,
        key,
        schedule,
        jnp.asarray(window_start, jnp.int32),
        uncond,
        guidance_scale,
    )
    if program is not None:
        return (program.lower if lower else program)(*arguments)
    return staged(_rollout, lower, export)(denoise_fn, *arguments, spec=spec, options=options)


@functools.partial(jax.jit, static_argnames=("denoise_fn", "spec", "options"))
def _rollout(
    denoise_fn,
    params,
    cond,
    key,
    schedule,
    window_start,
    uncond,
    guidance_scale,
    *,
    spec: TreeSpec,
    options: RolloutOptions,
) -> Tree:
    num_prompts = cond.shape[0]
    start = jnp.clip(window_start, 0, spec.window_positions - 1)
    init_key, noise_key = split_rollout_key(key)
    noises = segment_noise(noise_key, spec, num_prompts, options.sample_shape)
    predict = functools.partial(_level_prediction, denoise_fn, params, schedule)

    def level_predict(i, x):
        return predict(i, x, cond, uncond, guidance_scale)

    def ode_body(i, x):
        return schedule.deterministic_step(i, x, level_predict(i, x))

    x = initial_noise(init_key, num_prompts, spec, options.sample_shape)
    segments = []
    for block in spec.blocks:
        begin, end = block.bounds(start)
        if block.kind == "ode":
            static = isinstance(begin, int) and isinstance(end, int)
            if not (static and begin >= end):
                x = jax.lax.fori_loop(begin, end, ode_body, x)
            continue
        noise = noises[len(segments)]
        x, segment = _segment(block, spec, begin, start, x, noise, level_predict, schedule, options)
        segments.append(segment)

    chex.assert_shape(x, (num_prompts, spec.leaves, *options.sample_shape))
    return Tree(segments=tuple(segments), leaves=x)


def moving_ode_trips(spec: TreeSpec, window_start: int) -> tuple[int, ...]:
    """The steps each ODE loop of `_rollout` whose bounds move with the window runs at
    `window_start`, in the order it runs them: the trip counts a compiled rollout cannot
    know, since the window's position is its argument."""
    start = min(max(window_start, 0), spec.window_positions - 1)
    trips = []
    for block in spec.blocks:
        if block.kind == "ode" and (block.begin_moves or block.end_moves):
            begin, end = block.bounds(start)
            trips.append(max(end - begin, 0))
    return tuple(trips)


def _segment(block, spec, begin, start, x, noise, level_predict, schedule, options):
    """One stochastic block from the level `x`, its first step at `begin`: (the level after
    it, its `Segment`). `level_predict(i, x)` is the denoiser's prediction of a level."""
    step = block.step
    score_scale = step.noise_scale if options.split_log_prob == "sampled" else 1.0
    steps = begin + jnp.arange(block.num_steps, dtype=jnp.int32)
    draw = functools.partial(
        _draw,
        schedule,
        k=step.k,
        noise_scale=step.noise_scale,
        score_scale=score_scale,
        event_ndim=len(options.sample_shape),
        reduce=options.reduce,
    )

    def step_mean(i, x, pred):
        """The parents' step mean (XLA shares it with the draw's), or None unrecorded."""
        return schedule.transition(i, x, pred)[0] if options.record_means else None

    keeps_x0 = options.record_x0 == "all_steps" or (
        options.record_x0 == "branch_points" and step.k > 1
    )

    def step_x0(i, x, pred):
        """The parents' x0 estimate from the prediction already made, or None unrecorded."""
        return schedule.predict_x0(i, x, pred) if keeps_x0 else None

    if block.kind == "stochastic":
        active = jnp.ones((block.num_steps,), bool)

        def body(x, inputs):
            i, noise, _ = inputs
            pred = level_predict(i, x)
            children, log_probs = draw(i, x, pred, noise)
            record = (x, children, log_probs)
            return children, (*record, step_mean(i, x, pred), step_x0(i, x, pred))

    else:  # mixed: stochastic inside the window, deterministic outside
        active = _window_flags(block, spec, steps, start)

        def body(x, inputs):
            i, noise, stochastic = inputs
            pred = level_predict(i, x)
            drawn, log_probs = draw(i, x, pred, noise)
            children = jnp.where(stochastic, drawn, schedule.deterministic_step(i, x, pred))
            record = (x, children, jnp.where(stochastic, log_probs, 0.0))
            return children, (*record, step_mean(i, x, pred), step_x0(i, x, pred))

    inputs = (steps, noise, active)
    if block.num_steps == 1:  # a BRANCH step changes the level's size: no scan
        x, record = body(x, jax.tree_util.tree_map(lambda a: a[0], inputs))
        record = jax.tree_util.tree_map(lambda a: a[None], record)
    else:
        x, record = jax.lax.scan(body, x, inputs)
    parents, children, log_probs, means, x0_hats = record
    segment = Segment(
        parents,
        children,
        log_probs,
        steps,
        active,
        k=step.k,
        noise_scale=step.noise_scale,
        score_scale=score_scale,
        level=block.level,
        means=means,
        x0_hats=x0_hats,
    )
    return x, segment


def sample_deterministic(
    denoise_fn: DenoiseFn,
    params: PyTree,
    cond: jax.Array,
    noise: jax.Array,
    schedule: sampling.Schedule,
    *,
    uncond: jax.Array | None = None,
    guidance_scale: jax.Array | float = 1.0,
    lower: bool = False,
    export: bool = False,
    program: Callable | None = None,
) -> jax.Array:
    """The deterministic sampler (DDIM eta 0 / Euler) from given noise [P, *S]: evaluation.
    `lower`, `export` and `program` as in `rollout`."""
    arguments = (params, cond, noise, schedule, uncond, guidance_scale)
    if program is not None:
        return (program.lower if lower else program)(*arguments)
    return staged(_sample_deterministic, lower, export)(denoise_fn, *arguments)


def staged(jitted, lower: bool = False, export: bool = False):
    """A jitted function, its `lower`, or its `jax.export` exporter (all called alike)."""
    if export:
        return jax.export.export(jitted)
    return jitted.lower if lower else jitted


@functools.partial(jax.jit, static_argnums=(0,))
def _sample_deterministic(denoise_fn, params, cond, noise, schedule, uncond, guidance_scale):
    def body(x, i):
        t = jnp.full((x.shape[0],), schedule.timesteps[i])
        pred = guided_prediction(denoise_fn, params, x, t, cond, uncond, guidance_scale)
        return schedule.deterministic_step(i, x, pred), None

    x, _ = jax.lax.scan(body, noise.astype(jnp.float32), jnp.arange(schedule.num_steps))
    return x


@functools.partial(jax.jit, static_argnums=(0,))
def sample_with_kl(denoise_fn, params, ref_params, cond, noise, schedule, uncond, guidance_scale):
    """The deterministic sampler from `noise` under `params`, and per sample the mean over
    its steps of KL(policy step || reference step) at the states it passes: both are the
    SDE step's Gaussians with the same std, so KL = |mean - ref_mean|^2 / (2 std^2) summed
    over the sample's dimensions."""
    event_axes = tuple(range(1, noise.ndim))

    def body(x, i):
        t = jnp.full((x.shape[0],), schedule.timesteps[i])
        pred = guided_prediction(denoise_fn, params, x, t, cond, uncond, guidance_scale)
        ref = guided_prediction(denoise_fn, ref_params, x, t, cond, uncond, guidance_scale)
        mean, std = schedule.transition(i, x, pred)
        ref_mean, _ = schedule.transition(i, x, ref)
        std = jnp.broadcast_to(std, mean.shape)
        per_dim = jnp.where(
            std > 0, (mean - ref_mean) ** 2 / (2.0 * jnp.maximum(std, 1e-30) ** 2), 0.0
        )
        return schedule.deterministic_step(i, x, pred), jnp.sum(per_dim, axis=event_axes)

    x, kl = jax.lax.scan(body, noise.astype(jnp.float32), jnp.arange(schedule.num_steps))
    return x, kl.mean(axis=0)
