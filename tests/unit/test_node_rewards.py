"""Node rewards and node pruning against independent references: the rollout's x0 estimates
against Tweedie's formula in float64 numpy, the node values, per-edge gain credit, pruning
masks, the kept leaves' credit and the saved rows against brute-force loops over explicit
nodes (reference_tree.py), and one training iteration of the tiny tree with them on."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import reference_tree as ref

from tree_grpo_jax import methods
from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import pruning, sampling
from tree_grpo_jax.core import tree_spec as ts
from tree_grpo_jax.core.rollout import rollout
from tree_grpo_jax.methods import node_credit

SHAPE = (2, 3)


# ---------------------------------------------------------------------------------------------
# The rollout's x0 estimates.


def linear_denoiser(params, x, t, cond):
    return (
        x * params["a"]
        + t[:, None, None] / 1000.0 * params["b"]
        + cond.mean(axis=(1, 2))[:, None, None]
    )


PARAMS = {"a": jnp.float32(0.7), "b": jnp.asarray(np.linspace(-1, 1, 6).reshape(SHAPE))}


def _np_prediction(x, t, cond_mean):
    b = np.asarray(PARAMS["b"], np.float64)
    return x * 0.7 + float(t) / 1000.0 * b + cond_mean


def _np_x0(schedule, i, x, pred):
    """Tweedie's estimate written from the formulas: flow x - sigma v; DDIM epsilon
    (x - sqrt(1 - a) eps) / sqrt(a); v-prediction sqrt(a) x - sqrt(1 - a) v."""
    if isinstance(schedule, sampling.FlowSchedule):
        return x - float(schedule.sigmas[i]) * pred
    a = float(schedule.alpha_bar[i])
    if schedule.prediction_type == "epsilon":
        return (x - np.sqrt(1 - a) * pred) / np.sqrt(a)
    return np.sqrt(a) * x - np.sqrt(1 - a) * pred


SCHEDULES = {
    "flow": lambda n: sampling.make_flow_schedule(n, shift=3.0),
    "ddim_eps": lambda n: sampling.make_ddim_schedule(n),
    "ddim_v": lambda n: sampling.make_ddim_schedule(n, prediction_type="v_prediction"),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_the_rollout_keeps_tweedie_s_estimate_at_each_recorded_parent(kind):
    spec = ts.branchgrpo(5, split_steps=(0, 2), k=2)
    schedule = SCHEDULES[kind](spec.num_steps)
    cond = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 4))
    key = jax.random.PRNGKey(7)
    run = lambda record: rollout(  # noqa: E731
        linear_denoiser, PARAMS, cond, key, schedule, spec=spec, sample_shape=SHAPE,
        record_x0=record,
    )  # fmt: skip
    plain, every, branches = run("none"), run("all_steps"), run("branch_points")
    cond_mean = np.asarray(cond, np.float64).mean(axis=(1, 2))
    for seg, seg_all, seg_branch, seg_plain in zip(
        every.segments, every.segments, branches.segments, plain.segments
    ):
        assert seg_plain.x0_hats is None
        np.testing.assert_array_equal(np.asarray(seg.children), np.asarray(seg_plain.children))
        assert (seg_branch.x0_hats is not None) == (seg.k > 1)
        parents = np.asarray(seg.parents, np.float64)
        for t, i in enumerate(seg.step_indices):
            pred = _np_prediction(parents[t], schedule.timesteps[i], cond_mean[:, None, None, None])
            want = _np_x0(schedule, int(i), parents[t], pred)
            np.testing.assert_allclose(np.asarray(seg_all.x0_hats[t]), want, rtol=2e-5, atol=2e-5)
            if seg_branch.x0_hats is not None:
                np.testing.assert_allclose(np.asarray(seg_branch.x0_hats[t]), want, atol=2e-5)
    # the estimates differ node by node and step by step: the check above can tell them apart
    first = np.asarray(every.segments[1].x0_hats)
    assert np.ptp(first) > 0.1


# ---------------------------------------------------------------------------------------------
# Credit.


def _config(method, mix=1.0, ddof=0, record="all_steps", pruning_mode="none", **extra):
    a = {
        "clip": 1e9,
        "fusion": "mean",
        "fusion_alpha": 1.0,
        "std_ddof": ddof,
        "edge_normalization": "none",
        "branch_normalization": "leaf",
        "node_rewards": record,
        "node_mix": mix,
        "node_pruning": pruning_mode,
        "node_pruning_threshold": extra.get("threshold", 0.5),
        "node_pruning_quantile": extra.get("quantile", 0.25),
        "node_pruning_keep": extra.get("keep", 0.5),
    }
    return ml_collections.ConfigDict({"tree": {"method": method}, "advantage": a})


CASES = [  # (method, spec, window start, x0 kept)
    ("treegrpo", ts.treegrpo(6, 3, 2, window_start=ts.FAMILY, num_trees=2), 1, "all_steps"),
    ("grpo", ts.grpo(5, 4), 0, "all_steps"),
    ("grpo", ts.grpo(4, 3, shared_init_noise=True), 0, "all_steps"),
    ("mixgrpo", ts.mixgrpo(6, 3, window=3, window_start=ts.FAMILY), 2, "all_steps"),
    ("branchgrpo", ts.branchgrpo(7, split_steps=(0, 3, 5), k=2), 0, "branch_points"),
    ("branchgrpo", ts.branchgrpo(6, split_steps=(1, 3), k=3, num_trees=2), 0, "all_steps"),
    ("branchgrpo_mix", ts.branchgrpo_mix(7, (0, 4), 2, window=2, window_start=ts.FAMILY), 1,
     "all_steps"),
    ("treegrpo", ts.treegrpo(6, 3, 2, window_start=ts.FAMILY, num_trees=2), 1, "leaf_means"),
    ("branchgrpo", ts.branchgrpo(6, split_steps=(1, 3), k=3, num_trees=2), 0, "leaf_means"),
]  # fmt: skip


def _random_values(tree, rng, record, num_prompts):
    """Node values laid out as the trainer gives them: per segment [T, P, n], or None."""
    return tuple(
        None
        if record == "leaf_means" or (record == "branch_points" and seg.k == 1)
        else rng.normal(size=(seg.num_steps, num_prompts, seg.parents.shape[2])).astype(np.float32)
        for seg in tree.segments
    )


@pytest.mark.parametrize("mix", [1.0, 0.3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gain_credit_matches_a_loop_over_explicit_nodes(case, mix):
    method, spec, start, record = CASES[case]
    rng = np.random.default_rng(case)
    num_prompts = 2
    tree = ref.random_tree(spec, num_prompts, rng, start)
    rewards = rng.normal(size=(num_prompts, spec.leaves)).astype(np.float32)
    values = _random_values(tree, rng, record, num_prompts)
    forest = ref.build_forest(spec, tree, rewards, start)
    recorded = ref.recorded_values(tree, values)
    gains = ref.node_gain_reference(forest, recorded)
    leaf = ref.treegrpo_reference(forest)  # every case's leaf credit is TreeGRPO's
    got = methods.get(method).clipped_advantages(
        _config(method, mix, record=record), spec, tree, jnp.asarray(rewards), node_values=values
    )
    checked = 0
    for node in ref.edges(forest):
        want = mix * gains[node] + (1 - mix) * leaf[node]
        np.testing.assert_allclose(ref.edge_value(got, tree, node), want, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked > 0 and np.std([gains[n] for n in ref.edges(forest)]) > 0.3


def test_node_values_pass_through_unrecorded_chains_to_the_leaves():
    """branch_points on BranchGRPO's tree: an SDE node's value is the next recorded value
    below it, the leaf's reward after the last split."""
    spec = ts.branchgrpo(6, split_steps=(0, 3), k=2)
    rng = np.random.default_rng(3)
    tree = ref.random_tree(spec, 1, rng)
    rewards = rng.normal(size=(1, spec.leaves))
    values = _random_values(tree, rng, "branch_points", 1)
    forest = ref.build_forest(spec, tree, rewards)
    recorded = ref.recorded_values(tree, values)
    ends = adv.edge_end_values(tree, jnp.asarray(rewards), values)
    for node in ref.edges(forest):
        for seg, (parents, children) in zip(tree.segments, ends):
            steps = list(seg.step_indices)
            if node.step in steps:
                t = steps.index(node.step)
                parent_index = node.index // seg.k
                want_child = ref.node_value(node, recorded)
                want_parent = ref.node_value(node.parent, recorded)
                assert np.isclose(children[t, 0, node.index], want_child, atol=1e-6)
                assert np.isclose(parents[t, 0, parent_index], want_parent, atol=1e-6)
    leaf_edge = [n for n in ref.edges(forest) if n.depth == spec.num_steps][0]
    assert ref.node_value(leaf_edge, recorded) == leaf_edge.reward


