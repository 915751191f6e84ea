"""Every method's advantages against the brute-force recursion in reference_tree.py."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_tree as ref
from method_advantages import METHOD_NAMES, advantages_of

from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import tree_spec as ts

NUM_RANDOM_TREES = 20


@functools.partial(jax.jit, static_argnums=0)
def all_methods(spec, tree, rewards, alpha):
    """Every method on one tree as one compiled function: one compile per random spec."""
    return {
        "treegrpo": advantages_of("treegrpo", spec, tree, rewards, clip=1e9),
        "treegrpo_per_depth": advantages_of(
            "treegrpo", spec, tree, rewards, clip=1e9, edge_norm="per_depth"
        ),
        "treegrpo_per_leaf": advantages_of(
            "treegrpo", spec, tree, rewards, clip=1e9, edge_norm="per_leaf"
        ),
        "grpo": advantages_of("grpo", spec, tree, rewards, clip=0.7),
        "branchgrpo": advantages_of("branchgrpo", spec, tree, rewards, clip=1e9),
        "branchgrpo_mix": advantages_of(
            "branchgrpo_mix", spec, tree, rewards, clip=0.7, fusion="path_prob", alpha=alpha
        ),
        "branchgrpo_leaf": advantages_of(
            "branchgrpo",
            spec,
            tree,
            rewards,
            clip=1e9,
            fusion="path_prob",
            alpha=alpha,
            branch_norm="leaf",
        ),  # fmt: skip
        "mean_levels": adv.backup_mean(spec, rewards),
        "prob_levels": adv.backup_path_prob(spec, tree, rewards, alpha),
    }


def random_spec(rng: np.random.Generator) -> ts.TreeSpec:
    """1-5 steps of random kinds (k in 2, 3), 1-3 trees, at most 54 leaves."""
    while True:
        steps = []
        for _ in range(rng.integers(1, 6)):
            u = rng.random()
            if u < 0.25:
                steps.append(ts.ODE)
            elif u < 0.55:
                steps.append(ts.SDE)
            else:
                steps.append(ts.BRANCH(int(rng.choice([2, 3]))))
        spec = ts.TreeSpec(tuple(steps), num_trees=int(rng.integers(1, 4)))
        if spec.leaves <= 54:
            return spec


def random_rewards(rng, spec: ts.TreeSpec, num_prompts: int) -> np.ndarray:
    """Per prompt: constant, a few tied values, constant within each tree, or continuous."""
    rows = []
    per_tree = spec.leaves // spec.num_trees
    for _ in range(num_prompts):
        kind = rng.integers(4)
        if kind == 0:
            row = np.full(spec.leaves, rng.normal())
        elif kind == 1:
            row = rng.choice([0.0, 0.25, 1.0], spec.leaves)
        elif kind == 2:
            row = np.repeat(rng.normal(size=spec.num_trees), per_tree)
        else:
            row = rng.normal(size=spec.leaves)
        rows.append(row)
    return np.stack(rows).astype(np.float32)


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    spec = random_spec(rng)
    num_prompts = int(rng.integers(1, 4))
    tree = ref.random_tree(spec, num_prompts, rng)
    rewards = random_rewards(rng, spec, num_prompts)
    return rng, spec, tree, rewards, ref.build_forest(spec, tree, rewards)


def expected_arrays(tree, reference: dict) -> list[np.ndarray]:
    """The reference's per-edge values in the segment layout, found by step index; NaN
    where it gave none (the inactive steps of a mixed segment)."""
    out = [np.full(seg.log_probs.shape, np.nan) for seg in tree.segments]
    for node, value in reference.items():
        for seg, array in zip(tree.segments, out):
            for t, step in enumerate(np.asarray(seg.steps)):
                if int(step) == node.step and bool(np.asarray(seg.active)[t]):
                    array[t, node.prompt, node.index] = value
    return out


def assert_matches(got, tree, reference, clip=None, atol=1e-6, rtol=0.0):
    want = expected_arrays(tree, reference)
    assert len(got) == len(want)
    found = 0
    for g, w, seg in zip(got, want, tree.segments):
        active = np.broadcast_to(np.asarray(seg.active)[:, None, None], w.shape)
        assert not np.isnan(w[active]).any(), "the reference left an edge without an advantage"
        assert np.isnan(w[~active]).all(), "the reference trains an edge the tree did not sample"
        if clip is not None:
            w = np.clip(w, -clip, clip)
        np.testing.assert_allclose(np.asarray(g)[active], w[active], rtol=rtol, atol=atol)
        found += int(active.sum())
    assert found == len(reference)


@pytest.mark.parametrize("seed", range(NUM_RANDOM_TREES))
def test_random_trees_match_reference(seed):
    rng, spec, tree, rewards, forest = random_case(seed)
    alpha = float(rng.choice([0.5, 1.0, 2.0]))
    got = all_methods(spec, tree, jnp.asarray(rewards), alpha)

    tree_ref = ref.treegrpo_reference(forest)
    assert_matches(got["treegrpo"], tree, tree_ref)
    assert_matches(got["treegrpo_per_depth"], tree, ref.treegrpo_per_depth_reference(forest))
    # Leaf-count weights reach ~10: float32 rounding of the product is relative.
    per_leaf_ref = ref.treegrpo_per_leaf_reference(forest)
    assert_matches(got["treegrpo_per_leaf"], tree, per_leaf_ref, rtol=1e-6)
    # GRPO's "every edge takes its leaf's advantage" is the same mean over the leaves below.
    assert_matches(got["grpo"], tree, tree_ref, clip=0.7)
    assert_matches(got["branchgrpo"], tree, ref.branchgrpo_reference(forest, "mean"))
    path_ref = ref.branchgrpo_reference(forest, "path_prob", alpha)
    leaf_ref = ref.branchgrpo_leaf_reference(forest, "path_prob", alpha)
    assert_matches(got["branchgrpo_leaf"], tree, leaf_ref)
    assert_matches(got["branchgrpo_mix"], tree, path_ref, clip=0.7)

    # The fused rewards themselves, node by node (structural levels expanded to depths).
    mean_levels = adv.depth_levels(spec, got["mean_levels"])
    prob_levels = adv.depth_levels(spec, got["prob_levels"])
    for roots in forest:
        for root in roots:
            for node in ref.descendants(root):
                at = (node.prompt, node.index)
                want_mean = ref.fused_reward(node, "mean", alpha)
                want_prob = ref.fused_reward(node, "path_prob", alpha)
                np.testing.assert_allclose(mean_levels[node.depth][at], want_mean, atol=1e-6)
                np.testing.assert_allclose(prob_levels[node.depth][at], want_prob, atol=1e-6)


def test_treegrpo_by_hand():
    """Two BRANCH(2) steps; leaves 0, 0, 1, 1: leaf A = -1, -1, 1, 1; step 0 edges -1, 1."""
    spec = ts.treegrpo(2, window=2, k=2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    step0, step1 = adv.treegrpo_advantages(spec, tree, jnp.array([[0.0, 0.0, 1.0, 1.0]]))
    np.testing.assert_allclose(step0, [[[-1.0, 1.0]]], atol=1e-6)
    np.testing.assert_allclose(step1, [[[-1.0, -1.0, 1.0, 1.0]]], atol=1e-6)


def test_treegrpo_per_depth_by_hand():
    """Two BRANCH(2) steps; leaves 0, 1, 2, 3: leaf A = (r - 1.5) / sqrt(1.25). The step-0
    edges take the means of the halves, -+1 / sqrt(1.25) = -+0.894; normalized over their
    depth they become -+1. The leaf depth already has unit std and is unchanged."""
    spec = ts.treegrpo(2, window=2, k=2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    rewards = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    plain0, _ = adv.treegrpo_advantages(spec, tree, rewards)
    np.testing.assert_allclose(plain0, [[[-1 / np.sqrt(1.25), 1 / np.sqrt(1.25)]]], atol=1e-6)
    step0, step1 = adv.treegrpo_advantages(spec, tree, rewards, edge_normalization="per_depth")
    np.testing.assert_allclose(step0, [[[-1.0, 1.0]]], atol=1e-6)
    np.testing.assert_allclose(step1, [[[-1.5, -0.5, 0.5, 1.5]]] / np.sqrt(1.25), atol=1e-6)
    with pytest.raises(ValueError, match="edge_normalization"):
        adv.treegrpo_advantages(spec, tree, rewards, edge_normalization="per_level")


def test_treegrpo_per_leaf_by_hand():
    """Two BRANCH(2) steps, leaves 0, 1, 2, 3: 6 edges over 8 leaf paths. A step-0 edge has
    2 leaves below it, weight 2 * 6/8 = 1.5; a leaf edge 1 * 6/8 = 0.75. The step-0 edges
    thus get 1.5 * -+1/sqrt(1.25), each side's summed leaf advantages times 6/8."""
    spec = ts.treegrpo(2, window=2, k=2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    rewards = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    step0, step1 = adv.treegrpo_advantages(spec, tree, rewards, edge_normalization="per_leaf")
    np.testing.assert_allclose(step0, [[[-1.5, 1.5]]] / np.sqrt(1.25), atol=1e-6)
    np.testing.assert_allclose(step1, [[[-1.5, -0.5, 0.5, 1.5]]] / np.sqrt(1.25) * 0.75, atol=1e-6)


def test_treegrpo_per_leaf_loss_is_flat_grpo_over_the_leaf_paths():
    """The reason for the weights: the mean over the tree's edges of weight * A * g(edge) is
    the mean over its (leaf, step) pairs of the leaf's advantage * g(edge on its path), for
    any per-edge g (a log-prob gradient)."""
    spec = ts.treegrpo(3, window=3, k=2)
    rng = np.random.default_rng(3)
    tree = ref.random_tree(spec, 2, rng)
    rewards = rng.normal(size=(2, spec.leaves)).astype(np.float32)
    forest = ref.build_forest(spec, tree, rewards)
    weighted = adv.treegrpo_advantages(
        spec, tree, jnp.asarray(rewards), edge_normalization="per_leaf"
    )
    leaf_adv = ref.leaf_group_advantages(forest)
    for roots in forest:
        nodes = [n for root in roots for n in ref.descendants(root) if n.trainable]
        g = {n: rng.normal() for n in nodes}
        tree_loss = np.mean([ref.edge_value(weighted, tree, n) * g[n] for n in nodes])
        path_terms = []
        for leaf in ref.leaves_below(roots[0]):
            node = leaf
            while node.parent is not None:
                path_terms.append(leaf_adv[leaf] * g[node])
                node = node.parent
        np.testing.assert_allclose(tree_loss, np.mean(path_terms), rtol=1e-5, atol=1e-6)


def test_treegrpo_per_depth_of_constant_rewards_is_zero():
    spec = ts.TreeSpec((ts.SDE, ts.BRANCH(3), ts.ODE, ts.BRANCH(2)), num_trees=2)
    tree = ref.random_tree(spec, 2, np.random.default_rng(1))
    rewards = jnp.full((2, spec.leaves), -3.7, jnp.float32)
    for array in advantages_of("treegrpo", spec, tree, rewards, edge_norm="per_depth"):
        assert np.all(np.asarray(array) == 0.0)


def test_branchgrpo_leaf_normalization_by_hand():
    """BRANCH(2), SDE, BRANCH(2), leaves 1, 2, 3, 6, mean fusion. Depth-wise, the halves get
    -+1/sqrt(2) whatever their difference; with leaf normalization (mean 3, population std
    sqrt(3.5)) they get their leaves' means, -1.5 / sqrt(3.5) and +1.5 / sqrt(3.5)."""
    spec = ts.TreeSpec((ts.BRANCH(2), ts.SDE, ts.BRANCH(2)))
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    rewards = jnp.array([[1.0, 2.0, 3.0, 6.0]])
    split0, sde, split2 = adv.branchgrpo_advantages(spec, tree, rewards, normalization="leaf")
    root = np.sqrt(3.5)
    np.testing.assert_allclose(split0, [[[-1.5 / root, 1.5 / root]]], atol=1e-6)
    np.testing.assert_allclose(sde, [[[-1.5 / root, 1.5 / root]]], atol=1e-6)
    np.testing.assert_allclose(split2, [[[-2.0, -1.0, 0.0, 3.0]]] / root, atol=1e-6)
    with pytest.raises(ValueError, match="normalization"):
        adv.branchgrpo_advantages(spec, tree, rewards, normalization="per_tree")


def test_branchgrpo_by_hand():
    """BRANCH(2), SDE, BRANCH(2) with leaves 1, 2, 3, 6 and mean fusion.

    Depths 1 and 2 hold the two halves, fused 1.5 and 4.5: sample std 3 / sqrt(2), so
    A = -+1/sqrt(2). Depth 3 holds the leaves: mean 3, sample std sqrt(14 / 3).
    """
    spec = ts.TreeSpec((ts.BRANCH(2), ts.SDE, ts.BRANCH(2)))
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    split0, sde, split2 = adv.branchgrpo_advantages(spec, tree, jnp.array([[1.0, 2.0, 3.0, 6.0]]))
    half = 1 / np.sqrt(2)
    np.testing.assert_allclose(split0, [[[-half, half]]], atol=1e-6)
    np.testing.assert_allclose(sde, [[[-half, half]]], atol=1e-6)
    np.testing.assert_allclose(split2, [[[-2.0, -1.0, 0.0, 3.0]]] / np.sqrt(14 / 3), atol=1e-6)


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("value", [0.0, 0.1, -3.7])
def test_constant_rewards_give_zero_advantages(method, value):
    spec = ts.TreeSpec((ts.SDE, ts.BRANCH(3), ts.ODE, ts.BRANCH(2)), num_trees=2)
    tree = ref.random_tree(spec, 2, np.random.default_rng(1))
    rewards = jnp.full((2, spec.leaves), value, jnp.float32)
    for array in advantages_of(method, spec, tree, rewards):
        assert np.all(np.asarray(array) == 0.0)


def test_unknown_method_names_the_methods():
    spec = ts.grpo(2, 2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="choose one of grpo, mixgrpo, treegrpo, branchgrpo"):
        advantages_of("ppo", spec, tree, jnp.zeros((1, 2)))


def test_mismatched_tree_is_rejected():
    tree = ref.random_tree(ts.grpo(3, 2), 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="segment"):
        adv.treegrpo_advantages(ts.treegrpo(3, window=2), tree, jnp.zeros((1, 4)))


# ---------------------------------------------------------------------------------------------
# Exact under a constant shift.

ALL_KW = {
    "grpo": {},
    "treegrpo": {},
    "treegrpo_per_depth": {"edge_normalization": "per_depth"},
    "treegrpo_per_leaf": {"edge_normalization": "per_leaf"},
    "branchgrpo_mean": {"fusion": "mean"},
    "branchgrpo_path_prob": {"fusion": "path_prob", "alpha": 1.0},
    "branchgrpo_leaf": {"fusion": "path_prob", "alpha": 1.0, "normalization": "leaf"},
}


def method_advantages(name, spec, tree, rewards):
    """Each advantage function called directly (no clip)."""
    if name == "grpo":
        return adv.grpo_advantages(spec, tree, rewards)
    if name.startswith("treegrpo"):
        return adv.treegrpo_advantages(spec, tree, rewards, **ALL_KW[name])
    return adv.branchgrpo_advantages(spec, tree, rewards, **ALL_KW[name])


def method_reference(name, forest):
    if name in ("grpo", "treegrpo"):
        return ref.treegrpo_reference(forest)
    if name == "treegrpo_per_depth":
        return ref.treegrpo_per_depth_reference(forest)
    if name == "treegrpo_per_leaf":
        return ref.treegrpo_per_leaf_reference(forest)
    kw = ALL_KW[name]
    if kw.get("normalization") == "leaf":
        return ref.branchgrpo_leaf_reference(forest, kw["fusion"], kw["alpha"])
    return ref.branchgrpo_reference(forest, kw["fusion"], kw.get("alpha", 1.0))


def every_variant(spec, tree, rewards):
    """Every entry of ALL_KW on one tree (one compile per spec when jitted)."""
    return {name: method_advantages(name, spec, tree, rewards) for name in ALL_KW}


jitted_variants = jax.jit(every_variant, static_argnums=0)


def test_path_prob_fusion_of_constant_rewards_is_exactly_zero():
    """The issue's case: four rewards of 50.0; fusing the raw rewards gave the step-0 edges
    +-0.704 (softmax weights summing to 1 - ulp made the fused rewards 49.999996 and 50.0)."""
    spec = ts.TreeSpec((ts.BRANCH(2), ts.BRANCH(2)))
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    step0, step1 = tree.segments
    tree = tree.replace(
        segments=(
            step0.replace(log_probs=np.array([[[-1.18, -0.81]]], np.float32)),
            step1.replace(log_probs=np.array([[[-1.37, -0.19, -0.55, -2.99]]], np.float32)),
        )
    )
    rewards = jnp.full((1, 4), 50.0, jnp.float32)
    for a in adv.branchgrpo_advantages(spec, tree, rewards, fusion="path_prob"):
        assert np.all(np.asarray(a) == 0.0)
    # Relative fusion is exactly zero; the raw fusion is what the normalization used to see.
    for level in adv.fused_rewards(spec, tree, rewards, fusion="path_prob", relative=True):
        assert np.all(np.asarray(level) == 0.0)


def grid_rewards(rng, spec, num_prompts, kind):
    """Rewards on a 1/64 grid (so adding 1e4 is exact in float32): varied, constant per
    prompt, or constant within each tree."""
    per_tree = spec.leaves // spec.num_trees
    if kind == "varied":
        r = rng.normal(size=(num_prompts, spec.leaves))
    elif kind == "constant":
        r = np.repeat(rng.normal(size=(num_prompts, 1)) * 40, spec.leaves, axis=1)
    else:  # constant within each tree, different across trees
        r = np.repeat(rng.normal(size=(num_prompts, spec.num_trees)), per_tree, axis=1)
    return (np.round(r * 64) / 64).astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["varied", "constant", "per_tree"])
