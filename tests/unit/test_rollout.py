"""The batched rollout engine against a node-by-node recursion over explicit nodes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import count_compiles
from scipy import stats

from tree_grpo_jax.core import guidance, sampling
from tree_grpo_jax.core import tree_spec as ts
from tree_grpo_jax.core.rollout import (
    initial_noise,
    noise_by_step,
    rollout,
    segment_noise,
    segment_noise_shapes,
    split_rollout_key,
)

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


def reference_tree(spec, schedule, key, eta, window_start=0, split_log_prob="sampled"):
    """Python recursion over explicit nodes, one denoiser call per node.

    `spec` may be a sliding-window family: the recursion walks the plain spec of
    `window_start`, with the noise the rollout documents for that position.
    """
    roots_noise, noise_of_step = noise_by_step(key, spec, P, SAMPLE_SHAPE, window_start)
    roots_noise = np.asarray(roots_noise, np.float64)
    spec = spec.at(window_start)

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
            noise = np.asarray(noise_of_step[i], np.float64)
            std = s * step.noise_scale
            score_std = std if split_log_prob == "sampled" else s
            for c in range(step.k):
                child = mean + std * noise[p, j, c]
                logp = np.mean(stats.norm.logpdf(child, loc=mean, scale=score_std))
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


def assert_tree_matches_reference(tree, ref):
    """Every recorded step, node by node; steps recorded without sampling (a mixed segment
    outside its window) must hold the reference's deterministic children and log-prob 0."""
    for p in range(P):
        levels = _levels(ref[p])
        leaves = np.stack([n.state for n in levels[-1]])
        np.testing.assert_allclose(tree.leaves[p], leaves, rtol=1e-4, atol=1e-5)
        for seg in tree.segments:
            for t, i in enumerate(seg.step_indices):
                parents = np.stack([n.state for n in levels[i]])
                children = np.stack([n.state for n in levels[i + 1]])
                np.testing.assert_allclose(seg.parents[t, p], parents, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(seg.children[t, p], children, rtol=1e-4, atol=1e-5)
                if bool(seg.active[t]):
                    logps = np.array([n.log_prob for n in levels[i + 1]])
                    assert None not in logps, f"step {i} is not stochastic in the reference"
                    np.testing.assert_allclose(seg.log_probs[t, p], logps, rtol=1e-4, atol=1e-4)
                else:
                    assert all(n.log_prob is None for n in levels[i + 1])
                    assert np.all(np.asarray(seg.log_probs[t, p]) == 0.0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_engine_equals_node_by_node_reference(spec):
    schedule = sampling.make_ddim_schedule(spec.num_steps, eta=1.0)
    key = jax.random.PRNGKey(5)
    tree = rollout(
        analytic_denoiser, PARAMS, COND, key, schedule,
        spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND, guidance_scale=GUIDANCE,
    )  # fmt: skip
    assert all(bool(np.all(seg.active)) for seg in tree.segments)
    assert_tree_matches_reference(tree, reference_tree(spec, schedule, key, eta=1.0))


# Sliding-window families and the window positions each is checked at.
FAMILIES = [
    (ts.treegrpo(5, window=2, k=2, window_start=ts.FAMILY), (0, 1, 3)),
    (ts.mixgrpo(5, 2, window=2, window_start=ts.FAMILY), (0, 2, 3)),
    (ts.branchgrpo_mix(6, (0, 3), k=2, split_noise_scale=1.5, window=2, window_start=ts.FAMILY),
     (0, 2, 4)),
]  # fmt: skip


@pytest.mark.parametrize("family, starts", FAMILIES, ids=lambda f: getattr(f, "name", ""))
def test_window_position_as_data_equals_node_by_node_reference(family, starts):
    """One family spec, the window start an argument: at every start the tree is the plain
    spec's tree of that position, node for node."""
    schedule = sampling.make_ddim_schedule(family.num_steps, eta=1.0)
    key = jax.random.PRNGKey(7)
    for start in starts:
        tree = rollout(
            analytic_denoiser, PARAMS, COND, key, schedule, spec=family,
            sample_shape=SAMPLE_SHAPE, uncond=UNCOND, guidance_scale=GUIDANCE,
            window_start=start,
        )  # fmt: skip
        ref = reference_tree(family, schedule, key, eta=1.0, window_start=start)
        assert_tree_matches_reference(tree, ref)
        stochastic = sorted(
            int(i) for seg in tree.segments for i, a in zip(seg.step_indices, seg.active) if a
        )
        assert stochastic == list(family.at(start).trainable_steps)


def test_one_compile_serves_every_window_position():
    """A fresh denoiser so the jit cache starts empty for it: each family compiles once for
    all its positions, and no backend compile happens after the first position."""

    def denoiser(params, x, t, cond):
        return analytic_denoiser(params, x, t, cond)

    families = [
        ts.treegrpo(6, window=3, k=2, window_start=ts.FAMILY),
        ts.mixgrpo(6, 2, window=2, window_start=ts.FAMILY),
        ts.branchgrpo_mix(6, (0, 3), window=2, window_start=ts.FAMILY),
    ]
    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    key = jax.random.PRNGKey(0)
    for family in families:
        leaves = []
        for start in range(family.window_positions):
            with count_compiles() as compiles:
                tree = rollout(
                    denoiser, PARAMS, COND, key, schedule, spec=family,
                    sample_shape=SAMPLE_SHAPE, window_start=start,
                )  # fmt: skip
                leaves.append(np.asarray(tree.leaves))
            if start == 0:
                assert compiles["_rollout"] == 1, family.describe()
            else:  # nothing at all compiles for the later positions
                assert not compiles, (family.describe(), compiles)
        assert not np.allclose(leaves[0], leaves[-1])  # the window really moved


@pytest.mark.parametrize(
    "family, widths",
    [
        # ODE before the window at 1 node, BRANCH steps at 1, 2 and 4, ODE after at 8: the
        # model is traced at widths 1, 2, 4 and 8 (the ODE steps and the first split share 1)
        (ts.treegrpo(6, window=3, k=2, window_start=ts.FAMILY), [1, 2, 4, 8]),
        # ODE, the SDE window and ODE again, all at the group's 4 rows: one trace
        (ts.mixgrpo(6, 4, window=2, window_start=ts.FAMILY), [4]),
    ],
    ids=["treegrpo", "mixgrpo"],
)
def test_the_denoiser_is_traced_once_per_level_width(family, widths):
    """The Python denoiser runs only while a program is traced: its calls are the traces."""
    traced = []

    def denoiser(params, x, t, cond):
        traced.append(x.shape[0] // P)  # the level's nodes per prompt
        return analytic_denoiser(params, x, t, cond)

    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    rollout(
        denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule, spec=family,
        sample_shape=SAMPLE_SHAPE, window_start=1, lower=True,
    )  # fmt: skip
    assert sorted(traced) == widths


def test_family_at_a_position_equals_the_plain_spec():
    """TreeGRPO's and MixGRPO's families lay noise out like the plain spec of a position, so
    the same key gives the same tree either way."""
    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    key = jax.random.PRNGKey(2)
    cases = [
        (ts.treegrpo(6, 3, 2, ts.FAMILY, num_trees=2), (1, 3)),
        (ts.mixgrpo(6, 3, 2, ts.FAMILY), (2,)),
    ]
    for family, starts in cases:
        for start in starts:
            a = rollout(analytic_denoiser, PARAMS, COND, key, schedule, spec=family,
                        sample_shape=SAMPLE_SHAPE, window_start=start)  # fmt: skip
            b = rollout(analytic_denoiser, PARAMS, COND, key, schedule,
                        spec=family.at(start), sample_shape=SAMPLE_SHAPE)  # fmt: skip
            np.testing.assert_allclose(a.leaves, b.leaves, rtol=1e-5, atol=1e-6)
            for sa, sb in zip(a.segments, b.segments, strict=True):
                np.testing.assert_array_equal(sa.steps, sb.steps)
                np.testing.assert_allclose(sa.log_probs, sb.log_probs, rtol=1e-5, atol=1e-5)


def test_window_start_out_of_range_is_one_sentence():
    family = ts.treegrpo(5, window=2, k=2, window_start=ts.FAMILY)
    schedule = sampling.make_ddim_schedule(5)
    with pytest.raises(ts.SpecError, match="runs past the last step"):
        rollout(analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule,
                spec=family, sample_shape=SAMPLE_SHAPE, window_start=4)  # fmt: skip
    with pytest.raises(ValueError, match="split_log_prob"):
        rollout(analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule,
                spec=family, sample_shape=SAMPLE_SHAPE, split_log_prob="official")  # fmt: skip


def test_noise_is_one_draw_cut_in_segment_order():
    """The documented layout: the roots from the first key of the split, every segment's
    noise [T, P, n, k, *S] cut in order from one standard normal draw of the second."""
    spec = ts.branchgrpo(6, (0, 3), k=3, num_trees=2)
    key = jax.random.PRNGKey(9)
    init_key, noise_key = jax.random.split(key)
    shapes = segment_noise_shapes(spec, P, SAMPLE_SHAPE)
    assert shapes == [
        (1, P, 2, 3, *SAMPLE_SHAPE),  # BRANCH(3) at step 0 on the 2 roots
        (2, P, 6, 1, *SAMPLE_SHAPE),  # SDE steps 1, 2
        (1, P, 6, 3, *SAMPLE_SHAPE),  # BRANCH(3) at step 3
        (2, P, 18, 1, *SAMPLE_SHAPE),  # SDE steps 4, 5
    ]
    flat = np.asarray(jax.random.normal(noise_key, (sum(int(np.prod(s)) for s in shapes),)))
    noise = segment_noise(noise_key, spec, P, SAMPLE_SHAPE)
    np.testing.assert_array_equal(np.concatenate([np.ravel(n) for n in noise]), flat)
    roots, by_step = noise_by_step(key, spec, P, SAMPLE_SHAPE)
    np.testing.assert_array_equal(roots, initial_noise(init_key, P, spec, SAMPLE_SHAPE))
    assert sorted(by_step) == list(range(6))
    np.testing.assert_array_equal(by_step[5], noise[3][1])
    assert len(np.unique(flat)) == flat.size  # no two nodes share noise


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
    """Against diffusers' DDIM scheduler (its PyTorch class: diffusers 0.40 removed the Flax
    one)."""
    torch = pytest.importorskip("torch")
    from diffusers import DDIMScheduler

    num_steps = 6
    scheduler = DDIMScheduler.from_config(
        dict(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            steps_offset=1,
            set_alpha_to_one=False,
            clip_sample=False,
        )
    )
    scheduler.set_timesteps(num_steps)
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
        for t in scheduler.timesteps.numpy():
            eps = analytic_denoiser(PARAMS, jnp.asarray(x), jnp.full((P * 2,), t), cond)
            step = scheduler.step(
                torch.from_numpy(np.array(eps)), int(t), torch.from_numpy(np.array(x))
            )
            x = step.prev_sample.numpy()
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

    cases = [(spec, 0) for spec in ALL_PRESETS]
    if use_guidance:  # the families once (each compile costs seconds on a small CPU)
        cases += [
            (ts.treegrpo(6, window=3, k=2, window_start=ts.FAMILY), 2),
            (ts.mixgrpo(6, 4, window=2, window_start=ts.FAMILY), 3),
            (ts.branchgrpo_mix(6, (0, 3), window=2, window_start=ts.FAMILY), 1),
        ]
    for spec, start in cases:
        seen.clear()
        schedule = sampling.make_ddim_schedule(spec.num_steps)
        tree = rollout(
            counting_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule,
            spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND if use_guidance else None,
            window_start=start,
        )  # fmt: skip
        jax.block_until_ready(tree.leaves)
        jax.effects_barrier()
        counts = spec.counts(use_guidance, window_start=start)
        assert len(seen) == spec.num_steps
        assert sum(seen) == P * counts["rollout_denoiser_calls"], spec.describe()
        trained = sum(int(np.sum(seg.active)) * seg.log_probs[0].size for seg in tree.segments)
        assert trained == P * counts["trainable_edges"], spec.describe()


@pytest.mark.parametrize("split_log_prob", ["sampled", "unscaled"])
def test_rescoring_with_same_params_gives_ratio_one(split_log_prob):
    spec = ts.branchgrpo(6, (0, 3), split_noise_scale=1.7, num_trees=2)
    schedule = sampling.make_ddim_schedule(6, eta=1.0)
    tree = rollout(
        analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(4), schedule,
        spec=spec, sample_shape=SAMPLE_SHAPE, uncond=UNCOND, guidance_scale=GUIDANCE,
        split_log_prob=split_log_prob,
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
        assert seg.score_scale == (seg.noise_scale if split_log_prob == "sampled" else 1.0)
        for t, i in enumerate(seg.step_indices):
            new = rescore(seg.parents[t], seg.children[t], int(i), seg.score_scale)
            np.testing.assert_allclose(new, seg.log_probs[t], rtol=0, atol=1e-6)
            assert float(jnp.max(jnp.abs(jnp.exp(new - seg.log_probs[t]) - 1))) < 1e-5


def test_unscaled_split_log_probs_against_scipy():
    """split_log_prob="unscaled": children drawn with noise_scale * std, scored under the
    unscaled std, as BranchGRPO's released code does; checked against the reference
    recursion, which scores with scipy.stats.norm."""
    spec = ts.branchgrpo(4, (0, 2), split_noise_scale=2.5)
    schedule = sampling.make_ddim_schedule(4, eta=1.0)
    key = jax.random.PRNGKey(3)
    tree = rollout(
        analytic_denoiser, PARAMS, COND, key, schedule, spec=spec, sample_shape=SAMPLE_SHAPE,
        uncond=UNCOND, guidance_scale=GUIDANCE, split_log_prob="unscaled",
    )  # fmt: skip
    ref = reference_tree(spec, schedule, key, eta=1.0, split_log_prob="unscaled")
    assert_tree_matches_reference(tree, ref)
    sampled = rollout(
        analytic_denoiser, PARAMS, COND, key, schedule, spec=spec, sample_shape=SAMPLE_SHAPE,
        uncond=UNCOND, guidance_scale=GUIDANCE,
    )  # fmt: skip
    np.testing.assert_array_equal(sampled.leaves, tree.leaves)  # same draws, other scores
    # Mean-reduced, with z the standard noise and sigma the step's std: sampled scores
    # -mean(z^2)/2 - log(s sigma) - c, unscaled -s^2 mean(z^2)/2 - log(sigma) - c.
    c, scale = 0.5 * np.log(2 * np.pi), 2.5
    for j in (0, 2):  # the two split segments
        sigma = float(schedule.unit_std[int(tree.segments[j].first_step)])
        half_z2 = -(np.asarray(sampled.segments[j].log_probs) + np.log(scale * sigma) + c)
        want = -(scale**2) * half_z2 - np.log(sigma) - c
        np.testing.assert_allclose(tree.segments[j].log_probs, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tree.segments[1].log_probs, sampled.segments[1].log_probs)


def test_compiles_once_per_spec_and_shape_and_is_deterministic():
    spec = ts.treegrpo(4, window=2, k=2)
    schedule = sampling.make_ddim_schedule(4)
    kwargs = dict(spec=spec, sample_shape=SAMPLE_SHAPE)
    other = {"a": jnp.float32(0.5), "b": jnp.float32(0.1)}
    with count_compiles() as compiles:
        a = rollout(analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule, **kwargs)
        b = rollout(analytic_denoiser, other, COND * 2, jax.random.PRNGKey(1), schedule, **kwargs)
        c = rollout(analytic_denoiser, PARAMS, COND, jax.random.PRNGKey(0), schedule, **kwargs)
    assert compiles["_rollout"] == 1
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


@pytest.mark.parametrize("batch, rows", [(12, 4), (13, 4), (5, 16), (7, 1)])
def test_a_denoiser_in_chunks_gives_every_row_its_own_prediction(batch, rows):
    from tree_grpo_jax.core.guidance import in_chunks

    rng = np.random.default_rng(batch * rows)
    w = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)
    calls = []

    def denoise(params, x, t, cond):  # rows must not mix: each row's own x, t and cond
        calls.append(x.shape[0])
        return jnp.tanh(x @ params) * t[:, None] + cond.mean(axis=(1, 2))[:, None]

    x = jnp.asarray(rng.normal(size=(batch, 6)), jnp.float32)
    t = jnp.asarray(rng.uniform(size=batch), jnp.float32)
    cond = jnp.asarray(rng.normal(size=(batch, 3, 2)), jnp.float32)
    want = np.tanh(np.asarray(x) @ np.asarray(w)) * np.asarray(t)[:, None]
    want = want + np.asarray(cond).mean(axis=(1, 2))[:, None]
    got = in_chunks(denoise, rows)(w, x, t, cond)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert max(calls) <= max(rows, -(-batch // -(-batch // rows)))  # no call sees the batch
    assert len(set(np.round(want[:, 0], 4))) == batch  # rows that differ