def test_a_mixed_segment_scores_only_its_stochastic_steps():
    """BranchGRPO-Mix with all_steps: the trainer decodes the estimates of the steps its
    window makes stochastic (`node_scoring.estimates`), lays NaN at the others, and the
    credit of the edge above such a step takes the value below it, down to the leaf's
    reward (the loop over explicit nodes with those steps unrecorded)."""
    from tree_grpo_jax.run import node_scoring

    spec = ts.branchgrpo_mix(7, (0, 4), 2, window=2, window_start=ts.FAMILY)
    rng = np.random.default_rng(7)
    tree = ref.random_tree(spec, 2, rng, 1)
    x0 = [rng.normal(size=(*s.parents.shape[:3], 3)).astype(np.float32) for s in tree.segments]
    tree = dataclasses.replace(
        tree, segments=tuple(dataclasses.replace(s, x0_hats=x) for s, x in zip(tree.segments, x0))
    )
    estimates, shapes = node_scoring.estimates(tree)
    active = [np.asarray(s.active, bool) for s in tree.segments]
    scored = sum(int(a.sum()) * s.parents.shape[2] for a, s in zip(active, tree.segments))
    assert 0 < scored < sum(s.parents.shape[0] * s.parents.shape[2] for s in tree.segments)
    assert estimates.shape == (2, scored, 3)
    # a reward that reads the estimate: each scored parent's value is its own first pixel
    values = node_scoring.per_segment(estimates[..., 0], shapes)
    for a, x, v in zip(active, x0, values):
        np.testing.assert_array_equal(v[a], x[a][..., 0])
        assert np.isnan(v[~a]).all()
    rewards = rng.normal(size=(2, spec.leaves)).astype(np.float32)
    forest = ref.build_forest(spec, tree, rewards, 1)
    gains = ref.node_gain_reference(forest, ref.recorded_values(tree, values))
    got = adv.node_gain_advantages(tree, jnp.asarray(rewards), values)
    for node in ref.edges(forest):
        np.testing.assert_allclose(ref.edge_value(got, tree, node), gains[node], atol=1e-4)
    assert np.all(np.isfinite(np.concatenate([np.ravel(g) for g in got])))


