"""The batched rollout engine against a node-by-node recursion over explicit nodes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusers import FlaxDDIMScheduler

from tree_grpo_jax import guidance, sampling
from tree_grpo_jax import tree_spec as ts
from tree_grpo_jax.rollout import initial_noise, rollout, split_rollout_key, step_noise

SAMPLE_SHAPE = (1, 4, 4)
P, L, D = 2, 3, 5
GUIDANCE = 2.5


def analytic_denoiser(params, x, t, cond):
    """Non-linear in x, depends on the prompt and the timestep: enough to tell nodes apart."""
    c = cond.mean(axis=(1, 2)).reshape(-1, 1, 1, 1)
    return jnp.tanh(params["a"] * x) + params["b"] * c + 1e-3 * t.reshape(-1, 1, 1, 1)


PARAMS = {"a": jnp.float32(0.8), "b": jnp.float32(0.5)}
COND = jax.random.normal(jax.random.PRNGKey(11), (P, L, D))
UNCOND = jax.random.normal(jax.random.PRNGKey(12), (L, D))


@dataclasses.dataclass
class Node:
    state: np.ndarray
    children: list = dataclasses.field(default_factory=list)
    log_prob: float | None = None  # of the edge that produced this node


def _ref_prediction(x, t, p):
    """One node, denoiser called on a batch of one (conditional then unconditional)."""
    xb, tb = jnp.asarray(x[None], jnp.float32), jnp.full((1,), t)
    cond = analytic_denoiser(PARAMS, xb, tb, COND[p][None])
    uncond = analytic_denoiser(PARAMS, xb, tb, UNCOND[None])
    return np.asarray(uncond + GUIDANCE * (cond - uncond), np.float64)[0]


def _ref_ddim(schedule, i, x, eps, eta):
    """DDIM with eta, written from the formulas in float64."""
    a = float(schedule.alpha_bar[i])
    a_prev = float(schedule.alpha_bar_prev[i])
    x0 = (x - np.sqrt(1 - a) * eps) / np.sqrt(a)
    s = eta * np.sqrt((1 - a_prev) / (1 - a)) * np.sqrt(1 - a / a_prev)
    mean = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - s**2) * eps
    return mean, s


def reference_tree(spec, schedule, key, eta):
    """Python recursion over explicit nodes, one denoiser call per node."""
    init_key, step_key = split_rollout_key(key)
    roots_noise = np.asarray(initial_noise(init_key, P, spec, SAMPLE_SHAPE), np.float64)
    level_sizes = spec.nodes_in

    def expand(node, p, j, i):
        """Node j (index within its level) of prompt p, entering step i."""
        if i == spec.num_steps:
            return
        step = spec.steps[i]
        eps = _ref_prediction(node.state, schedule.timesteps[i], p)
        mean, s = _ref_ddim(schedule, i, node.state, eps, 0.0 if step.kind is ts.Kind.ODE else eta)
        if step.kind is ts.Kind.ODE:
            node.children = [Node(mean)]
        else:
            noise = np.asarray(step_noise(step_key, i, (P, level_sizes[i], step.k, *SAMPLE_SHAPE)))
            std = s * step.noise_scale
            for c in range(step.k):
                child = mean + std * noise[p, j, c]
                logp = np.mean(
                    -((child - mean) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi)
                )
                node.children.append(Node(child, log_prob=logp))
        for c, child in enumerate(node.children):
            expand(child, p, j * step.k + c, i + 1)

    roots = [[Node(roots_noise[p, r]) for r in range(spec.num_trees)] for p in range(P)]
    for p in range(P):
        for r, root in enumerate(roots[p]):
            expand(root, p, r, 0)
    return roots


def _levels(roots):
    """Nodes of each level in left-to-right order: level 0 the roots."""
    levels = [list(roots)]
    while levels[-1][0].children:
        levels.append([c for n in levels[-1] for c in n.children])
    return levels


SPECS = [
    ts.treegrpo(5, window=2, k=2, window_start=1),
    ts.branchgrpo(6, (0, 3), k=2, split_noise_scale=1.5, num_trees=2),
    ts.grpo(4, 3, shared_init_noise=True),
    ts.mixgrpo(5, 2, window=2, window_start=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_engine_equals_node_by_node_reference(spec):
    schedule = sampling.make_ddim_schedule(spec.num_steps, eta=1.0)
    key = jax.random.PRNGKey(5)
    tree = rollout(
        analytic_denoiser, PARAMS, COND, key, schedule,
        spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND, guidance_scale=GUIDANCE,
    )  # fmt: skip
    ref = reference_tree(spec, schedule, key, eta=1.0)
    for p in range(P):
        levels = _levels(ref[p])
        leaves = np.stack([n.state for n in levels[-1]])
        np.testing.assert_allclose(tree.leaves[p], leaves, rtol=1e-4, atol=1e-5)
        for seg in tree.segments:
            for t, i in enumerate(seg.step_indices):
                parents = np.stack([n.state for n in levels[i]])
                children = np.stack([n.state for n in levels[i + 1]])
                logps = np.array([n.log_prob for n in levels[i + 1]])
                np.testing.assert_allclose(seg.parents[t, p], parents, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(seg.children[t, p], children, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(seg.log_probs[t, p], logps, rtol=1e-4, atol=1e-4)


def test_shared_ancestors_and_distinct_siblings():
    spec = ts.treegrpo(6, window=3, k=2, window_start=1)
    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    tree = rollout(
        analytic_denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(1),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
    )
    segments = tree.segments
    for prev, nxt in zip(segments, segments[1:]):
        # The next level starts exactly from the previous level's children: one shared state.
        np.testing.assert_array_equal(prev.children[-1], nxt.parents[0])
    for seg in segments:
        kids = np.asarray(seg.children[0]).reshape(P, -1, seg.k, *SAMPLE_SHAPE)
        assert not np.any(np.all(np.isclose(kids[:, :, 0], kids[:, :, 1]), axis=(-1, -2, -3)))
    assert tree.leaves.shape == (P, 8, *SAMPLE_SHAPE)


def test_eta_zero_without_branches_equals_plain_ddim_loop():
    num_steps = 6
    scheduler = FlaxDDIMScheduler.from_config(
        dict(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            steps_offset=1,
            set_alpha_to_one=False,
            clip_sample=False,
        )
    )
    state = scheduler.set_timesteps(scheduler.create_state(), num_steps)
    key = jax.random.PRNGKey(3)
    for spec, eta in [
        (ts.deterministic(num_steps, num_trees=2), 1.0),
        (ts.grpo(num_steps, 2), 0.0),
    ]:
        schedule = sampling.make_ddim_schedule(num_steps, eta=eta)
        tree = rollout(
            analytic_denoiser, PARAMS, COND, key, schedule, spec=spec, sample_shape=SAMPLE_SHAPE
        )
        x = np.asarray(initial_noise(split_rollout_key(key)[0], P, spec, SAMPLE_SHAPE)).reshape(
            P * 2, *SAMPLE_SHAPE
        )
        cond = jnp.repeat(COND, 2, axis=0)
        for t in np.asarray(state.timesteps):
            eps = analytic_denoiser(PARAMS, jnp.asarray(x), jnp.full((P * 2,), t), cond)
            x = scheduler.step(state, eps, int(t), x, eta=0.0).prev_sample
        np.testing.assert_allclose(
            tree.leaves.reshape(P * 2, *SAMPLE_SHAPE), x, rtol=1e-5, atol=1e-5
        )


ALL_PRESETS = [
    ts.grpo(6, 4),
    ts.grpo(6, 4, shared_init_noise=True),
    ts.mixgrpo(6, 4, window=2, window_start=1),
    ts.treegrpo(6, window=3, k=2, window_start=2),
    ts.branchgrpo(6, (0, 2, 4)),
    ts.branchgrpo_mix(6, (0, 3), window=2, window_start=1),
]


@pytest.mark.parametrize("use_guidance", [False, True])
def test_denoiser_rows_equal_derived_counts(use_guidance):
    """Counts the rows the denoiser really sees at run time, through a host callback."""
    seen = []

    def counting_denoiser(params, x, t, cond):
        jax.debug.callback(lambda n: seen.append(int(n)), x.shape[0])
        return analytic_denoiser(params, x, t, cond)

    for spec in ALL_PRESETS:
        seen.clear()
        schedule = sampling.make_ddim_schedule(spec.num_steps)
        tree = rollout(
            counting_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule,
            spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND if use_guidance else None,
        )  # fmt: skip
        jax.block_until_ready(tree.leaves)
        jax.effects_barrier()
        assert len(seen) == spec.num_steps
        assert sum(seen) == P * spec.rollout_denoiser_calls(guidance=use_guidance), spec.describe()
        assert sum(seg.log_probs.size for seg in tree.segments) == P * spec.trainable_edges


def test_rescoring_with_same_params_gives_ratio_one():
    spec = ts.branchgrpo(6, (0, 3), num_trees=2)
    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    tree = rollout(
        analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(4), schedule,
        spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND, guidance_scale=GUIDANCE,
    )  # fmt: skip

    @jax.jit
    def rescore(parents, children, i, noise_scale):
        n, k = parents.shape[1], children.shape[1] // parents.shape[1]
        flat = parents.reshape(P * n, *SAMPLE_SHAPE)
        pred = guidance.guided_prediction(
            analytic_denoiser, PARAMS, flat, jnp.full((P * n,), schedule.timesteps[i]),
            jnp.repeat(COND, n, axis=0), UNCOND, GUIDANCE,
        )  # fmt: skip
        actions = children.reshape(P * n, k, *SAMPLE_SHAPE)
        out = sampling.score_step(
            schedule,
            i,
            flat[:, None],
            pred[:, None],
            actions,
            event_ndim=3,
            noise_scale=noise_scale,
        )
        return out.log_prob.reshape(P, n * k)

    for seg in tree.segments:
        for t, i in enumerate(seg.step_indices):
            new = rescore(seg.parents[t], seg.children[t], int(i), seg.noise_scale)
            np.testing.assert_allclose(new, seg.log_probs[t], rtol=0, atol=1e-6)
            assert float(jnp.max(jnp.abs(jnp.exp(new - seg.log_probs[t]) - 1))) < 1e-5


def test_compiles_once_per_spec_and_shape_and_is_deterministic():
    spec = ts.treegrpo(4, window=2, k=2)
    schedule = sampling.make_ddim_schedule(4)
    before = rollout._cache_size()
    a = rollout(
        analytic_denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(0),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
    )
    other = {"a": jnp.float32(0.5), "b": jnp.float32(0.1)}
    b = rollout(
        analytic_denoiser,
        other,
        COND * 2,
        jax.random.PRNGKey(1),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
    )
    c = rollout(
        analytic_denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(0),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
    )
    assert rollout._cache_size() == before + 1
    np.testing.assert_array_equal(a.leaves, c.leaves)
    assert not np.allclose(a.leaves, b.leaves)


def test_flow_schedule_rollout_runs_and_scores():
    spec = ts.treegrpo(5, window=2, k=2)
    schedule = sampling.make_flow_schedule(5, shift=2.0)
    tree = rollout(
        analytic_denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(0),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
    )
    assert tree.leaves.shape == (P, 4, *SAMPLE_SHAPE)
    assert all(np.all(np.isfinite(seg.log_probs)) for seg in tree.segments)


def test_schedule_and_spec_must_agree():
    with pytest.raises(ValueError, match="the schedule has 5 steps but the tree spec has 4"):
        rollout(
            analytic_denoiser,
            PARAMS,
            COND,
            jax.random.PRNGKey(0),
            sampling.make_ddim_schedule(5),
            spec=ts.grpo(4, 2),
            sample_shape=SAMPLE_SHAPE,
        )
