"""Transitions and the PPO-clip objective, on trees from the real rollout.

The denoiser is analytic and elementwise, so the same node gives bit-identical predictions
whatever batch it sits in; rows seen by the denoiser are counted at trace time.
"""

import functools

import jax
import jax.numpy as jnp
import method_advantages
import numpy as np
import pytest

from tree_grpo_jax.core import pruning, sampling
from tree_grpo_jax.core import tree_spec as ts
from tree_grpo_jax.core.loss import LossInputs, PPOSettings, ppo_loss, score_actions
from tree_grpo_jax.core.rollout import rollout
from tree_grpo_jax.core.transitions import Transitions, gather_transitions, minibatches

SAMPLE_SHAPE = (1, 3, 3)
P, L, D = 2, 3, 4
GUIDANCE = 3.0
PARAMS = {"a": jnp.float32(0.8), "b": jnp.float32(0.5)}
COND = jax.random.normal(jax.random.PRNGKey(1), (P, L, D))
UNCOND = jax.random.normal(jax.random.PRNGKey(2), (L, D))
MIXED = ts.TreeSpec((ts.SDE, ts.BRANCH(3), ts.ODE, ts.SDE, ts.BRANCH(2, noise_scale=1.5)), 2)

ROWS_SEEN: list[int] = []  # batch sizes the denoiser was traced or called with


def denoiser(params, x, t, cond):
    ROWS_SEEN.append(x.shape[0])
    c = cond.mean(axis=(1, 2)).reshape(-1, 1, 1, 1)
    return jnp.tanh(params["a"] * x) + params["b"] * c + 1e-3 * t.reshape(-1, 1, 1, 1)


@functools.cache
def rolled_out(spec, split_log_prob="sampled", window_start=0):
    """(schedule, tree) for P prompts, guidance on."""
    schedule = sampling.make_ddim_schedule(spec.num_steps, eta=1.0)
    tree = rollout(
        denoiser,
        PARAMS,
        COND,
        jax.random.PRNGKey(0),
        schedule,
        spec=spec,
        sample_shape=SAMPLE_SHAPE,
        uncond=UNCOND,
        guidance_scale=GUIDANCE,
        window_start=window_start,
        split_log_prob=split_log_prob,
    )
    return schedule, jax.tree_util.tree_map(np.asarray, tree)


@functools.partial(jax.jit, static_argnames=("clip_range", "kl"))
def loss_and_grad(params, batch, schedule, clip_range, ref_params=None, kl=False):
    settings = PPOSettings(
        denoiser, kl_beta=0.1 if kl else 0.0, guidance_scale=GUIDANCE, clip_range=clip_range
    )

    def loss(p):
        return ppo_loss(
            p,
            batch,
            settings,
            LossInputs(schedule, COND, uncond=UNCOND, ref_params=ref_params if kl else None),
        )

    return jax.value_and_grad(loss, has_aux=True)(params)


# The small advantage graphs compile faster than they run op by op.
advantages_of = jax.jit(method_advantages.advantages_of, static_argnums=(0, 1))


def random_rewards(spec, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(P, spec.leaves)), jnp.float32)


def one_batch(transitions: Transitions) -> Transitions:
    """All rows in one minibatch of fixed size (one compile for every test below)."""
    (batch,) = minibatches(transitions, jax.random.PRNGKey(5), 32)
    return batch


# ---------------------------------------------------------------------------------------------
# Transitions.


