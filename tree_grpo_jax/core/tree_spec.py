"""Static tree specs: which denoising steps are ODE, SDE or BRANCH(k), and the presets.

A spec is a frozen, hashable value, so it is a static argument of the jitted rollout and
train step. Everything countable about a tree (leaves, denoiser calls, trainable edges,
training forward rows) follows from it without running anything.

Node layout: level 0 holds `num_trees` roots per prompt. A step maps a level of n nodes to
n * k nodes (k = 1 for ODE and SDE); the children of node j are j*k .. j*k + k - 1. So every
node at a level owns one contiguous block of leaves.

Sliding windows. A spec may carry a `Window`: `width` consecutive steps whose position is
*data*, the rollout's `window_start`, not part of the spec. Inside the window every ODE step
of the spec's `steps` (the base) becomes `window.step` (BRANCH(k) for TreeGRPO, SDE for
MixGRPO and BranchGRPO-Mix). Such a spec is a *family*: it is equal (and hashes equal) for
every window position, so one compiled rollout serves them all, and `spec.at(start)` is the
plain spec of one position. Counts that depend on the position (denoiser calls, trained
edges) are asked of `spec.at(start)` or `spec.counts(window_start=start)`; the number of
leaves and the branching structure do not move with the window.

Structure. The `blocks` of a spec are the rollout's program: ODE loops and stochastic
segments, each with bounds that are either fixed or move with the window start. A
segment's `level` is its place in the branching structure: the number of BRANCH steps at or
before its steps. Nodes between two BRANCH steps are all at one structural level; the
advantages and the width pruning need no more than that, so they do not depend on where the
window is either.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

import numpy as np

from tree_grpo_jax.errors import UserError


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


class SpecError(UserError):
    """A tree spec that cannot be built; the message is one sentence for the user."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive steps of one kind: the unit the rollout turns into one loop."""

    first_step: int
    num_steps: int
    step: Step

    @property
    def steps(self) -> range:
        return range(self.first_step, self.first_step + self.num_steps)


@dataclasses.dataclass(frozen=True)
class Window:
    """`width` consecutive steps at a position given at run time; inside it every ODE step of
    the spec's base becomes `step`."""

    width: int
    step: Step