def test_constant_node_values_and_rewards_give_zero_gain_credit():
    spec = ts.treegrpo(5, window=2, k=3, window_start=1)
    tree = ref.random_tree(spec, 2, np.random.default_rng(0))
    values = tuple(
        np.full((s.num_steps, 2, s.parents.shape[2]), 7.3, np.float32) for s in tree.segments
    )
    got = adv.node_gain_advantages(tree, jnp.full((2, spec.leaves), 7.3), values)
    assert all(np.all(np.asarray(a) == 0.0) for a in got)


# ---------------------------------------------------------------------------------------------
# Node pruning.

PRUNE_CASES = [  # (method, spec, window start)
    ("treegrpo", ts.treegrpo(6, window=4, k=2, window_start=ts.FAMILY, num_trees=2), 1),
    ("treegrpo", ts.treegrpo(5, window=3, k=3, window_start=ts.FAMILY), 2),
    ("branchgrpo", ts.branchgrpo(7, split_steps=(0, 2, 4), k=2), 0),
]


RULES = [("cluster", 0.5), ("cluster", 0.9), ("quantile", 0.25), ("quantile", 0.6),
         ("variance", 0.5), ("variance", 0.7)]  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", range(len(PRUNE_CASES)))
def test_node_pruning_matches_a_loop_over_explicit_nodes(case, rule):
    method, spec, start = PRUNE_CASES[case]
    mode, level = rule
    rng = np.random.default_rng(10 + case)
    num_prompts = 3
    tree = ref.random_tree(spec, num_prompts, rng, start)
    rewards = rng.normal(size=(num_prompts, spec.leaves)).astype(np.float32)
    values = _random_values(tree, rng, "all_steps", num_prompts)
    config = _config(method, 0.5, pruning_mode=mode, threshold=level, quantile=level, keep=level)
    forest = ref.build_forest(spec, tree, rewards, start)
    recorded = ref.recorded_values(tree, values)
    plain = spec.at(start)
    dead, dropped = ref.node_pruning_reference(forest, plain, recorded, mode, level, level, level)

    alive, decisions = node_credit.survival(config, tree, values)
    masks = pruning.alive_edge_masks(tree, alive)
    got = methods.get(method).clipped_advantages(
        config, spec, tree, jnp.asarray(rewards), node_values=values, alive=alive
    )
    gains = ref.node_gain_reference(forest, recorded, dead=frozenset(dead))
    leaf = ref.surviving_leaf_reference(forest, dead)
    for node in ref.edges(forest):
        assert bool(ref.edge_value(masks, tree, node)) == (node not in dead)
        if node not in dead:
            want = 0.5 * gains[node] + 0.5 * leaf[node]
            np.testing.assert_allclose(ref.edge_value(got, tree, node), want, atol=1e-4)
    assert sum(int(d[2].sum()) for d in decisions) == len(dropped) > 0
    saved = ref.saved_rows_reference(forest, dropped, plain.num_steps)
    assert pruning.saved_rollout_rows(plain, decisions) == saved
    # a node dropped before the last step leaves rows below it (the reference is not empty)
    assert (saved > 0) == any(m.depth < plain.num_steps - 1 for m in dropped)
    assert pruning.saved_rollout_rows(plain, decisions, guidance=True) == 2 * saved
    # the rules whose count follows from the tree: the plan (per prompt) is what the loop dropped
    planned = pruning.planned_node_pruning(plain, mode, quantile=level, keep=level)
    if mode != "cluster":
        assert (planned[0] * num_prompts, planned[1] * num_prompts) == (len(dropped), saved)