def test_every_method_is_exact_under_a_constant_shift(seed, kind):
    """Adding 1e4 (or any constant) to the rewards changes no advantage; constant rewards
    give exact zeros; rewards constant within each tree give BranchGRPO exact zeros. Both
    against the float64 reference."""
    rng = np.random.default_rng(100 + seed)
    while True:
        spec = random_spec(rng)
        if spec.num_trees > 1 or kind != "per_tree":
            break
    num_prompts = int(rng.integers(1, 4))
    tree = ref.random_tree(spec, num_prompts, rng)
    rewards = grid_rewards(rng, spec, num_prompts, kind)
    forest = ref.build_forest(spec, tree, rewards)
    all_base = jitted_variants(spec, tree, jnp.asarray(rewards))
    all_shifted = jitted_variants(spec, tree, jnp.asarray(rewards + np.float32(1e4)))
    for name in ALL_KW:
        base, shifted = all_base[name], all_shifted[name]
        assert_matches(base, tree, method_reference(name, forest), rtol=1e-6)
        for a, b in zip(base, shifted):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
        depthwise = name in ("branchgrpo_mean", "branchgrpo_path_prob")
        zero = kind == "constant" or (kind == "per_tree" and depthwise)
        if zero:
            assert all(np.all(np.asarray(a) == 0.0) for a in base + shifted), name


