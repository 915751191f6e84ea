"""The method table: every training method as one entry.

A method is a tree (its spec builder), a credit assignment (its advantage function), which of
its trainable edges train (its edge-mask hook: BranchGRPO's pruning), its objective and a few
flags the trainer reads: whether its window slides, whether it can use DDPO's per-prompt stat
tracker. The objective is an `objective.Objective`: `ppo.PPO` (PPO-clip on the rollout's own
steps), `nft.NFT` (DiffusionNFT: the velocity trained on forward-noised copies of the
leaves; its advantages are one array per leaf, [P, L], and it samples from an old copy of the
policy), `awm.AWM` (Advantage Weighted Matching), `dgpo.DGPO` (Direct Group Preference
Optimization), `dpo.DPO` (online Diffusion-DPO) or `crd.CRD` (Centered Reward Distillation),
forward-process objectives on the leaves too. This is the one place
that maps a method name to behaviour: the config checks look a method up here, and the run
holds the `Method` it got and calls it.

Entries read their options from the config's `tree` and `advantage` sections; the library
functions they call take plain values and static specs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import pruning, tree_spec
from tree_grpo_jax.core.rollout import Tree
from tree_grpo_jax.methods import awm, crd, dgpo, dpo, forward, nft, node_credit
from tree_grpo_jax.methods.objective import Objective
from tree_grpo_jax.methods.ppo import PPO

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
    objective: Objective = PPO  # what it trains on and how (ppo.py, nft.py)
    # may credit edges from node rewards (`advantage.node_rewards`: the x0 estimates' gains)
    node_credit: bool = False
    # (advantage section) -> whether its leaf credit is TreeGRPO's, the credit node pruning
    # recomputes over the kept leaves; None: node pruning is not offered
    treegrpo_leaf_credit: Callable[[ml_collections.ConfigDict], bool] | None = None

    @property
    def pruning(self) -> bool:
        """True when the method may leave trainable edges out of the loss."""
        return self.edge_masks is not None

    def window_start_at(self, config: ml_collections.ConfigDict, iteration: int) -> int:
        """Where the window starts at `iteration` (it slides one step every
        `tree.window_slide_every` iterations, wrapping so it always ends by the last step)."""
        t = config.tree
        if not t.window_slide_every or not self.windowed:
            return t.window_start
        return t.window_start + tree_spec.sliding_window_start(
            iteration, config.sampling.num_steps - t.window_start, t.window, t.window_slide_every
        )

    def run_spec(self, config: ml_collections.ConfigDict) -> tree_spec.TreeSpec:
        """The run's tree: the same for every iteration (a windowed method's is a family; its
        position at an iteration is `window_start_at`). Raises tree_spec.SpecError for a tree
        that cannot be built."""
        return self.spec(config.tree, config.sampling.num_steps)

    def spec_at(self, config: ml_collections.ConfigDict, iteration: int = 0) -> tree_spec.TreeSpec:
        """The plain tree of `iteration` (the family at its window position): for counting."""
        return self.run_spec(config).at(self.window_start_at(config, iteration))

    def clipped_advantages(
        self,
        config: ml_collections.ConfigDict,
        spec: tree_spec.TreeSpec,
        tree: Tree,
        rewards: jax.Array,
        *,
        prompt_ids: Sequence[Hashable] = (),
        tracker: adv.PerPromptStatTracker | None = None,
        node_values: adv.NodeValues | None = None,
        alive: Sequence[np.ndarray] | None = None,
    ) -> adv.Advantages:
        """The method's advantages, clipped once to +-advantage.clip: one array per segment
        (per-edge credit), or one [P, L] array of the leaves (DiffusionNFT's).

        With `node_values` (node rewards on) an edge's credit is `advantage.node_mix` times
        its normalized gain plus the rest times the leaf credit; with `alive` (node pruning)
        the leaf credit is TreeGRPO's over the kept leaves and dead edges get 0."""
        o = config.advantage
        if alive is not None:
            leaf = adv.surviving_leaf_advantages(spec, tree, rewards, alive[-1], ddof=o.std_ddof)
        else:
            leaf = self.advantages(spec, tree, rewards, Credit(o, prompt_ids, tracker))
        raw = leaf
        if node_values is not None and o.node_mix > 0:
            gains = adv.node_gain_advantages(
                tree, rewards, node_values, ddof=o.std_ddof, alive=alive
            )
            raw = adv.mix_credit(gains, leaf, float(o.node_mix))
        return _clipped(tuple(raw), float(o.clip))

    def edge_masks_at(
        self,
        config: ml_collections.ConfigDict,
        spec: tree_spec.TreeSpec,
        tree: Tree,
        advantages: adv.Advantages,
        iteration: int,
        window_start: int,
    ) -> pruning.Masks | None:
        """The masks of the edges that train at `iteration` (None: all of them)."""
        if self.edge_masks is None:
            return None
        return self.edge_masks(
            config.advantage,
            spec,
            tree,
            advantages,
            iteration=iteration,
            total_iterations=config.train.iterations,
            window_start=window_start,
        )

    def training_counts(self, config: ml_collections.ConfigDict, iteration: int = 0) -> dict:
        """Per-prompt counts of one iteration, from the tree and the settings alone
        (`Objective.training_counts`, after the tree's description and leaves)."""
        spec = self.spec_at(config, iteration)
        counts = self.objective.training_counts(config, spec, self.pruning)
        replay = config.train.replay
        if replay:  # the rows of the last `replay` iterations are trained again
            past = [
                self.objective.training_counts(config, self.spec_at(config, i), self.pruning)
                for i in range(max(iteration - replay, 0), iteration)
            ]
            counts["replayed_rows"] = sum(p["train_rows"] for p in past)
            for name in ("trained_edges", "train_rows", "train_forward_rows", "train_grad_rows"):
                counts[name] += sum(p[name] for p in past)
        nodes = node_credit.counts(config, spec)
        return {"spec": spec.describe(), "leaves": spec.leaves, **counts, **nodes}


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
        edge_normalization=o.edge_normalization,
    )


