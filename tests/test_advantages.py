"""Every method's advantages against the brute-force recursion in reference_tree.py."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_tree as ref

from tree_grpo_jax import advantages as adv
from tree_grpo_jax import tree_spec as ts

NUM_RANDOM_TREES = 20


@functools.partial(jax.jit, static_argnums=0)
def all_methods(spec, tree, rewards, alpha):
    """Every method on one tree as one compiled function: one compile per random spec."""
    return {
        "treegrpo": adv.compute_advantages("treegrpo", spec, tree, rewards, clip=1e9),
        "grpo": adv.compute_advantages("grpo", spec, tree, rewards, clip=0.7),
        "branchgrpo": adv.compute_advantages("branchgrpo", spec, tree, rewards, clip=1e9),
        "branchgrpo_mix": adv.compute_advantages(
            "branchgrpo_mix", spec, tree, rewards, clip=0.7, fusion="path_prob", alpha=alpha
        ),
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
    """The reference's per-edge values in the segment layout; NaN where it gave none."""
    out = [np.full(seg.log_probs.shape, np.nan) for seg in tree.segments]
    for node, value in reference.items():
        for seg, array in zip(tree.segments, out):
            t = node.step - seg.first_step
            if 0 <= t < seg.log_probs.shape[0]:
                array[t, node.prompt, node.index] = value
    return out


def assert_matches(got, tree, reference, clip=None):
    want = expected_arrays(tree, reference)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert not np.isnan(w).any(), "the reference left an edge without an advantage"
        if clip is not None:
            w = np.clip(w, -clip, clip)
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(NUM_RANDOM_TREES))
def test_random_trees_match_reference(seed):
    rng, spec, tree, rewards, forest = random_case(seed)
    alpha = float(rng.choice([0.5, 1.0, 2.0]))
    got = all_methods(spec, tree, jnp.asarray(rewards), alpha)

    tree_ref = ref.treegrpo_reference(forest)
    assert_matches(got["treegrpo"], tree, tree_ref)
    # GRPO's "every edge takes its leaf's advantage" is the same mean over the leaves below.
    assert_matches(got["grpo"], tree, tree_ref, clip=0.7)
    assert_matches(got["branchgrpo"], tree, ref.branchgrpo_reference(forest, "mean"))
    path_ref = ref.branchgrpo_reference(forest, "path_prob", alpha)
    assert_matches(got["branchgrpo_mix"], tree, path_ref, clip=0.7)

    # The fused rewards themselves, node by node.
    for roots in forest:
        for root in roots:
            for node in ref.descendants(root):
                at = (node.prompt, node.index)
                want_mean = ref.fused_reward(node, "mean", alpha)
                want_prob = ref.fused_reward(node, "path_prob", alpha)
                np.testing.assert_allclose(got["mean_levels"][node.depth][at], want_mean, atol=1e-6)
                np.testing.assert_allclose(got["prob_levels"][node.depth][at], want_prob, atol=1e-6)


def test_treegrpo_by_hand():
    """Two BRANCH(2) steps; leaves 0, 0, 1, 1: leaf A = -1, -1, 1, 1; step 0 edges -1, 1."""
    spec = ts.treegrpo(2, window=2, k=2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    step0, step1 = adv.treegrpo_advantages(spec, tree, jnp.array([[0.0, 0.0, 1.0, 1.0]]))
    np.testing.assert_allclose(step0, [[[-1.0, 1.0]]], atol=1e-6)
    np.testing.assert_allclose(step1, [[[-1.0, -1.0, 1.0, 1.0]]], atol=1e-6)


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


@pytest.mark.parametrize("method", adv.METHODS)
@pytest.mark.parametrize("value", [0.0, 0.1, -3.7])
def test_constant_rewards_give_zero_advantages(method, value):
    spec = ts.TreeSpec((ts.SDE, ts.BRANCH(3), ts.ODE, ts.BRANCH(2)), num_trees=2)
    tree = ref.random_tree(spec, 2, np.random.default_rng(1))
    rewards = jnp.full((2, spec.leaves), value, jnp.float32)
    for array in adv.compute_advantages(method, spec, tree, rewards):
        assert np.all(np.asarray(array) == 0.0)


def test_unknown_method_names_the_methods():
    spec = ts.grpo(2, 2)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="use one of grpo, mixgrpo, treegrpo, branchgrpo"):
        adv.compute_advantages("ppo", spec, tree, jnp.zeros((1, 2)))


def test_mismatched_tree_is_rejected():
    tree = ref.random_tree(ts.grpo(3, 2), 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="segment"):
        adv.treegrpo_advantages(ts.treegrpo(3, window=2), tree, jnp.zeros((1, 4)))


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