def test_variance_filtering_keeps_both_tails():
    """Pro-GRPO's OVF keeps the most spread subset: of 0, 1, 4.9, 5, 5.1, 9, 10 keep 4 ->
    the two lowest and the two highest, never the cluster at 5."""
    values = np.array([5.0, 0.0, 4.9, 10.0, 1.0, 5.1, 9.0])
    drop = pruning._drop(values, "variance", 0.5, 0.25, keep=4 / 7)
    np.testing.assert_array_equal(values[~drop], [0.0, 10.0, 1.0, 9.0])


@pytest.mark.parametrize("spread", [1.0, 1e-6, 1e-7, 1e3])
def test_variance_filtering_keeps_the_largest_variance_subset_at_any_scale(spread):
    """Against the search over every subset of the kept size (exact variances): the choice
    must not depend on the reward's units, as it did with an absolute tolerance (values 1e-7
    apart kept the first subset tried)."""
    import statistics

    rng = np.random.default_rng(int(-np.log10(spread)) + 20)
    for draw in range(100):
        m = int(rng.integers(3, 9))
        keep = float(rng.choice([0.3, 0.5, 0.7]))
        values = spread * rng.random(m)
        kept = ~pruning._drop(values, "variance", 0.5, 0.25, keep=keep)
        best = ~np.asarray(ref._variance_drop(list(values), keep))
        assert kept.sum() == best.sum(), (draw, values, keep)
        got, want = (statistics.pvariance(values[k].tolist()) for k in (kept, best))
        assert got == pytest.approx(want, rel=1e-9, abs=0), (draw, values, keep)