def _branchgrpo_credit(spec, tree, rewards, credit: Credit):
    o = credit.options
    return adv.branchgrpo_advantages(
        spec,
        tree,
        rewards,
        fusion=o.fusion,
        alpha=o.fusion_alpha,
        normalization=o.branch_normalization,
    )


def _treegrpo_leaf_credit(options) -> bool:
    return options.edge_normalization == "none"


def _branch_leaf_credit(options) -> bool:
    return options.branch_normalization == "leaf" and options.fusion == "mean"


def _nft_credit(spec, tree, rewards, credit: Credit):
    return (jnp.asarray(forward.advantages(np.asarray(rewards)), jnp.float32),)


def _on_ode_samples(name: str, objective: Objective, spec_name: str) -> Method:
    """A forward-process method on G deterministic (ODE) samples per prompt."""
    return Method(
        name,
        spec=lambda t, n: tree_spec.named(tree_spec.deterministic(n, t.group_size), spec_name),
        advantages=_nft_credit,
        objective=objective,
    )


def _on_tree_leaves(name: str, objective: Objective, spec_name: str) -> Method:
    """A forward-process method on the leaves of TreeGRPO's tree (its window slides)."""
    return Method(
        name,
        spec=lambda t, n: tree_spec.named(
            tree_spec.treegrpo(n, t.window, t.k, tree_spec.FAMILY, t.num_trees), spec_name
        ),
        advantages=_nft_credit,
        windowed=True,
        objective=objective,
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
            node_credit=True,
        ),
        Method(
            "mixgrpo",
            spec=lambda t, n: tree_spec.mixgrpo(n, t.group_size, t.window, tree_spec.FAMILY),
            advantages=_grpo_credit,
            windowed=True,
            stat_tracker=True,
            node_credit=True,
        ),
        Method(
            "treegrpo",
            spec=lambda t, n: tree_spec.treegrpo(n, t.window, t.k, tree_spec.FAMILY, t.num_trees),
            advantages=_treegrpo_credit,
            windowed=True,
            node_credit=True,
            treegrpo_leaf_credit=_treegrpo_leaf_credit,
        ),
        Method(
            "branchgrpo",
            spec=lambda t, n: tree_spec.branchgrpo(
                n, t.split_steps, t.k, t.split_noise_scale, t.num_trees
            ),
            advantages=_branchgrpo_credit,
            edge_masks=pruning.branchgrpo_masks,
            node_credit=True,
            treegrpo_leaf_credit=_branch_leaf_credit,
        ),
        Method(
            "branchgrpo_mix",
            spec=lambda t, n: tree_spec.branchgrpo_mix(
                n, t.split_steps, t.k, t.split_noise_scale, t.window, tree_spec.FAMILY, t.num_trees
            ),
            advantages=_branchgrpo_credit,
            windowed=True,
            edge_masks=pruning.branchgrpo_masks,
            node_credit=True,
            treegrpo_leaf_credit=_branch_leaf_credit,
        ),
        # DiffusionNFT on G deterministic (ODE) samples per prompt, the released sampler's;
        # and on the leaves of TreeGRPO's tree: shared prefixes make samples cheaper
        _on_ode_samples("diffusion_nft", nft.NFT, "nft"),
        _on_tree_leaves("diffusion_nft_tree", nft.NFT, "nft_tree"),
        # AWM on G ODE samples per prompt, as its release samples, and on a tree's leaves
        _on_ode_samples("awm", awm.AWM, "awm"),
        _on_tree_leaves("awm_tree", awm.AWM, "awm_tree"),
        # DGPO on G ODE samples per prompt, as its release samples; the batch-std credit (its
        # rows take each prompt's own std with dgpo.global_std=False: dgpo.advantages)
        _on_ode_samples("dgpo", dgpo.DGPO, "dgpo"),
        # online Diffusion-DPO (each group's best against its worst) and CRD (rewards centred
        # within each group), on G ODE samples per prompt as their release samples
        _on_ode_samples("dpo", dpo.DPO, "dpo"),
        _on_ode_samples("crd", crd.CRD, "crd"),
    )
}