def test_gather_holds_every_edge_once_with_its_parent():
    _, tree = rolled_out(MIXED)
    advantages = advantages_of("branchgrpo", MIXED, tree, random_rewards(MIXED))
    tr = gather_transitions(tree, advantages)
    assert tr.num_rows == sum(MIXED.nodes_in[i] for i in MIXED.trainable_steps) * P
    assert tr.num_edges == MIXED.trainable_edges * P
    assert tr.actions.shape == (tr.num_rows, 3, *SAMPLE_SHAPE)
    assert tr.mask.sum(axis=1).tolist() == [MIXED.steps[s].k for s in tr.step]

    # Walk the segments edge by edge and find each edge among the rows.
    found = 0
    for seg, a in zip(tree.segments, advantages):
        for t in range(seg.num_steps):
            for p in range(P):
                for c in range(seg.log_probs.shape[2]):
                    parent = seg.parents[t, p, c // seg.k]
                    rows = np.flatnonzero(
                        (tr.step == seg.step_indices[t])
                        & (tr.prompt == p)
                        & np.all(tr.x == parent, axis=(1, 2, 3))
                    )
                    assert len(rows) == 1
                    slot = c % seg.k
                    row = rows[0]
                    assert tr.mask[row, slot]
                    np.testing.assert_array_equal(tr.actions[row, slot], seg.children[t, p, c])
                    assert tr.old_log_probs[row, slot] == seg.log_probs[t, p, c]
                    assert tr.advantages[row, slot] == np.asarray(a)[t, p, c]
                    assert tr.noise_scale[row] == seg.score_scale == seg.noise_scale
                    found += 1
    assert found == tr.num_edges


def test_gather_drops_rows_without_a_trained_edge():
    _, tree = rolled_out(MIXED)
    advantages = advantages_of("treegrpo", MIXED, tree, random_rewards(MIXED))
    masks = pruning.depth_pruning_mask(MIXED, tree, (2,))  # the BRANCH(3) step
    tr = gather_transitions(tree, advantages, masks)
    assert 1 not in tr.step
    assert tr.num_rows == (MIXED.nodes_in[0] + MIXED.nodes_in[3] + MIXED.nodes_in[4]) * P
    none = gather_transitions(tree, advantages, [np.zeros_like(m) for m in masks])
    assert none.num_rows == 0 and minibatches(none, jax.random.PRNGKey(0), 4) == []


def test_minibatches_shuffle_by_key_and_pad_with_masked_rows():
    _, tree = rolled_out(MIXED)
    advantages = advantages_of("treegrpo", MIXED, tree, random_rewards(MIXED))
    tr = gather_transitions(tree, advantages)
    batches = minibatches(tr, jax.random.PRNGKey(3), 7)
    assert len(batches) == -(-tr.num_rows // 7)
    assert all(b.num_rows == 7 for b in batches)
    assert sum(b.num_edges for b in batches) == tr.num_edges
    real = np.concatenate([b.x[b.mask.any(1)] for b in batches])
    assert sorted(map(bytes, real)) == sorted(map(bytes, tr.x))  # every row exactly once
    again = minibatches(tr, jax.random.PRNGKey(3), 7)
    other = minibatches(tr, jax.random.PRNGKey(4), 7)
    np.testing.assert_array_equal(batches[0].x, again[0].x)
    assert not np.array_equal(batches[0].x, other[0].x)


# ---------------------------------------------------------------------------------------------
# The loss.


@jax.jit
def rescored(rows, schedule):
    return score_actions(
        PARAMS,
        rows,
        PPOSettings(denoiser, guidance_scale=GUIDANCE),
        schedule=schedule,
        cond=COND,
        uncond=UNCOND,
    )


def assert_log_ratio_is_rounding(rows, schedule):
    """Per edge, |new - old log-prob| <= 1e-6 / std: a few float32 ulps of the states,
    amplified by 1 / std (the std the actions are scored with, noise_scale included)."""
    log_ratio = np.asarray(rescored(rows, schedule)) - rows.old_log_probs
    std = np.asarray(schedule.unit_std)[rows.step] * np.asarray(schedule.eta) * rows.noise_scale
    bound = np.broadcast_to((1e-6 / std)[:, None], log_ratio.shape)
    assert np.all(np.abs(log_ratio[rows.mask]) <= bound[rows.mask])


@pytest.mark.parametrize("split_log_prob", ["sampled", "unscaled"])
def test_ratio_is_one_before_any_update(split_log_prob):
    """The rollout and the loss are two compiled programs: XLA may contract multiply-adds
    differently in each, so agreement is to float32 rounding amplified by 1 / std at the
    late, low-noise steps, far inside the default clip range of 1e-4. With the released
    code's convention (split children scored with the unscaled std) the loss scores them
    the same way, through the transitions' noise_scale."""
    schedule, tree = rolled_out(MIXED, split_log_prob)
    advantages = advantages_of("branchgrpo", MIXED, tree, random_rewards(MIXED))
    rows = gather_transitions(tree, advantages)
    split_rows = rows.step == 4  # the BRANCH(2, noise_scale=1.5) step
    want_scale = 1.5 if split_log_prob == "sampled" else 1.0
    assert np.all(rows.noise_scale[split_rows] == want_scale)
    assert np.all(rows.noise_scale[~split_rows] == 1.0)
    assert_log_ratio_is_rounding(rows, schedule)
    batch = one_batch(rows)
    (loss, metrics), _ = loss_and_grad(PARAMS, batch, schedule, 1e-4)
    # Inside the default clip range, so clipping does nothing and the loss is -mean(A).
    assert 1 - 5e-5 < metrics["ratio_min"] <= metrics["ratio_max"] < 1 + 5e-5
    assert metrics["clip_fraction"] == 0.0
    (unclipped, _), _ = loss_and_grad(PARAMS, batch, schedule, 1e9)
    assert loss == unclipped
    a = np.clip(batch.advantages[batch.mask], -5, 5)
    # loss = -mean(A r) = -mean(A) - mean(A (r - 1)), the second term within rounding.
    deviation = max(1 - float(metrics["ratio_min"]), float(metrics["ratio_max"]) - 1)
    np.testing.assert_allclose(loss, -a.mean(), rtol=0, atol=np.abs(a).mean() * deviation + 1e-7)
    assert metrics["trained_edges"] == MIXED.trainable_edges * P


@pytest.mark.parametrize(
    "family, start",
    [
        (ts.treegrpo(5, window=2, k=2, window_start=ts.FAMILY), 2),
        (
            ts.branchgrpo_mix(
                6, (0, 3), k=2, split_noise_scale=1.5, window=2, window_start=ts.FAMILY
            ),
            1,
        ),
    ],
    ids=lambda f: getattr(f, "name", ""),
)
def test_sliding_window_tree_gathers_its_position_and_ratio_is_one(family, start):
    """A family's tree at one window start: the rows are the plain spec's trainable edges
    (BranchGRPO-Mix's steps outside the window are dropped), each at its own step index, and
    the loss rescoring them gives ratio 1."""
    schedule, tree = rolled_out(family, "sampled", start)
    plain = family.at(start)
    advantages = advantages_of(family.name, family, tree, random_rewards(family))
    rows = gather_transitions(tree, advantages)
    assert rows.num_edges == P * plain.trainable_edges
    assert rows.num_rows == P * plain.training_forward_rows()
    assert sorted(set(rows.step.tolist())) == list(plain.trainable_steps)
    for i in plain.trainable_steps:
        assert np.sum(rows.step == i) == P * plain.nodes_in[i]
    assert_log_ratio_is_rounding(rows, schedule)
    (_, metrics), _ = loss_and_grad(PARAMS, one_batch(rows), schedule, 1e-4)
    assert metrics["clip_fraction"] == 0.0


def edges_one_by_one(tree, advantages, masks):
    """Every trained edge as its own row: the parent repeated once per child."""
    rows = []
    for seg, a, m in zip(tree.segments, advantages, masks):
        for t in range(seg.num_steps):
            for p in range(P):
                for c in range(seg.log_probs.shape[2]):
                    if m[t, p, c]:
                        rows.append(
                            (
                                seg.parents[t, p, c // seg.k],
                                seg.children[t, p, c],
                                seg.step_indices[t],
                                p,
                                seg.score_scale,
                                seg.log_probs[t, p, c],
                                np.asarray(a)[t, p, c],
                            )
                        )
    return [np.stack(column) for column in zip(*rows)]


@jax.jit
def edgewise_loss(params, edges, schedule):
    """Reference: one denoiser row per edge (x2 for guidance), PPO-clip averaged over edges."""
    x, actions, steps, prompts, scales, old, advantages = edges
    t = schedule.timesteps[steps]
    uncond = jnp.broadcast_to(UNCOND, (x.shape[0], L, D))
    both = denoiser(
        params,
        jnp.concatenate([x, x]),
        jnp.concatenate([t, t]),
        jnp.concatenate([uncond, COND[prompts]]),
    )
    pred_u, pred_c = jnp.split(both, 2)
    per_edge = steps.reshape(-1, 1, 1, 1)
    log_probs = sampling.score_step(
        schedule,
        per_edge,
        x,
        pred_u + GUIDANCE * (pred_c - pred_u),
        actions,
        event_ndim=3,
        noise_scale=scales.astype(jnp.float32).reshape(-1, 1, 1, 1),
    ).log_prob
    ratio = jnp.exp(log_probs - old)
    a = jnp.clip(advantages, -5.0, 5.0)
    clipped = jnp.clip(ratio, 1 - CLIP, 1 + CLIP)
    return jnp.mean(jnp.maximum(-a * ratio, -a * clipped)), log_probs


CLIP = 0.01


@pytest.mark.parametrize("only_branch_2", [False, True], ids=["all_edges", "branch2_only"])
def test_amortized_scoring_equals_edge_by_edge(only_branch_2):
    schedule, tree = rolled_out(MIXED)
    advantages = advantages_of("treegrpo", MIXED, tree, random_rewards(MIXED, 1))
    masks = pruning.full_masks(tree)
    if only_branch_2:  # keep depth 5, the BRANCH(2) step's children
        masks = pruning.depth_pruning_mask(MIXED, tree, (1, 2, 4))
    batch = gather_transitions(tree, advantages, masks)  # no padding: count rows exactly
    params = {"a": PARAMS["a"] * 1.3, "b": PARAMS["b"] - 0.2}  # ratios away from 1, some clip

    def fresh_denoiser(*args):  # not yet traced at these shapes by another test's program
        return denoiser(*args)

    def amortized(p):
        return ppo_loss(
            p,
            batch,
            PPOSettings(fresh_denoiser, guidance_scale=GUIDANCE, clip_range=CLIP),
            LossInputs(schedule, COND, uncond=UNCOND),
        )

    ROWS_SEEN.clear()
    (loss, metrics), grad = jax.jit(jax.value_and_grad(amortized, has_aux=True))(params)
    amortized_rows = list(ROWS_SEEN)
    ROWS_SEEN.clear()
    edges = edges_one_by_one(tree, advantages, masks)
    (ref_loss, ref_log_probs), ref_grad = jax.value_and_grad(
        lambda p: edgewise_loss(p, edges, schedule), has_aux=True
    )(params)
    edgewise_rows = list(ROWS_SEEN)

    assert 0 < metrics["clip_fraction"] < 1
    # Rows and slots are in the same order as the edges were walked.
    new_log_probs = jax.jit(
        lambda p: score_actions(
            p,
            batch,
            PPOSettings(denoiser, guidance_scale=GUIDANCE),
            schedule=schedule,
            cond=COND,
            uncond=UNCOND,
        )
    )(params)
    # Equal up to float32 rounding, which 1 / std amplifies at the low-noise steps.
    np.testing.assert_allclose(
        np.asarray(new_log_probs)[batch.mask], ref_log_probs, rtol=1e-4, atol=2e-5
    )
    # The losses then agree to that rounding: |d loss| <= mean(|A| * |d ratio|), ratio ~ 1.
    log_prob_error = float(np.max(np.abs(np.asarray(new_log_probs)[batch.mask] - ref_log_probs)))
    a = np.abs(np.clip(batch.advantages[batch.mask], -5, 5))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=2 * a.mean() * log_prob_error)
    for key in params:
        np.testing.assert_allclose(grad[key], ref_grad[key], rtol=1e-4, atol=1e-7)

    # One forward per parent (x2 for guidance) against one per edge.
    num_edges = len(edges[0])
    assert amortized_rows == [2 * batch.num_rows] and edgewise_rows == [2 * num_edges]
    assert num_edges == batch.num_edges
    if only_branch_2:
        assert num_edges == 2 * batch.num_rows
    else:
        assert batch.num_rows == MIXED.training_forward_rows(amortized=True) * P
        assert num_edges == MIXED.training_forward_rows(amortized=False) * P


@pytest.mark.parametrize("method", method_advantages.METHOD_NAMES)
def test_constant_rewards_give_zero_gradient(method):
    schedule, tree = rolled_out(MIXED)
    rewards = jnp.full((P, MIXED.leaves), 0.3)
    batch = one_batch(gather_transitions(tree, advantages_of(method, MIXED, tree, rewards)))
    params = {"a": PARAMS["a"] * 1.3, "b": PARAMS["b"]}
    (loss, metrics), grad = loss_and_grad(params, batch, schedule, 1e-4)
    assert loss == 0.0 and metrics["trained_edges"] > 0
    assert all(np.all(np.asarray(g) == 0.0) for g in jax.tree_util.tree_leaves(grad))


def test_no_trained_edge_gives_zero_loss_and_no_nan():
    schedule, tree = rolled_out(MIXED)
    advantages = advantages_of("treegrpo", MIXED, tree, random_rewards(MIXED))
    batch = one_batch(gather_transitions(tree, advantages))
    batch = batch.replace(mask=np.zeros_like(batch.mask))
    (loss, metrics), grad = loss_and_grad(PARAMS, batch, schedule, 1e-4)
    assert loss == 0.0 and metrics["trained_edges"] == 0
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
    assert all(np.all(np.asarray(g) == 0.0) for g in jax.tree_util.tree_leaves(grad))


def test_kl_to_the_reference_model():
    schedule, tree = rolled_out(MIXED)
    advantages = advantages_of("treegrpo", MIXED, tree, random_rewards(MIXED))
    batch = one_batch(gather_transitions(tree, advantages))
    (_, same), _ = loss_and_grad(PARAMS, batch, schedule, 1e-4, PARAMS, kl=True)
    assert same["kl"] == 0.0

    ref_params = {"a": PARAMS["a"], "b": PARAMS["b"] + 0.1}
    (loss, metrics), _ = loss_and_grad(PARAMS, batch, schedule, 1e-4, ref_params, kl=True)
    # By hand: the predictions differ by d = 0.1 * (guided mean of the conditioning), and the
    # DDIM mean is linear in the prediction with slope -sqrt(a' (1 - a) / a) + sqrt(1 - a' - s^2).
    kls = []
    for row in np.flatnonzero(batch.mask.any(1)):
        i, p = batch.step[row], batch.prompt[row]
        d = 0.1 * (GUIDANCE * float(COND[p].mean()) + (1 - GUIDANCE) * float(UNCOND.mean()))
        a, a_prev = float(schedule.alpha_bar[i]), float(schedule.alpha_bar_prev[i])
        var = (1 - a_prev) / (1 - a) * (1 - a / a_prev)  # eta = 1
        slope = -np.sqrt(a_prev * (1 - a) / a) + np.sqrt(1 - a_prev - var)
        std = np.sqrt(var) * batch.noise_scale[row]  # the policy's std, noise_scale included
        kls.append((slope * d) ** 2 / (2 * std**2))
    np.testing.assert_allclose(metrics["kl"], np.mean(kls), rtol=1e-4)
    np.testing.assert_allclose(loss, metrics["policy_loss"] + 0.1 * metrics["kl"], rtol=1e-6)
    with pytest.raises(ValueError, match="ref_params"):
        ppo_loss(PARAMS, batch, PPOSettings(denoiser, kl_beta=0.1), LossInputs(schedule, COND))


def test_one_step_on_a_toy_gaussian_policy_follows_the_advantages():
    """The prediction is table[prompt] whatever the state, so each prompt's step Gaussian has
    its own free mean. Each parent has one good (A = +1) and one bad (A = -1) action."""
    schedule = sampling.make_flow_schedule(2)
    num_prompts, sample_shape = 3, (2, 1, 1)
    cond = jnp.eye(num_prompts)[:, None, :]  # one-hot prompts, [3, 1, 3]

    def policy(params, x, t, c):
        return jnp.broadcast_to((c[:, 0] @ params)[:, :, None, None], x.shape)

    # Antithetic actions mean +- std * z: the update must move the mean towards the good one.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_prompts, *sample_shape)).astype(np.float32)
    table = jnp.zeros((num_prompts, 2))
    mean, std = schedule.transition(0, x, policy(table, x, None, cond))
    z = rng.normal(size=(num_prompts, *sample_shape)).astype(np.float32)
    batch = Transitions(
        x=x,
        step=np.zeros(num_prompts, np.int32),
        prompt=np.arange(num_prompts, dtype=np.int32),
        noise_scale=np.ones(num_prompts, np.float32),
        actions=np.stack([mean + std * z, mean - std * z], axis=1),
        old_log_probs=np.zeros((num_prompts, 2), np.float32),
        advantages=np.tile(np.array([1.0, -1.0], np.float32), (num_prompts, 1)),
        mask=np.ones((num_prompts, 2), bool),
    )

    def log_probs(params):
        return score_actions(params, batch, PPOSettings(policy), schedule=schedule, cond=cond)

    batch = batch.replace(old_log_probs=np.asarray(log_probs(table)))

    def loss(params):
        return ppo_loss(params, batch, PPOSettings(policy), LossInputs(schedule, cond))[0]

    updated = table - 0.05 * jax.jit(jax.grad(loss))(table)
    log_probs = jax.jit(log_probs)
    change = np.asarray(log_probs(updated) - log_probs(table))
    assert np.all(change[:, 0] > 0) and np.all(change[:, 1] < 0)
