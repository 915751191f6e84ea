"""Tree specs: derived counts against an explicit enumeration of nodes, and clear errors."""

import itertools

import pytest

from tree_grpo_jax import tree_spec as ts


def _enumerate(spec):
    """Walks the spec node by node: every node is a tuple path (tree, child, child, ...)."""
    level = [(r,) for r in range(spec.num_trees)]
    calls = edges = rows = rows_edgewise = 0
    for step in spec.steps:
        k = step.k
        children = [node + (c,) for node in level for c in range(k)]
        calls += len(level)
        if step.kind is not ts.Kind.ODE:
            edges += len(children)
            rows += len(level)
            rows_edgewise += len(children)
        level = children
    return dict(leaves=len(level), calls=calls, edges=edges, rows=rows, rows_edgewise=rows_edgewise)


PRESET_CASES = [
    ts.grpo(10, 16),
    ts.grpo(10, 8, shared_init_noise=True),
    ts.mixgrpo(10, 16, window=4, window_start=3),
    ts.treegrpo(10, window=4, k=2),
    ts.treegrpo(10, window=3, k=3, window_start=6, num_trees=2),
    ts.branchgrpo(20, (0, 3, 6, 9)),
    ts.branchgrpo(12, (2, 5), k=3, num_trees=3),
    ts.branchgrpo_mix(20, (0, 3, 6, 9), window=4, window_start=2),
    ts.deterministic(7),
]


@pytest.mark.parametrize("spec", PRESET_CASES, ids=lambda s: s.describe())
def test_counts_match_enumeration(spec):
    ref = _enumerate(spec)
    assert spec.leaves == ref["leaves"]
    assert spec.rollout_denoiser_calls() == ref["calls"]
    assert spec.rollout_denoiser_calls(guidance=True) == 2 * ref["calls"]
    assert spec.trainable_edges == ref["edges"]
    assert spec.training_forward_rows() == ref["rows"]
    assert spec.training_forward_rows(amortized=False) == ref["rows_edgewise"]
    assert spec.training_forward_rows(guidance=True) == 2 * ref["rows"]


def test_documented_counts():
    assert ts.grpo(10, 16).counts() == dict(
        leaves=16,
        rollout_denoiser_calls=160,
        trainable_edges=160,
        training_forward_rows=160,
        training_forward_rows_edgewise=160,
    )
    tree = ts.treegrpo(10, window=4, k=2)
    # 1+2+4+8 calls in the window, then 6 ODE steps on 16 nodes.
    assert tree.rollout_denoiser_calls() == 15 + 6 * 16
    assert tree.trainable_edges == 2 + 4 + 8 + 16
    assert tree.training_forward_rows() == 15
    branch = ts.branchgrpo(20, (0, 3, 6, 9))
    assert branch.leaves == 16
    assert branch.rollout_denoiser_calls() == 1 + 2 * 3 + 4 * 3 + 8 * 3 + 16 * 10


def test_runs_partition_the_steps():
    for spec in PRESET_CASES:
        covered = list(itertools.chain.from_iterable(run.steps for run in spec.runs))
        assert covered == list(range(spec.num_steps))
        for run in spec.runs:
            assert all(spec.steps[i] == run.step for i in run.steps)
            if run.step.kind is ts.Kind.BRANCH:
                assert run.num_steps == 1


def test_window_slides_and_wraps():
    starts = [ts.sliding_window_start(it, num_steps=10, width=4, every=2) for it in range(16)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 0, 0]
    assert max(starts) + 4 <= 10


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ts.branchgrpo(20, (0, 3, 25)), r"split step\(s\) \[25\] are outside"),
        (lambda: ts.branchgrpo(20, (0,), k=1), "a branch needs k >= 2"),
        (lambda: ts.treegrpo(10, window=4, k=2, window_start=7), "runs past the last step"),
        (lambda: ts.mixgrpo(10, 4, window=0), "at least one step"),
        (lambda: ts.treegrpo(10, num_trees=0), "no leaves"),
        (lambda: ts.grpo(10, 0), "group_size must be at least 1"),
        (lambda: ts.TreeSpec(()), "at least one denoising step"),
        (lambda: ts.TreeSpec((ts.Step(ts.Kind.SDE, 2),)), "only BRANCH steps have k > 1"),
        (lambda: ts.TreeSpec((ts.BRANCH(2, 0.0),)), "noise_scale"),
    ],
)
def test_bad_specs_raise_one_sentence(make, message):
    with pytest.raises(ts.SpecError, match=message) as info:
        make()
    text = str(info.value)
    assert "\n" not in text and text.endswith(".")


def test_specs_are_hashable_static_values():
    assert hash(ts.treegrpo(10)) == hash(ts.treegrpo(10))
    assert ts.treegrpo(10) != ts.treegrpo(10, window_start=1)