def register(method: Method, *, overwrite: bool = False) -> Method:
    """Adds a method to the table; a name already taken needs `overwrite=True`."""
    if method.name in METHODS and not overwrite:
        raise ValueError(
            f"a method named {method.name!r} is already registered; pass overwrite=True."
        )
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Removes a method (tests that register toys clean up with this)."""
    METHODS.pop(name, None)


class UnknownMethodError(ValueError):
    """A method name that is not in the table; the message is one sentence for the user."""


def get(name: str) -> Method:
    if name not in METHODS:
        raise UnknownMethodError(
            f"unknown tree.method {name!r}; choose one of {', '.join(METHODS)}."
        )
    return METHODS[name]


def objectives() -> tuple[Objective, ...]:
    """Every objective of the table, once each, in table order."""
    return tuple(dict.fromkeys(m.objective for m in METHODS.values()))


def other_sections(method: str) -> dict[str, Objective]:
    """The config sections of the objectives `method` does not train through, each with its
    objective (whose `options()` are the section's defaults)."""
    used = get(method).objective
    return {
        o.section: o for o in objectives() if o.section is not None and o.section != used.section
    }


def methods_of(objective: Objective) -> tuple[str, ...]:
    """The methods that train through `objective`, in table order."""
    return tuple(name for name, m in METHODS.items() if m.objective is objective)


@functools.partial(jax.jit, static_argnums=(1,))  # one program, not one per segment
def _clipped(advantages: tuple, bound: float) -> tuple:
    return tuple(jnp.clip(a, -bound, bound) for a in advantages)
