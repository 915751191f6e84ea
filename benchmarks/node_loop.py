"""The batched engine against a node-at-a-time rollout of the same tree.

The official TreeGRPO and BranchGRPO codes expand a tree one node per denoiser call (batch
size 1, classifier-free guidance as a batch of two), with a Python queue over the nodes.
`node_loop_rollout` does that here, with the denoiser call and the sampling step of one node
jitted (so what is compared is batching, not jit): it is the same tree, drawn from the same
noise, and its leaves are checked against the engine's. The per-node noise is sliced out
before the clock starts, which only helps the loop.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import fmt_stats, markdown_table, stats, timed
from tree_grpo_jax.core import rollout, sampling
from tree_grpo_jax.core.guidance import guided_prediction
from tree_grpo_jax.core.tree_spec import Kind, TreeSpec


@functools.lru_cache(maxsize=8)
def node_functions(denoise_fn, event_ndim: int, reduce: str = "mean"):
    """(ode_node, stochastic_node): one node's denoiser call and step, jitted."""

    def predict(params, schedule, x, i, cond, uncond, guidance_scale):
        t = jnp.broadcast_to(schedule.timesteps[i], (x.shape[0],))
        return guided_prediction(denoise_fn, params, x, t, cond, uncond, guidance_scale)

    @jax.jit
    def ode_node(params, schedule, x, i, cond, uncond, guidance_scale):
        pred = predict(params, schedule, x, i, cond, uncond, guidance_scale)
        return schedule.deterministic_step(i, x, pred)

    @functools.partial(jax.jit, static_argnames=("noise_scale",))
    def stochastic_node(params, schedule, x, i, cond, uncond, guidance_scale, noise, noise_scale):
        pred = predict(params, schedule, x, i, cond, uncond, guidance_scale)
        # x, pred [1, *S] against noise [k, *S]: the node's k children.
        out = sampling.sample_step(
            schedule, i, x, pred, noise, event_ndim=event_ndim, noise_scale=noise_scale,
            reduce=reduce,
        )  # fmt: skip
        return out.sample, out.log_prob

    return ode_node, stochastic_node


def engine_noise(key, spec: TreeSpec, num_prompts: int, sample_shape, window_start: int = 0):
    """The roots and every stochastic step's noise exactly as the engine draws them."""
    return rollout.noise_by_step(key, spec, num_prompts, sample_shape, window_start)


def per_node_inputs(roots, step_noise, spec: TreeSpec, cond):
    """Everything the loop indexes, sliced per node ahead of the clock."""
    num_prompts = roots.shape[0]
    root_list = [[roots[p, j][None] for j in range(spec.num_trees)] for p in range(num_prompts)]
    noise = {
        (i, p, j): step_noise[i][p, j]
        for i in step_noise
        for p in range(num_prompts)
        for j in range(spec.nodes_in[i])
    }
    conds = [cond[p][None] for p in range(num_prompts)]
    return jax.block_until_ready((root_list, noise, conds))


def node_loop_rollout(fns, params, schedule, spec: TreeSpec, roots, noise, conds, uncond, scale):
    """Expands the tree node by node with a FIFO queue; returns (leaves [P, L, *S], calls)."""
    ode_node, stochastic_node = fns
    num_prompts = len(conds)
    leaves = [[None] * spec.leaves for _ in range(num_prompts)]
    queue = collections.deque(
        (p, 0, j, roots[p][j]) for p in range(num_prompts) for j in range(spec.num_trees)
    )
    log_probs, calls = [], 0
    while queue:
        p, i, j, x = queue.popleft()
        if i == spec.num_steps:
            leaves[p][j] = x
            continue
        step = spec.steps[i]
        calls += 1
        if step.kind is Kind.ODE:
            queue.append((p, i + 1, j, ode_node(params, schedule, x, i, conds[p], uncond, scale)))
            continue
        children, log_prob = stochastic_node(
            params, schedule, x, i, conds[p], uncond, scale, noise[(i, p, j)], step.noise_scale
        )
        log_probs.append(log_prob)
        for c in range(step.k):
            queue.append((p, i + 1, j * step.k + c, children[c : c + 1]))
    out = jnp.stack([jnp.concatenate(row) for row in leaves])
    return jax.block_until_ready((out, log_probs))[0], calls