@dataclasses.dataclass(frozen=True)
class Block:
    """One piece of the rollout program.

    kind: "ode" (a deterministic loop, nothing recorded), "stochastic" (SDE or BRANCH steps,
    recorded as one segment) or "mixed" (steps that are SDE inside the window and ODE outside,
    recorded as one segment whose `active` flags say which steps were stochastic).

    The block covers steps [begin, end), plus the window start where `moves` says so:
    `bounds(s)` gives them. Stochastic and mixed blocks have a fixed length; an ODE block
    whose two ends move differently has a length that depends on the window start.
    """

    kind: str
    step: Step  # ODE; the SDE or BRANCH step; SDE for a mixed block
    begin: int
    end: int
    begin_moves: bool = False
    end_moves: bool = False
    nodes_in: int = 1  # nodes per prompt entering each step of the block
    level: int = 0  # structural level of the nodes the block produces
    always_stochastic: tuple[bool, ...] = ()  # mixed: base SDE steps, stochastic anywhere

    @property
    def num_steps(self) -> int:
        if self.begin_moves != self.end_moves:
            raise SpecError("the length of this block depends on the window position.")
        return self.end - self.begin

    @property
    def nodes_out(self) -> int:
        return self.nodes_in * self.step.k

    def bounds(self, window_start=0):
        """(first step, end) for a window start (an int or a traced int32)."""
        begin = self.begin + window_start if self.begin_moves else self.begin
        end = self.end + window_start if self.end_moves else self.end
        return begin, end


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    steps: tuple[Step, ...]
    num_trees: int = 1  # roots per prompt
    shared_init_noise: bool = False  # all roots of a prompt start from the same noise
    name: str = "custom"
    window: Window | None = None  # a sliding window: the spec is a family over positions

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise SpecError("a tree spec needs at least one denoising step.")
        if self.num_trees < 1:
            raise SpecError(
                f"num_trees must be at least 1 (got {self.num_trees}), or the tree has no leaves."
            )
        for i, step in enumerate(self.steps):
            _check_step(f"step {i}", step)
        if self.window is not None:
            self._validate_window()

    def _validate_window(self) -> None:
        w = self.window
        if not isinstance(w, Window):
            raise SpecError(f"window is {w!r}, not a Window(width, step).")
        if not 1 <= w.width <= self.num_steps:
            raise SpecError(
                f"a sliding window of {w.width} steps does not fit in {self.num_steps} steps."
            )
        _check_step("the window step", w.step)
        if not w.step.stochastic:
            raise SpecError("the window step must be SDE or BRANCH(k); an ODE window is no window.")
        base_all_ode = all(s.kind is Kind.ODE for s in self.steps)
        if w.step.kind is Kind.BRANCH and not base_all_ode:
            raise SpecError(
                "a sliding window of BRANCH steps needs ODE steps everywhere else, so the tree's "
                "shape does not move with the window."
            )

    # -- windows ----------------------------------------------------------------------------
    @property
    def sliding(self) -> bool:
        """True for a family whose window position is given at run time."""
        return self.window is not None

    @property
    def window_positions(self) -> int:
        """How many window starts there are (1 for a spec without a window)."""
        return 1 if self.window is None else self.num_steps - self.window.width + 1

    def at(self, window_start: int) -> TreeSpec:
        """The plain spec of one window position (the spec itself if it has no window)."""
        if self.window is None:
            return self
        start = int(window_start)
        _check_window(self.name, self.num_steps, start, self.window.width)
        inside = range(start, start + self.window.width)
        steps = tuple(
            self.window.step if i in inside and s.kind is Kind.ODE else s
            for i, s in enumerate(self.steps)
        )
        return TreeSpec(steps, self.num_trees, self.shared_init_noise, self.name)

    def _plain(self, what: str) -> TreeSpec:
        if self.window is not None:
            raise SpecError(
                f"{what} of the sliding-window spec {self.name!r} depends on the window "
                "position; ask spec.at(window_start) or spec.counts(window_start=...)."
            )
        return self

    # -- structure --------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def nodes_in(self) -> tuple[int, ...]:
        """Nodes per prompt entering each step."""
        counts, n = [], self.num_trees
        for step in self._plain("nodes_in").steps:
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
        for i, step in enumerate(self._plain("runs").steps):
            last = runs[-1] if runs else None
            if last and last.step == step and step.kind is not Kind.BRANCH:
                runs[-1] = Run(last.first_step, last.num_steps + 1, step)
            else:
                runs.append(Run(i, 1, step))
        return tuple(runs)

    @property
    def trainable_steps(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self._plain("trainable_steps").steps) if s.stochastic)

    @property
    def branch_ks(self) -> tuple[int, ...]:
        """k of every BRANCH step, in step order; the same at every window position."""
        if self.window is not None and self.window.step.kind is Kind.BRANCH:
            return (self.window.step.k,) * self.window.width
        return tuple(s.k for s in self.steps if s.kind is Kind.BRANCH)

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Nodes per prompt at each structural level: the roots, then after each BRANCH step."""
        sizes = [self.num_trees]
        for k in self.branch_ks:
            sizes.append(sizes[-1] * k)
        return tuple(sizes)

    def level_of_depth(self, depth: int) -> int:
        """Structural level of the nodes at `depth` (steps from the root) of a plain spec."""
        steps = self._plain("the level of a depth").steps[:depth]
        return sum(1 for s in steps if s.kind is Kind.BRANCH)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The rollout program: ODE loops and stochastic segments, in step order."""
        if self.window is None:
            return self._plain_blocks()
        if all(s.kind is Kind.ODE for s in self.steps):
            return self._sliding_blocks()
        return self._mixed_blocks()

    @property
    def segment_blocks(self) -> tuple[Block, ...]:
        """The blocks that the rollout records as segments, in order."""
        return tuple(b for b in self.blocks if b.kind != "ode")

    def _plain_blocks(self) -> tuple[Block, ...]:
        blocks, level, n = [], 0, self.num_trees
        for run in self.runs:
            if run.step.kind is Kind.BRANCH:
                level += 1
            kind = "stochastic" if run.step.stochastic else "ode"
            end = run.first_step + run.num_steps
            blocks.append(Block(kind, run.step, run.first_step, end, nodes_in=n, level=level))
            n *= run.step.k
        return tuple(blocks)

    def _sliding_blocks(self) -> tuple[Block, ...]:
        """ODE before and after the window: loops whose bounds move with it (TreeGRPO,
        MixGRPO). The window's steps have fixed shapes at moving step indices."""
        w, n = self.window, self.num_trees
        blocks = [Block("ode", ODE, 0, 0, False, True, nodes_in=n, level=0)]
        if w.step.kind is Kind.BRANCH:
            for j in range(w.width):
                blocks.append(Block("stochastic", w.step, j, j + 1, True, True, n, j + 1))
                n *= w.step.k
            level = w.width
        else:
            blocks.append(Block("stochastic", w.step, 0, w.width, True, True, n, 0))
            level = 0
        blocks.append(Block("ode", ODE, w.width, self.num_steps, True, False, n, level))
        return tuple(blocks)

    def _mixed_blocks(self) -> tuple[Block, ...]:
        """Fixed BRANCH steps with a window of SDE steps moving between them (BranchGRPO-Mix):
        every run of non-BRANCH steps is one mixed segment; the window only decides which of
        its steps are stochastic, never the tree's shape."""
        blocks, level, n, i = [], 0, self.num_trees, 0
        while i < self.num_steps:
            step = self.steps[i]
            if step.kind is Kind.BRANCH:
                level += 1
                blocks.append(Block("stochastic", step, i, i + 1, nodes_in=n, level=level))
                n *= step.k
                i += 1
                continue
            j = i
            while j < self.num_steps and self.steps[j].kind is not Kind.BRANCH:
                j += 1
            base_sde = tuple(s.kind is Kind.SDE for s in self.steps[i:j])
            blocks.append(Block("mixed", self.window.step, i, j, False, False, n, level, base_sde))
            i = j
        return tuple(blocks)

    # -- derived counts, per prompt ---------------------------------------------------------
    @property
    def leaves(self) -> int:
        return self.num_trees * math.prod(self.branch_ks)

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

    @property
    def recorded_states(self) -> int:
        """States per prompt the rollout keeps (every segment's parents and children; the
        leaves not included), the same at every window position. For BranchGRPO-Mix's family
        that is every non-split step's, since each is recorded with its window flag."""
        return sum(b.num_steps * (b.nodes_in + b.nodes_out) for b in self.segment_blocks)

    def counts(self, guidance: bool = False, window_start: int | None = None) -> dict[str, int]:
        """The derived counts per prompt; a sliding-window spec needs its `window_start`
        (ignored by a spec without a window)."""
        if self.window is not None:
            if window_start is None:
                self._plain("the counts")
            return self.at(window_start).counts(guidance)
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

        text = f"{self.name}: {self.num_trees} tree(s) x [{' '.join(short(s) for s in self.steps)}]"
        if self.window is not None:
            text += f" + sliding window of {self.window.width} x {short(self.window.step)}"
        return text


