"""Static tree specs: which denoising steps are ODE, SDE or BRANCH(k), and the presets.

A spec is a frozen, hashable value, so it is a static argument of the jitted rollout and
train step. Everything countable about a tree (leaves, denoiser calls, trainable edges,
training forward rows) follows from it without running anything.

Node layout: level 0 holds `num_trees` roots per prompt. A step maps a level of n nodes to
n * k nodes (k = 1 for ODE and SDE); the children of node j are j*k .. j*k + k - 1. So every
node at a level owns one contiguous block of leaves.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence


class Kind(str, enum.Enum):
    ODE = "ode"  # deterministic, not trained
    SDE = "sde"  # stochastic, one child: one trainable edge per node
    BRANCH = "branch"  # stochastic, k children from the same mean: k trainable edges


@dataclasses.dataclass(frozen=True)
class Step:
    kind: Kind
    k: int = 1
    noise_scale: float = 1.0  # multiplies the transition's std (BranchGRPO's split noise)

    @property
    def stochastic(self) -> bool:
        return self.kind is not Kind.ODE


ODE = Step(Kind.ODE)
SDE = Step(Kind.SDE)


def BRANCH(k: int, noise_scale: float = 1.0) -> Step:  # noqa: N802 - reads as the spec's notation
    return Step(Kind.BRANCH, k, noise_scale)


class SpecError(ValueError):
    """A tree spec that cannot be built; the message is one sentence for the user."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive steps of one kind: the unit the rollout turns into one `lax.scan`."""

    first_step: int
    num_steps: int
    step: Step

    @property
    def steps(self) -> range:
        return range(self.first_step, self.first_step + self.num_steps)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    steps: tuple[Step, ...]
    num_trees: int = 1  # roots per prompt
    shared_init_noise: bool = False  # all roots of a prompt start from the same noise
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise SpecError("a tree spec needs at least one denoising step.")
        if self.num_trees < 1:
            raise SpecError(
                f"num_trees must be at least 1 (got {self.num_trees}), or the tree has no leaves."
            )
        for i, step in enumerate(self.steps):
            if not isinstance(step, Step):
                raise SpecError(f"step {i} is {step!r}, not a Step (use ODE, SDE or BRANCH(k)).")
            if step.kind is Kind.BRANCH and step.k < 2:
                raise SpecError(
                    f"BRANCH at step {i} has k={step.k}; a branch needs k >= 2 children."
                )
            if step.kind is not Kind.BRANCH and step.k != 1:
                raise SpecError(
                    f"step {i} is {step.kind.value} with k={step.k}; only BRANCH steps have k > 1."
                )
            if not step.noise_scale > 0:
                raise SpecError(
                    f"step {i} has noise_scale {step.noise_scale}; it must be positive."
                )

    # -- structure --------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def nodes_in(self) -> tuple[int, ...]:
        """Nodes per prompt entering each step."""
        counts, n = [], self.num_trees
        for step in self.steps:
            counts.append(n)
            n *= step.k
        return tuple(counts)

    @property
    def nodes_out(self) -> tuple[int, ...]:
        """Nodes per prompt leaving each step (the children)."""
        return tuple(n * s.k for n, s in zip(self.nodes_in, self.steps))

    @property
    def runs(self) -> tuple[Run, ...]:
        """Maximal runs of identical consecutive steps; every BRANCH step is a run of its own."""
        runs: list[Run] = []
        for i, step in enumerate(self.steps):
            last = runs[-1] if runs else None
            if last and last.step == step and step.kind is not Kind.BRANCH:
                runs[-1] = Run(last.first_step, last.num_steps + 1, step)
            else:
                runs.append(Run(i, 1, step))
        return tuple(runs)

    @property
    def trainable_steps(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.steps) if s.stochastic)

    # -- derived counts, per prompt ---------------------------------------------------------
    @property
    def leaves(self) -> int:
        return self.nodes_out[-1]

    def rollout_denoiser_calls(self, guidance: bool = False) -> int:
        """Denoiser rows in one rollout: one per node per step (two with guidance)."""
        return sum(self.nodes_in) * (2 if guidance else 1)

    @property
    def trainable_edges(self) -> int:
        return sum(self.nodes_out[i] for i in self.trainable_steps)

    def training_forward_rows(self, amortized: bool = True, guidance: bool = False) -> int:
        """Denoiser rows to score every trainable edge once.

        Amortized, one forward per parent scores all its children (they share the mean);
        otherwise each edge is scored by its own forward.
        """
        per_step = self.nodes_in if amortized else self.nodes_out
        return sum(per_step[i] for i in self.trainable_steps) * (2 if guidance else 1)

    def counts(self, guidance: bool = False) -> dict[str, int]:
        return {
            "leaves": self.leaves,
            "rollout_denoiser_calls": self.rollout_denoiser_calls(guidance),
            "trainable_edges": self.trainable_edges,
            "training_forward_rows": self.training_forward_rows(True, guidance),
            "training_forward_rows_edgewise": self.training_forward_rows(False, guidance),
        }

    def describe(self) -> str:
        def short(s: Step) -> str:
            return f"B{s.k}" if s.kind is Kind.BRANCH else s.kind.value.upper()[0]

        return f"{self.name}: {self.num_trees} tree(s) x [{' '.join(short(s) for s in self.steps)}]"


