"""Depth and width pruning masks against the node-by-node reference."""

import numpy as np
import pytest
import reference_tree as ref
from test_advantages import expected_arrays, random_spec

from tree_grpo_jax.core import pruning
from tree_grpo_jax.core import tree_spec as ts

NUM_RANDOM_TREES = 40


def random_case(seed):
    rng = np.random.default_rng(seed)
    spec = random_spec(rng)
    num_prompts = int(rng.integers(1, 4))
    tree = ref.random_tree(spec, num_prompts, rng)
    rewards = np.zeros((num_prompts, spec.leaves))
    # Advantages on a coarse grid so ties are common; the tie rule is part of the contract.
    advantages = tuple(rng.integers(-2, 3, seg.log_probs.shape) / 2 for seg in tree.segments)
    return rng, spec, tree, advantages, ref.build_forest(spec, tree, rewards)


def last_split(spec, window_start=0):
    """The last BRANCH step of the plain spec, counted by hand."""
    steps = spec.at(window_start).steps
    splits = [i for i, step in enumerate(steps) if step.kind is ts.Kind.BRANCH]
    return splits[-1] if splits else None


def assert_mask_matches(got, tree, reference):
    want = expected_arrays(tree, {n: float(kept) for n, kept in reference.items()})
    for g, w in zip(got, want):
        assert g.dtype == bool and g.shape == w.shape
        np.testing.assert_array_equal(g, w == 1.0)


@pytest.mark.parametrize("seed", range(NUM_RANDOM_TREES))
def test_random_trees_match_reference(seed):
    rng, spec, tree, advantages, forest = random_case(seed)

    count = min(spec.num_steps, int(rng.integers(1, 3)))
    depths = sorted(int(d) for d in rng.choice(np.arange(1, spec.num_steps + 1), count, False))
    slide_every = [None, 1, 3][rng.integers(3)]
    stop_depth = [None, 0, 1][rng.integers(3)]
    iteration = int(rng.integers(0, 10))
    count_from = int(rng.integers(2))
    got = pruning.depth_pruning_mask(
        spec,
        tree,
        depths,
        iteration=iteration,
        slide_every=slide_every,
        stop_depth=stop_depth,
        count_from=count_from,
    )
    want = ref.depth_pruning_reference(
        forest, depths, iteration, slide_every, stop_depth, last_split(spec), count_from
    )
    assert_mask_matches(got, tree, want)

    def advantage_of(node):
        return ref.edge_value(advantages, tree, node)

    for mode in pruning.WIDTH_MODES:
        ratio = float(rng.choice([0.25, 0.5, 0.75, 1.0]))
        got = pruning.width_pruning_mask(spec, tree, advantages, mode=mode, ratio=ratio)
        assert_mask_matches(
            got, tree, ref.width_pruning_reference(forest, spec, advantage_of, mode, ratio)
        )