@pytest.mark.parametrize("seed", range(4))
def test_sample_std_option_matches_reference(seed):
    """ddof=1: DanceGRPO's torch.std (sample std) for the leaf normalization."""
    _, spec, tree, rewards, forest = random_case(200 + seed)
    want = ref.treegrpo_reference(forest, ddof=1)
    for fn in (adv.grpo_advantages, adv.treegrpo_advantages):
        got = jax.jit(functools.partial(fn, ddof=1), static_argnums=0)(spec, tree, rewards)
        assert_matches(got, tree, want)
    per_depth = functools.partial(adv.treegrpo_advantages, ddof=1, edge_normalization="per_depth")
    got = jax.jit(per_depth, static_argnums=0)(spec, tree, rewards)
    assert_matches(got, tree, ref.treegrpo_per_depth_reference(forest, ddof=1))
    with pytest.raises(ValueError, match="ddof"):
        adv.treegrpo_advantages(spec, tree, jnp.asarray(rewards), ddof=2)


FAMILIES = [
    ts.treegrpo(7, window=3, k=2, window_start=ts.FAMILY, num_trees=2),
    ts.mixgrpo(6, 3, window=2, window_start=ts.FAMILY),
    ts.branchgrpo_mix(8, (0, 3, 5), k=2, window=3, window_start=ts.FAMILY, num_trees=2),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sliding_window_families_match_reference_at_every_position(family):
    """Advantages of a family's tree at each window start, against the reference built on
    the plain spec of that position; one compile for all positions."""
    rng = np.random.default_rng(7)

    def variants(spec, tree, rewards):  # its own jit cache
        return every_variant(spec, tree, rewards)

    fn = jax.jit(variants, static_argnums=0)
    for start in range(family.window_positions):
        tree = ref.random_tree(family, 2, rng, window_start=start)
        rewards = rng.normal(size=(2, family.leaves)).astype(np.float32)
        forest = ref.build_forest(family, tree, rewards, window_start=start)
        got = fn(family, tree, jnp.asarray(rewards))
        for name in ALL_KW:
            assert_matches(got[name], tree, method_reference(name, forest))
    assert fn._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# The DDPO per-prompt stat tracker.


def test_tracker_uses_batch_stats_until_min_count_then_the_prompts_history():
    tracker = adv.PerPromptStatTracker(buffer_size=4, min_count=3)
    first = np.array([[1.0, 2.0], [10.0, 30.0]])
    got = tracker.update(["a", "b"], first)
    np.testing.assert_allclose(got, (first - first.mean()) / (first.std() + 1e-6))

    second = np.array([[3.0, 5.0], [50.0, 70.0]])
    got = tracker.update(["a", "b"], second)
    history_a = np.array([1.0, 2.0, 3.0, 5.0])
    history_b = np.array([10.0, 30.0, 50.0, 70.0])
    np.testing.assert_allclose(got[0], (second[0] - history_a.mean()) / (history_a.std() + 1e-6))
    np.testing.assert_allclose(got[1], (second[1] - history_b.mean()) / (history_b.std() + 1e-6))

    tracker.update(["a"], np.array([[7.0, 9.0]]))  # buffer keeps the last 4: 3, 5, 7, 9
    assert list(tracker.history["a"]) == [3.0, 5.0, 7.0, 9.0]


def test_tracker_groups_repeated_prompts():
    tracker = adv.PerPromptStatTracker(buffer_size=8, min_count=4)
    rewards = np.array([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]])
    got = tracker.update(["a", "a", "b"], rewards)
    a = rewards[:2].ravel()
    np.testing.assert_allclose(got[:2].ravel(), (a - a.mean()) / (a.std() + 1e-6))