# ---------------------------------------------------------------------------------------------
# Presets.


def _check_steps(num_steps: int) -> None:
    if num_steps < 1:
        raise SpecError(f"num_steps must be at least 1, got {num_steps}.")


def _check_window(name: str, num_steps: int, start: int, width: int) -> None:
    if width < 1:
        raise SpecError(f"{name}: the window must hold at least one step, got width {width}.")
    if start < 0 or start + width > num_steps:
        raise SpecError(
            f"{name}: a window of {width} steps starting at step {start} runs past the last "
            f"step ({num_steps - 1})."
        )


def sliding_window_start(iteration: int, num_steps: int, width: int, every: int) -> int:
    """Window position after `iteration` iterations: one step later every `every` iterations,
    wrapping so the window always ends on or before the last step."""
    if every < 1:
        raise SpecError(f"the window slides every {every} iterations; it must be at least 1.")
    positions = num_steps - width + 1
    if positions < 1:
        raise SpecError(f"a window of {width} steps does not fit in {num_steps} steps.")
    return (iteration // every) % positions


def grpo(num_steps: int, group_size: int, shared_init_noise: bool = False) -> TreeSpec:
    """Flat GRPO: G independent SDE chains per prompt.

    With `shared_init_noise` the chains start from one noise (DanceGRPO): that is one root
    with BRANCH(G) at step 0, which computes the shared first step once.
    """
    _check_steps(num_steps)
    if group_size < 1:
        raise SpecError(f"grpo: group_size must be at least 1, got {group_size}.")
    if shared_init_noise and group_size > 1:
        steps = (BRANCH(group_size),) + (SDE,) * (num_steps - 1)
        return TreeSpec(steps, num_trees=1, name="grpo")
    return TreeSpec((SDE,) * num_steps, num_trees=group_size, name="grpo")


def mixgrpo(num_steps: int, group_size: int, window: int, window_start: int = 0) -> TreeSpec:
    """As grpo, but SDE only inside a window of steps and ODE elsewhere (MixGRPO)."""
    _check_steps(num_steps)
    _check_window("mixgrpo", num_steps, window_start, window)
    steps = tuple(
        SDE if window_start <= i < window_start + window else ODE for i in range(num_steps)
    )
    return TreeSpec(steps, num_trees=group_size, name="mixgrpo")


def treegrpo(
    num_steps: int, window: int = 4, k: int = 2, window_start: int = 0, num_trees: int = 1
) -> TreeSpec:
    """TreeGRPO: a window of consecutive BRANCH(k) steps, ODE everywhere else."""
    _check_steps(num_steps)
    _check_window("treegrpo", num_steps, window_start, window)
    steps = tuple(
        BRANCH(k) if window_start <= i < window_start + window else ODE for i in range(num_steps)
    )
    return TreeSpec(steps, num_trees=num_trees, name="treegrpo")


def _check_splits(name: str, num_steps: int, split_steps: Sequence[int]) -> tuple[int, ...]:
    splits = tuple(sorted(set(int(s) for s in split_steps)))
    if not splits:
        raise SpecError(f"{name}: give at least one split step.")
    bad = [s for s in splits if not 0 <= s < num_steps]
    if bad:
        raise SpecError(
            f"{name}: split step(s) {bad} are outside the {num_steps} steps (0..{num_steps - 1})."
        )
    return splits


def branchgrpo(
    num_steps: int = 20,
    split_steps: Iterable[int] = (0, 3, 6, 9),
    k: int = 2,
    split_noise_scale: float = 1.0,
    num_trees: int = 1,
) -> TreeSpec:
    """BranchGRPO: BRANCH(k) at the split steps, SDE at every other step."""
    _check_steps(num_steps)
    splits = _check_splits("branchgrpo", num_steps, split_steps)
    steps = tuple(BRANCH(k, split_noise_scale) if i in splits else SDE for i in range(num_steps))
    return TreeSpec(steps, num_trees=num_trees, name="branchgrpo")


def branchgrpo_mix(
    num_steps: int = 20,
    split_steps: Iterable[int] = (0, 3, 6, 9),
    k: int = 2,
    split_noise_scale: float = 1.0,
    window: int = 4,
    window_start: int = 0,
    num_trees: int = 1,
) -> TreeSpec:
    """BranchGRPO-Mix: SDE only inside a window, ODE elsewhere; split steps always branch."""
    _check_steps(num_steps)
    splits = _check_splits("branchgrpo_mix", num_steps, split_steps)
    _check_window("branchgrpo_mix", num_steps, window_start, window)

    def kind(i: int) -> Step:
        if i in splits:
            return BRANCH(k, split_noise_scale)
        return SDE if window_start <= i < window_start + window else ODE

    return TreeSpec(
        tuple(kind(i) for i in range(num_steps)), num_trees=num_trees, name="branchgrpo_mix"
    )


def deterministic(num_steps: int, num_trees: int = 1) -> TreeSpec:
    """All ODE steps: the deterministic sampler used for evaluation."""
    _check_steps(num_steps)
    return TreeSpec((ODE,) * num_steps, num_trees=num_trees, name="deterministic")


PRESETS = {
    "grpo": grpo,
    "mixgrpo": mixgrpo,
    "treegrpo": treegrpo,
    "branchgrpo": branchgrpo,
    "branchgrpo_mix": branchgrpo_mix,
}
