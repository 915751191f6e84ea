"""Tree specs: derived counts against an explicit enumeration of nodes, and clear errors."""

import itertools

import pytest

from tree_grpo_jax.core import tree_spec as ts


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
    assert spec.recorded_states == ref["rows"] + ref["edges"]  # parents + children


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


# ---------------------------------------------------------------------------------------------
# Sliding-window families.

FAMILIES = [
    (ts.treegrpo(10, window=4, k=2, window_start=ts.FAMILY), ts.BRANCH(2), ()),
    (ts.treegrpo(8, window=3, k=3, window_start=ts.FAMILY, num_trees=2), ts.BRANCH(3), ()),
    (ts.mixgrpo(10, 6, window=4, window_start=ts.FAMILY), ts.SDE, ()),
    (ts.branchgrpo_mix(12, (0, 3, 6), k=2, window=4, window_start=ts.FAMILY), ts.SDE, (0, 3, 6)),
]


def _by_hand(num_steps, start, width, inside, splits):
    """The plain spec of a window position, written out step by step (splits BRANCH(2))."""
    steps = []
    for i in range(num_steps):
        if i in splits:
            steps.append(ts.BRANCH(2))
        elif start <= i < start + width:
            steps.append(inside)
        else:
            steps.append(ts.ODE)
    return tuple(steps)


@pytest.mark.parametrize("family, inside, splits", FAMILIES, ids=lambda f: getattr(f, "name", ""))
def test_family_is_one_value_and_each_position_is_the_plain_spec(family, inside, splits):
    assert family.sliding and family.window_positions == family.num_steps - family.window.width + 1
    for start in range(family.window_positions):
        plain = family.at(start)
        assert not plain.sliding and plain.name == family.name
        width = family.window.width
        assert plain.steps == _by_hand(family.num_steps, start, width, inside, splits)
        ref = _enumerate(plain)
        counts = family.counts(window_start=start)
        assert counts == plain.counts()
        assert counts["leaves"] == family.leaves == ref["leaves"]
        assert counts["rollout_denoiser_calls"] == ref["calls"]
        assert counts["trainable_edges"] == ref["edges"]
        assert counts["training_forward_rows"] == ref["rows"]
        assert family.branch_ks == plain.branch_ks
        assert family.level_sizes == plain.level_sizes
        # Stored states: the plain spec's stochastic steps, or for a mixed family every
        # non-split step (recorded with its window flag).
        recorded = [i for i, step in enumerate(plain.steps) if step.stochastic]
        if family.name == "branchgrpo_mix":
            recorded = list(range(family.num_steps))
        want = sum(plain.nodes_in[i] + plain.nodes_out[i] for i in recorded)
        assert family.recorded_states == want


def test_presets_give_equal_families_for_every_position():
    for make in (
        lambda: ts.treegrpo(10, 4, 2, ts.FAMILY),
        lambda: ts.mixgrpo(10, 4, 3, ts.FAMILY),
        lambda: ts.branchgrpo_mix(20, (0, 3, 6, 9), window=4, window_start=ts.FAMILY),
    ):
        a, b = make(), make()
        assert a == b and hash(a) == hash(b)
        assert a != a.at(0) and a.at(1) != a.at(2)
    # The int form of a preset is the family's plain spec of that position.
    assert ts.treegrpo(10, 4, 2, 3) == ts.treegrpo(10, 4, 2, ts.FAMILY).at(3)
    assert ts.mixgrpo(10, 4, 3, 5) == ts.mixgrpo(10, 4, 3, ts.FAMILY).at(5)


@pytest.mark.parametrize("family, inside, splits", FAMILIES, ids=lambda f: getattr(f, "name", ""))
def test_family_blocks_cover_the_steps_of_every_position(family, inside, splits):
    """The rollout program: at each start the blocks' bounds tile 0..N in order, ODE blocks
    over ODE steps, stochastic blocks over stochastic steps, mixed blocks' window flags
    matching the plain spec, and the segment blocks' shapes never move."""
    shapes = None
    for start in range(family.window_positions):
        plain = family.at(start)
        covered = []
        for block in family.blocks:
            begin, end = block.bounds(start)
            covered += list(range(begin, end))
            for i in range(begin, end):
                assert plain.nodes_in[i] == block.nodes_in
                assert plain.level_of_depth(i + 1) == block.level
                kind = plain.steps[i].kind
                if block.kind == "ode":
                    assert kind is ts.Kind.ODE
                elif block.kind == "stochastic":
                    assert plain.steps[i] == block.step
                else:
                    assert kind in (ts.Kind.ODE, ts.Kind.SDE)
        assert covered == list(range(family.num_steps))
        now = [(b.num_steps, b.nodes_in, b.step.k, b.level) for b in family.segment_blocks]
        assert shapes is None or now == shapes
        shapes = now


def test_position_dependent_counts_need_a_window_start():
    family = ts.treegrpo(10, 4, 2, ts.FAMILY)
    assert family.leaves == 16
    for ask in (
        lambda: family.counts(),
        lambda: family.nodes_in,
        lambda: family.rollout_denoiser_calls(),
        lambda: family.trainable_edges,
    ):
        with pytest.raises(ts.SpecError, match="depends on the window position") as info:
            ask()
        assert "\n" not in str(info.value) and str(info.value).endswith(".")
    assert ts.grpo(4, 2).counts(window_start=3) == ts.grpo(4, 2).counts()  # no window: ignored
    assert ts.grpo(4, 2).at(3) == ts.grpo(4, 2)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ts.TreeSpec((ts.SDE,) * 4, window=ts.Window(2, ts.BRANCH(2))), "ODE steps"),
        (lambda: ts.TreeSpec((ts.ODE,) * 4, window=ts.Window(5, ts.SDE)), "does not fit"),
        (lambda: ts.TreeSpec((ts.ODE,) * 4, window=ts.Window(2, ts.ODE)), "no window"),
        (lambda: ts.treegrpo(10, 4, 2, ts.FAMILY).at(7), "runs past the last step"),
        (lambda: ts.treegrpo(10, 0, 2, ts.FAMILY), "at least one step"),
    ],
)
def test_bad_windows_raise_one_sentence(make, message):
    with pytest.raises(ts.SpecError, match=message) as info:
        make()
    assert "\n" not in str(info.value) and str(info.value).endswith(".")