def test_tracker_state_dict_resumes_exactly():
    rng = np.random.default_rng(0)
    batches = [(["x", "y", "x"], rng.normal(size=(3, 4))) for _ in range(5)]
    original = adv.PerPromptStatTracker(buffer_size=6, min_count=5)
    for prompts, rewards in batches[:3]:
        original.update(prompts, rewards)
    resumed = adv.PerPromptStatTracker()
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for prompts, rewards in batches[3:]:
        np.testing.assert_array_equal(
            original.update(prompts, rewards), resumed.update(prompts, rewards)
        )


def test_grpo_with_tracker_gives_every_chain_edge_its_leaf_advantage():
    spec = ts.grpo(3, 4)
    tree = ref.random_tree(spec, 2, np.random.default_rng(0))
    rewards = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    leaf = adv.PerPromptStatTracker(min_count=100).update(["p", "q"], rewards)
    (got,) = adv.grpo_advantages(
        spec,
        tree,
        jnp.asarray(rewards),
        tracker=adv.PerPromptStatTracker(min_count=100),
        prompt_ids=["p", "q"],
    )
    np.testing.assert_allclose(got, np.broadcast_to(leaf, (3, 2, 4)), atol=1e-6)
    with pytest.raises(ValueError, match="prompt_ids"):
        adv.grpo_advantages(spec, tree, jnp.asarray(rewards), tracker=adv.PerPromptStatTracker())