def _check_step(where: str, step) -> None:
    if not isinstance(step, Step):
        raise SpecError(f"{where} is {step!r}, not a Step (use ODE, SDE or BRANCH(k)).")
    if step.kind is Kind.BRANCH and step.k < 2:
        raise SpecError(f"BRANCH at {where} has k={step.k}; a branch needs k >= 2 children.")
    if step.kind is not Kind.BRANCH and step.k != 1:
        raise SpecError(
            f"{where} is {step.kind.value} with k={step.k}; only BRANCH steps have k > 1."
        )
    if not step.noise_scale > 0:
        raise SpecError(f"{where} has noise_scale {step.noise_scale}; it must be positive.")


# ---------------------------------------------------------------------------------------------
# Presets. Windowed presets take `window_start`: an int gives the plain spec of that
# position; `FAMILY` gives the family (one spec for every position, the start given to the
# rollout), which is what a run with a sliding window should use.

FAMILY = "family"  # window_start of a windowed preset: every position, chosen at rollout


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


def _windowed(spec: TreeSpec, window_start: int | str) -> TreeSpec:
    if window_start == FAMILY:
        return spec
    if isinstance(window_start, bool) or not isinstance(window_start, (int, np.integer)):
        raise SpecError(
            f"{spec.name}: window_start must be a step index or tree_spec.FAMILY, "
            f"got {window_start!r}."
        )
    return spec.at(window_start)  # checks that the window fits


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