def compare(
    denoise_fn,
    params,
    cond,
    schedule,
    spec: TreeSpec,
    sample_shape,
    *,
    uncond=None,
    guidance_scale: float = 1.0,
    reps: int = 5,
    seed: int = 0,
    engine: Callable[[jax.Array], jax.Array] | None = None,
    window_start: int = 0,
) -> dict:
    """Times the engine and the node loop on one tree, interleaved, `reps` times each after
    one untimed (compiling) call of each; checks that both give the same leaves.

    `engine(key)`, when given, is the batched side (e.g. a trainer's own rollout, leaves
    [P, L, *S]) in place of `rollout.rollout`; the loop walks `spec` at `window_start`."""
    key = jax.random.PRNGKey(seed)
    num_prompts = cond.shape[0]
    scale = jnp.float32(guidance_scale)
    fns = node_functions(denoise_fn, len(sample_shape))
    plain = spec.at(window_start)
    roots, step_noise = engine_noise(key, spec, num_prompts, sample_shape, window_start)
    roots, noise, conds = per_node_inputs(roots, step_noise, plain, cond)

    def batched():
        if engine is not None:
            return engine(key)
        return rollout.rollout(
            denoise_fn, params, cond, key, schedule, spec=spec, sample_shape=tuple(sample_shape),
            uncond=uncond, guidance_scale=scale, window_start=window_start,
        ).leaves  # fmt: skip

    def loop():
        return node_loop_rollout(fns, params, schedule, plain, roots, noise, conds, uncond, scale)

    compile_engine, engine_leaves = timed(batched)
    compile_loop, (loop_leaves, calls) = timed(loop)
    # On the host: the engine's leaves may be spread over several devices, the loop's on one.
    engine_leaves = np.asarray(engine_leaves, np.float32)
    diff = float(np.max(np.abs(engine_leaves - np.asarray(loop_leaves, np.float32))))
    scale_ref = float(np.max(np.abs(engine_leaves)))
    t_engine, t_loop = [], []
    for _ in range(reps):
        t_engine.append(timed(batched)[0])
        t_loop.append(timed(loop)[0])
    guidance = uncond is not None
    rows = plain.rollout_denoiser_calls(guidance) * num_prompts
    return {
        "spec": plain.describe(),
        "prompts": num_prompts,
        "leaves_per_prompt": plain.leaves,
        "guidance": guidance,
        "engine_denoiser_calls": spec.num_steps,
        "loop_denoiser_calls": calls,
        "denoiser_rows": rows,
        "engine_s": stats(t_engine),
        "loop_s": stats(t_loop),
        "speedup": stats([b / a for a, b in zip(t_engine, t_loop)]),
        "speedup_of_medians": float(np.median(t_loop) / np.median(t_engine)),
        "engine_rows_per_s": rows / float(np.median(t_engine)),
        "loop_rows_per_s": rows / float(np.median(t_loop)),
        "first_call_s": {"engine": compile_engine, "loop": compile_loop},
        "max_abs_leaf_difference": diff,
        "max_abs_leaf": scale_ref,
        "same_leaves": bool(diff <= 1e-3 * max(1.0, scale_ref)),
    }


def table(results: dict) -> str:
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                r["spec"].split(": ", 1)[1],
                r["prompts"],
                "yes" if r["guidance"] else "no",
                f"{r['engine_denoiser_calls']} / {r['loop_denoiser_calls']}",
                fmt_stats(r["engine_s"]),
                fmt_stats(r["loop_s"]),
                f"{r['speedup_of_medians']:.1f}x",
                fmt_stats(r["speedup"], 1),
                f"{r['max_abs_leaf_difference']:.1e}",
            ]
        )
    header = [
        "tree",
        "spec (per prompt)",
        "prompts",
        "guidance",
        "denoiser calls engine / loop",
        "engine s",
        "node loop s",
        "speedup (ratio of medians)",
        "paired speedup [min, max]",
        "max leaf difference",
    ]
    return markdown_table(header, rows)