def test_variance_filtering_of_closely_spaced_values():
    """The issue's case: of 0, 1e-7, 2e-7, 9e-7 keep 2 -> the ends (variance 2.025e-13), not
    the two highest (1.225e-13)."""
    drop = pruning._drop(np.array([0.0, 1e-7, 2e-7, 9e-7]), "variance", 0.5, 0.25, keep=0.5)
    np.testing.assert_array_equal(np.flatnonzero(~drop), [0, 3])


def test_a_level_that_would_keep_fewer_than_two_nodes_drops_none():
    spec = ts.treegrpo(4, window=2, k=2, window_start=0)
    tree = ref.random_tree(spec, 1, np.random.default_rng(1))
    values = tuple(np.zeros((1, 1, s.parents.shape[2]), np.float32) for s in tree.segments)
    alive, decisions = pruning.node_survival(tree, values, mode="cluster", threshold=0.9)
    assert all(a.all() for a in alive) and not decisions[0][2].any()


# ---------------------------------------------------------------------------------------------
# Settings and counts.


def test_defaults_keep_the_rollout_and_counts_as_they_were():
    from tree_grpo_jax.config import base_config

    c = base_config()
    assert c.advantage.node_rewards == "none" and c.advantage.node_pruning == "none"
    method = methods.get(c.tree.method)
    assert "record_x0" not in method.objective.rollout_options(c)
    assert "node_decodes" not in method.training_counts(c)


def test_the_tiny_tree_decodes_fifteen_node_estimates_per_prompt():
    """configs/tiny.py's tree, a window of 4 BRANCH(2) steps: 1 + 2 + 4 + 8 parents."""
    from configs import tiny

    c = tiny.get_config()
    c.advantage.node_rewards = "all_steps"
    counts = methods.get("treegrpo").training_counts(c)
    assert counts["node_decodes"] == 1 + 2 + 4 + 8 and counts["leaves"] == 16
    c.advantage.node_rewards = "branch_points"
    assert methods.get("treegrpo").training_counts(c)["node_decodes"] == 15
    # BranchGRPO's tree: all_steps keeps every stochastic parent, branch_points the splits'
    c.tree.method, c.sampling.num_steps, c.tree.split_steps = "branchgrpo", 6, (0, 3)
    assert methods.get("branchgrpo").training_counts(c)["node_decodes"] == 1 + 2
    c.advantage.node_rewards = "all_steps"
    assert (
        methods.get("branchgrpo").training_counts(c)["node_decodes"] == 1 + 2 + 2 + 2 + 4 + 4
    )  # steps 0..5
    # BranchGRPO-Mix's: the steps outside its window are deterministic, so not scored
    c.tree.method, c.sampling.num_steps, c.tree.split_steps = "branchgrpo_mix", 10, (0, 2, 4, 6)
    c.tree.window, c.tree.window_start = 4, 0
    assert methods.get("branchgrpo_mix").training_counts(c)["node_decodes"] == 1 + 2 + 2 + 4 + 4 + 8


