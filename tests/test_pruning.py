"""Depth and width pruning masks against the node-by-node reference."""

import numpy as np
import pytest
import reference_tree as ref
from test_advantages import expected_arrays, random_spec

from tree_grpo_jax import pruning
from tree_grpo_jax import tree_spec as ts

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
    got = pruning.depth_pruning_mask(
        spec, tree, depths, iteration=iteration, slide_every=slide_every, stop_depth=stop_depth
    )
    want = ref.depth_pruning_reference(
        forest, depths, iteration, slide_every, stop_depth, pruning.last_split_step(spec)
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