def mixgrpo(num_steps: int, group_size: int, window: int, window_start: int | str = 0) -> TreeSpec:
    """As grpo, but SDE only inside a window of steps and ODE elsewhere (MixGRPO).

    `window_start=FAMILY` gives the family whose window position is the rollout's argument.
    """
    _check_steps(num_steps)
    if group_size < 1:
        raise SpecError(f"mixgrpo: group_size must be at least 1, got {group_size}.")
    if window < 1:
        raise SpecError(f"mixgrpo: the window must hold at least one step, got width {window}.")
    family = TreeSpec(
        (ODE,) * num_steps, num_trees=group_size, name="mixgrpo", window=_window(window, SDE)
    )
    return _windowed(family, window_start)


def _window(width: int, step: Step) -> Window:
    return Window(int(width), step)


def treegrpo(
    num_steps: int,
    window: int = 4,
    k: int = 2,
    window_start: int | str = 0,
    num_trees: int = 1,
) -> TreeSpec:
    """TreeGRPO: a window of consecutive BRANCH(k) steps, ODE everywhere else.

    `window_start=FAMILY` gives the family whose window position is the rollout's argument.
    """
    _check_steps(num_steps)
    if window < 1:
        raise SpecError(f"treegrpo: the window must hold at least one step, got width {window}.")
    family = TreeSpec(
        (ODE,) * num_steps, num_trees=num_trees, name="treegrpo", window=_window(window, BRANCH(k))
    )
    return _windowed(family, window_start)


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
    window_start: int | str = 0,
    num_trees: int = 1,
) -> TreeSpec:
    """BranchGRPO-Mix: SDE only inside a window, ODE elsewhere; split steps always branch.

    `window_start=FAMILY` gives the family whose window position is the rollout's argument:
    the tree's shape is fixed by the split steps, and the rollout records every non-split
    step with a flag saying whether it was inside the window (stochastic, trained) or not.
    """
    _check_steps(num_steps)
    splits = _check_splits("branchgrpo_mix", num_steps, split_steps)
    if window < 1:
        raise SpecError(
            f"branchgrpo_mix: the window must hold at least one step, got width {window}."
        )
    base = tuple(BRANCH(k, split_noise_scale) if i in splits else ODE for i in range(num_steps))
    family = TreeSpec(base, num_trees=num_trees, name="branchgrpo_mix", window=_window(window, SDE))
    return _windowed(family, window_start)


def deterministic(num_steps: int, num_trees: int = 1) -> TreeSpec:
    """All ODE steps: the deterministic sampler used for evaluation."""
    _check_steps(num_steps)
    return TreeSpec((ODE,) * num_steps, num_trees=num_trees, name="deterministic")


def named(spec: TreeSpec, name: str) -> TreeSpec:
    """`spec` under another name (what `describe` prints): a preset's tree reused."""
    return dataclasses.replace(spec, name=name)