@pytest.mark.parametrize(
    "method, field, value, words",
    [
        ("treegrpo", "node_rewards", "everywhere", "advantage.node_rewards must be one of"),
        ("treegrpo", "node_mix", 1.5, "advantage.node_mix must be in [0, 1]"),
        ("grpo", "node_rewards", "branch_points", "needs BRANCH steps"),
        ("grpo", "node_rewards", "leaf_means", "'leaf_means' needs BRANCH steps"),
        ("diffusion_nft", "node_rewards", "all_steps", "trains none"),
        ("treegrpo", "node_pruning", "cluster", "needs node values"),
        ("treegrpo", "node_mix", 0.5, "but node rewards are off: set advantage.node_rewards"),
    ],
)
def test_bad_node_settings_are_refused_in_one_sentence(method, field, value, words):
    from configs import tiny
    from tree_grpo_jax.config import checks

    c = tiny.get_config()
    c.tree.method = method
    c.advantage[field] = value
    with pytest.raises(checks.ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        checks.validate(c)


def test_leaf_means_decode_nothing_and_prune_nothing():
    """node_rewards="leaf_means" backs the leaves' rewards up the tree: the rollout keeps
    no estimate, no decode is counted, and node pruning (which needs scored estimates) is
    refused in one sentence."""
    from configs import tiny
    from tree_grpo_jax.config import checks

    c = tiny.get_config()
    c.advantage.node_rewards = "leaf_means"
    method = methods.get(c.tree.method)
    assert "record_x0" not in method.objective.rollout_options(c)
    assert "node_decodes" not in method.training_counts(c)
    checks.validate(c)
    c.advantage.node_pruning = "variance"
    with pytest.raises(checks.ConfigError, match="'leaf_means' scores none"):
        checks.validate(c)


def test_node_pruning_refuses_a_credit_it_cannot_recompute():
    from configs import tiny
    from tree_grpo_jax.config import checks

    c = tiny.get_config()
    c.advantage.node_rewards, c.advantage.node_pruning = "all_steps", "quantile"
    checks.validate(c)  # TreeGRPO's credit: fine
    c.advantage.edge_normalization = "per_depth"
    with pytest.raises(checks.ConfigError, match="recomputes TreeGRPO's leaf credit"):
        checks.validate(c)


# ---------------------------------------------------------------------------------------------
# One iteration.


def test_one_small_iteration_with_node_rewards_and_pruning(tmp_path):
    """The tests' small TreeGRPO run (random tiny model, 4 steps, a window of 3 BRANCH(2)
    steps, guidance on) with node rewards and variance filtering: 1 + 2 + 4 estimates per
    prompt are scored, two of each prompt's four nodes are dropped at the last split, their
    edges leave the loss, and the saved rows are the dropped nodes' children at the last
    step, twice with guidance."""
    from small_configs import small_config

    from tree_grpo_jax.run import loop as train

    c = small_config("treegrpo")
    c.tree.window = 3
    c.eval.every = 0
    c.checkpoint.every = 0
    c.advantage.node_rewards = "all_steps"
    c.advantage.node_pruning = "variance"
    c.advantage.node_pruning_keep = 0.5
    trainer, state = train.setup(c, str(tmp_path))
    state, metrics = trainer.iteration(state, 0)
    assert methods.get("treegrpo").training_counts(c)["node_decodes"] == 1 + 2 + 4
    assert metrics["node_decodes"] == 7 * c.prompts.batch_size
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["node_reward_mean"])
    dropped = metrics["node_pruned"]
    assert dropped > 0
    assert metrics["node_saved_rollout_rows"] == dropped * 2 * 2  # k children, x2 guidance
    # variance filtering keeps a set number: the counts planned from the tree are the run's
    planned = methods.get("treegrpo").training_counts(c)
    assert dropped == planned["node_pruned"] * c.prompts.batch_size == 2 * 2
    assert metrics["node_saved_rollout_rows"] == planned["node_saved_rollout_rows"] * 2
    # each dropped node takes its split edge and its two children's edges out of the loss
    assert metrics["trained_edges"] == (2 + 4 + 8) * c.prompts.batch_size - 3 * dropped