FAMILIES = [
    ts.branchgrpo_mix(9, (0, 3, 5), k=2, window=3, window_start=ts.FAMILY, num_trees=2),
    ts.treegrpo(6, window=3, k=2, window_start=ts.FAMILY),
    ts.mixgrpo(6, 3, window=2, window_start=ts.FAMILY),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sliding_window_families_match_reference_at_every_position(family):
    """Masks of a family's tree (step indices as data, BranchGRPO-Mix's steps outside the
    window never trained) against the reference built on the plain spec of each start."""
    rng = np.random.default_rng(3)
    for start in range(family.window_positions):
        tree = ref.random_tree(family, 2, rng, window_start=start)
        forest = ref.build_forest(family, tree, np.zeros((2, family.leaves)), start)
        advantages = tuple(rng.integers(-2, 3, seg.log_probs.shape) / 2 for seg in tree.segments)
        full = pruning.full_masks(tree)
        assert_mask_matches(full, tree, {n: True for n in ref.edges(forest)})
        assert (
            sum(int(m.sum()) for m in full)
            == 2 * family.counts(window_start=start)["trainable_edges"]
        )
        depths = (2, family.num_steps - 1)
        got = pruning.depth_pruning_mask(
            family, tree, depths, iteration=4, slide_every=2, window_start=start
        )
        want = ref.depth_pruning_reference(forest, depths, 4, 2, None, last_split(family, start), 0)
        assert_mask_matches(got, tree, want)
        spec = family.at(start)

        def advantage_of(node, tree=tree, advantages=advantages):
            return ref.edge_value(advantages, tree, node)

        for mode in pruning.WIDTH_MODES:
            got = pruning.width_pruning_mask(family, tree, advantages, mode=mode, ratio=0.5)
            want = ref.width_pruning_reference(forest, spec, advantage_of, mode, 0.5)
            assert_mask_matches(got, tree, want)


def test_pruning_active_is_the_released_codes_step_ratio():
    """The released code: for step in 1..max_train_steps, should_prune = step <=
    int(max_train_steps * pruning_step_ratio). Our iterations count from 0."""
    for total in (1, 7, 100, 300):
        for ratio in (0.0, 0.1, 0.29, 0.5, 0.999, 1.0, 1.5):
            official = [step <= int(total * ratio) for step in range(1, total + 1)]
            ours = [pruning.pruning_active(it, total, ratio) for it in range(total)]
            assert ours == official, (total, ratio)
    assert sum(pruning.pruning_active(it, 300, 0.5) for it in range(300)) == 150
    assert pruning.pruning_active(10_000, 300, 1.0)  # ratio 1: always, also past the end
    with pytest.raises(ValueError, match="ratio"):
        pruning.pruning_active(0, 10, -0.5)


def test_depth_window_counts_steps_like_the_released_code():
    """The released script: depths 15..18, slide interval 30, stop depth 9; its shift is
    step // 30 with step counted from 1, so it first moves at the 30th iteration (0-based
    29). Counting from 0, it first moves at iteration 30."""
    spec = ts.branchgrpo(20, (0, 3, 6, 9))
    depths = (15, 16, 17, 18)

    def active(it, count_from):
        return pruning.active_pruned_depths(
            spec, depths, iteration=it, slide_every=30, stop_depth=9, count_from=count_from
        )

    assert active(28, 1) == depths and active(29, 1) == (14, 15, 16, 17)
    assert active(29, 0) == depths and active(30, 0) == (14, 15, 16, 17)
    assert active(1000, 1) == (9, 10, 11, 12)
    # With an interval of 1 the released window has already moved at its first step.
    one = pruning.active_pruned_depths(spec, depths, iteration=0, slide_every=1, count_from=1)
    assert one == (14, 15, 16, 17)
    with pytest.raises(ValueError, match="count_from"):
        pruning.active_pruned_depths(spec, depths, count_from=2)


def test_depth_pruning_slides_towards_the_root_and_stops():
    spec = ts.branchgrpo(20, (0, 3, 6, 9))
    active = [
        pruning.active_pruned_depths(spec, (15, 16, 17, 18), iteration=it, slide_every=30)
        for it in (0, 29, 30, 60, 179, 180, 1000)
    ]
    assert active[:4] == [(15, 16, 17, 18), (15, 16, 17, 18), (14, 15, 16, 17), (13, 14, 15, 16)]
    # The shallowest pruned depth stops at the last split's parents (depth 9).
    assert active[4] == (10, 11, 12, 13)
    assert active[5] == active[6] == (9, 10, 11, 12)


def test_branchgrpo_default_counts():
    """20 steps, splits 0, 3, 6, 9: 16 chains run steps 10..19 after the last split."""
    spec = ts.branchgrpo(20, (0, 3, 6, 9))
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    advantages = tuple(
        np.random.default_rng(1).normal(size=s.log_probs.shape) for s in tree.segments
    )
    total = spec.trainable_edges
    assert sum(m.sum() for m in pruning.full_masks(tree)) == total

    width = pruning.width_pruning_mask(spec, tree, advantages, mode="top_per_branch", ratio=0.5)
    assert sum(m.sum() for m in width) == total - 8 * 10  # one of each sibling pair pruned
    width = pruning.width_pruning_mask(spec, tree, advantages, mode="best_worst", ratio=0.5)
    assert sum(m.sum() for m in width) == total - 8 * 10  # best 4 and worst 4 of 16 kept

    depth = pruning.depth_pruning_mask(spec, tree, (19, 20))
    assert sum(m.sum() for m in depth) == total - 2 * 16
    both = pruning.combine_masks(depth, width, None)
    assert sum(m.sum() for m in both) == total - 2 * 16 - 8 * 8


def test_no_split_means_nothing_to_width_prune():
    spec = ts.grpo(4, 3)
    tree = ref.random_tree(spec, 2, np.random.default_rng(0))
    advantages = tuple(np.zeros(s.log_probs.shape) for s in tree.segments)
    for mode in pruning.WIDTH_MODES:
        assert all(m.all() for m in pruning.width_pruning_mask(spec, tree, advantages, mode=mode))


def test_bad_arguments_are_one_sentence():
    spec = ts.grpo(4, 3)
    tree = ref.random_tree(spec, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside 1..4"):
        pruning.depth_pruning_mask(spec, tree, (0,))
    with pytest.raises(ValueError, match="mode"):
        pruning.width_pruning_mask(spec, tree, (), mode="random")
    with pytest.raises(ValueError, match="ratio"):
        pruning.width_pruning_mask(spec, tree, (), ratio=0.0)
