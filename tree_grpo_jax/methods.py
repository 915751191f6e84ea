"""The method table: every training method as one entry.

A method is a tree (its spec builder), a credit assignment (its advantage function), which of
its trainable edges train (its edge-mask hook: BranchGRPO's pruning) and a few flags the
trainer reads: whether its window slides, whether it can use DDPO's per-prompt stat tracker.
This is the one place that maps a method name to behaviour; the trainer, the benchmarks and
the config checks look methods up here.

Entries read their options from the config's `tree` and `advantage` sections; the library
functions they call take plain values and static specs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from tree_grpo_jax import advantages as adv
from tree_grpo_jax import pruning, tree_spec
from tree_grpo_jax.rollout import Tree

# (tree section, number of steps) -> the run's tree. A windowed method's tree is a family
# whose window position is the rollout's argument: one compiled rollout serves them all.
SpecBuilder = Callable[[ml_collections.ConfigDict, int], tree_spec.TreeSpec]


@dataclasses.dataclass(frozen=True)
class Credit:
    """What an advantage function may use besides the tree and the rewards."""

    options: ml_collections.ConfigDict  # the config's `advantage` section
    prompt_ids: Sequence[Hashable] = ()  # one per prompt row (the stat tracker's keys)
    tracker: adv.PerPromptStatTracker | None = None


# (spec, tree, rewards [P, L], credit) -> one advantage array per segment, unclipped.
AdvantageFn = Callable[[tree_spec.TreeSpec, Tree, jax.Array, Credit], adv.Advantages]
# (advantage section, spec, tree, advantages, *, iteration, total_iterations, window_start)
# -> one boolean mask per segment (True: trained), or None to train every trainable edge.
EdgeMaskFn = Callable[..., pruning.Masks | None]


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    spec: SpecBuilder
    advantages: AdvantageFn
    windowed: bool = False  # has a window of trained steps that may slide
    stat_tracker: bool = False  # may normalise with DDPO's per-prompt stat tracker
    edge_masks: EdgeMaskFn | None = None  # which trainable edges train; None: all of them

    @property
    def pruning(self) -> bool:
        """True when the method may leave trainable edges out of the loss."""
        return self.edge_masks is not None


def _grpo_credit(spec, tree, rewards, credit: Credit):
    return adv.grpo_advantages(
        spec,
        tree,
        rewards,
        tracker=credit.tracker,
        prompt_ids=list(credit.prompt_ids) if credit.tracker else None,
        ddof=credit.options.std_ddof,
    )


def _treegrpo_credit(spec, tree, rewards, credit: Credit):
    o = credit.options
    return adv.treegrpo_advantages(
        spec,
        tree,
        rewards,
        ddof=o.std_ddof,
        edge_normalization=o.get("edge_normalization", "none"),
    )


def _branchgrpo_credit(spec, tree, rewards, credit: Credit):
    o = credit.options
    return adv.branchgrpo_advantages(
        spec,
        tree,
        rewards,
        fusion=o.fusion,
        alpha=o.fusion_alpha,
        normalization=o.get("branch_normalization", "depthwise"),
    )


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "grpo",
            spec=lambda t, n: tree_spec.grpo(
                n, t.group_size, shared_init_noise=t.shared_init_noise
            ),
            advantages=_grpo_credit,
            stat_tracker=True,
        ),
        Method(
            "mixgrpo",
            spec=lambda t, n: tree_spec.mixgrpo(n, t.group_size, t.window, tree_spec.FAMILY),
            advantages=_grpo_credit,
            windowed=True,
            stat_tracker=True,
        ),
        Method(
            "treegrpo",
            spec=lambda t, n: tree_spec.treegrpo(n, t.window, t.k, tree_spec.FAMILY, t.num_trees),
            advantages=_treegrpo_credit,
            windowed=True,
        ),
        Method(
            "branchgrpo",
            spec=lambda t, n: tree_spec.branchgrpo(
                n, t.split_steps, t.k, t.split_noise_scale, t.num_trees
            ),
            advantages=_branchgrpo_credit,
            edge_masks=pruning.branchgrpo_masks,
        ),
        Method(
            "branchgrpo_mix",
            spec=lambda t, n: tree_spec.branchgrpo_mix(
                n, t.split_steps, t.k, t.split_noise_scale, t.window, tree_spec.FAMILY, t.num_trees
            ),
            advantages=_branchgrpo_credit,
            windowed=True,
            edge_masks=pruning.branchgrpo_masks,
        ),
    )
}


class UnknownMethodError(ValueError):
    """A method name that is not in the table; the message is one sentence for the user."""


def get(name: str) -> Method:
    if name not in METHODS:
        raise UnknownMethodError(
            f"unknown tree.method {name!r}; choose one of {', '.join(METHODS)}."
        )
    return METHODS[name]


def window_start(config: ml_collections.ConfigDict, iteration: int) -> int:
    """Where the window of a windowed method starts at `iteration` (it slides one step every
    `tree.window_slide_every` iterations, wrapping so it always ends by the last step)."""
    t = config.tree
    if not t.window_slide_every or not get(t.method).windowed:
        return t.window_start
    return t.window_start + tree_spec.sliding_window_start(
        iteration, config.sampling.num_steps - t.window_start, t.window, t.window_slide_every
    )


def build_spec(config: ml_collections.ConfigDict) -> tree_spec.TreeSpec:
    """The run's tree: the same for every iteration (a windowed method's is a family; its
    position at an iteration is `window_start`). Raises tree_spec.SpecError for a tree that
    cannot be built."""
    return get(config.tree.method).spec(config.tree, config.sampling.num_steps)


def spec_at(config: ml_collections.ConfigDict, iteration: int = 0) -> tree_spec.TreeSpec:
    """The plain tree of `iteration` (the family at its window position): for counting."""
    return build_spec(config).at(window_start(config, iteration))


def compute_advantages(
    config: ml_collections.ConfigDict,
    spec: tree_spec.TreeSpec,
    tree: Tree,
    rewards: jax.Array,
    *,
    prompt_ids: Sequence[Hashable] = (),
    tracker: adv.PerPromptStatTracker | None = None,
) -> adv.Advantages:
    """The configured method's advantages, clipped once to +-advantage.clip."""
    credit = Credit(config.advantage, prompt_ids, tracker)
    raw = get(config.tree.method).advantages(spec, tree, rewards, credit)
    clip = config.advantage.clip
    return tuple(jnp.clip(a, -clip, clip) for a in raw)


def edge_masks(
    config: ml_collections.ConfigDict,
    spec: tree_spec.TreeSpec,
    tree: Tree,
    advantages: adv.Advantages,
    iteration: int,
    window_start: int,
) -> pruning.Masks | None:
    """The configured method's masks of the edges that train at `iteration` (None: all)."""
    hook = get(config.tree.method).edge_masks
    if hook is None:
        return None
    return hook(
        config.advantage,
        spec,
        tree,
        advantages,
        iteration=iteration,
        total_iterations=config.train.iterations,
        window_start=window_start,
    )