def test_one_small_iteration_with_leaf_means(tmp_path):
    """The same small run with node_rewards="leaf_means": no estimate decoded, every edge
    trained, a finite loss from the backed-up gains."""
    from small_configs import small_config

    from tree_grpo_jax.run import loop as train

    c = small_config("treegrpo")
    c.tree.window = 3
    c.eval.every = 0
    c.checkpoint.every = 0
    c.advantage.node_rewards = "leaf_means"
    trainer, state = train.setup(c, str(tmp_path))
    state, metrics = trainer.iteration(state, 0)
    assert "node_decodes" not in metrics and np.isfinite(metrics["loss"])
    assert metrics["trained_edges"] == (2 + 4 + 8) * c.prompts.batch_size


@pytest.mark.parametrize(
    "extra, shown",
    [
        ({}, ""),  # the demo's line, as docs/reading-a-run.md shows it
        ({"replayed_rows": 120}, " replayed_rows=120"),  # train.replay
        ({"node_decodes": 28, "node_pruned": 4, "node_saved_rollout_rows": 16}, " node_pruned=4"),
    ],
)
def test_the_progress_line_shows_replayed_rows_and_node_pruned_only_when_on(capsys, extra, shown):
    """An iteration of the loop with a stand-in trainer: its metrics, as the trainer reports
    them (with replay, with node pruning), become the line."""
    from types import SimpleNamespace

    from configs import tiny
    from tree_grpo_jax.run import loop as train
    from tree_grpo_jax.run import reporting
    from tree_grpo_jax.run.host_state import HostState

    metrics = {"reward_mean": -0.101, "loss": 1.89e-08, "approx_kl": 3.43e-15,
               "clip_fraction": 0.0, "time_iteration": 4.06, "train_rows": 60, **extra}  # fmt: skip
    trainer = SimpleNamespace(
        config=tiny.get_config(),
        iteration=lambda state, iteration: (state, dict(metrics)),
        host_state=HostState(SimpleNamespace(state_dict=dict), None, None),
        method=methods.get("treegrpo"),
        workdir="",
    )
    run = train._Run(trainer, None, {"eval": []}, reporting.NullWriter(), None, {}, 0.0)
    assert run._iteration(0, 0, reporting.Progress(10)) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("[   1/10]   4.06s/it elapsed 0:00 eta -:-- | "), line
    fields = "reward_mean=-0.101 loss=1.89e-08 approx_kl=3.43e-15 clip_fraction=0"
    assert line.endswith(f" | {fields}{shown}"), line


@pytest.mark.slow
def test_one_tiny_iteration_with_node_rewards_and_pruning(tmp_path):
    """configs/tiny.py's tree at two prompts: the node estimates are decoded and scored (15
    per prompt), some nodes are dropped, their edges leave the loss, and the rows a pruned
    sampler would skip are reported."""
    from configs import tiny
    from tree_grpo_jax.run import loop as train

    c = tiny.get_config()
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    c.advantage.node_rewards = "all_steps"
    c.advantage.node_mix = 0.5
    c.advantage.node_pruning = "quantile"
    c.advantage.node_pruning_quantile = 0.3
    trainer, state = train.setup(c, str(tmp_path))
    state, metrics = trainer.iteration(state, 0)
    per_prompt = methods.get("treegrpo").training_counts(c)["node_decodes"]
    assert metrics["node_decodes"] == per_prompt * 2 == 30
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["node_reward_mean"])
    assert metrics["node_pruned"] > 0 and metrics["node_saved_rollout_rows"] > 0
    unpruned_edges = (2 + 4 + 8 + 16) * 2
    assert 0 < metrics["trained_edges"] < unpruned_edges
