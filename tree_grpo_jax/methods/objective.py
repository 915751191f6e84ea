"""What a training objective is to the rest of the package: one object per objective, held
by each method-table entry that trains through it (`Method.objective`).

An objective says which rows an iteration trains on (from the rollout, its rewards and a
key), the loss over a minibatch of them with its settings record, zero rows of its kind (the
precompiled and planned programs' arguments), whether the state keeps an old copy of the
policy and what becomes of it after an update, what its rows store (the size check), its own
config checks, and the per-prompt training counts the benchmarks derive. The trainer, the
build, the memory plan and the benchmarks call these and never ask which objective they hold:
a new objective is one module subclassing `Objective` and one table entry.

The objectives: `ppo.PPO` (PPO-clip on the rollout's own steps, core/loss.py), and the
forward-process ones on the leaves: `nft.NFT` (DiffusionNFT), `awm.AWM`, `dgpo.DGPO`,
`dpo.DPO` and `crd.CRD`, each a `forward.ForwardObjective`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import ml_collections
import numpy as np

from tree_grpo_jax.core import tree_spec
from tree_grpo_jax.core.loss import LossSettings
from tree_grpo_jax.core.rollout import Tree
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.core.settings import section as section_of


@dataclasses.dataclass(frozen=True)
class RowSource:
    """One iteration's rollout as an objective needs it to make its training rows."""

    spec: tree_spec.TreeSpec  # the spec rolled out (a windowed method's family)
    window_start: int  # the family's window position in this rollout
    tree: Tree  # this process's rows of the rollout
    rows: slice  # which rows of the global batch `tree` holds
    prompts: Sequence[str]  # the global batch's prompts
    rewards: np.ndarray  # [P, L] float32, the global batch's
    iteration: int = 0
    # this process's view of DDPO's stat tracker (`update(prompt_ids, rewards)` of its own
    # rows, updated with the global batch), or None
    tracker: Any = None
    schedule: Any = None  # the sampler's schedule (its sigmas: forward-process rows' times)
    # node rewards (`node_credit.NodeScores`: the node values and node pruning's survival),
    # or None when node rewards are off
    node_values: Any = None

    def local_node_values(self):
        """The node values of this process's rows, or None."""
        if self.node_values is None:
            return None
        return self.node_values.local(self.rows)

    @property
    def node_survival(self):
        """Node pruning's (alive levels, decisions) of this process's rows, or None."""
        return None if self.node_values is None else self.node_values.survival

    def in_global_batch(self, rows):
        """`rows` made from `tree` with their `prompt` indexing the global batch."""
        return rows.replace(prompt=rows.prompt + np.int32(self.rows.start))


class Objective(abc.ABC):
    """A training objective; subclasses are stateless and one instance serves every run."""

    name: ClassVar[str]  # how the docs and messages call it
    # the state keeps an old copy of the policy (`train_step.OldPolicyState`) that samples
    # the rollouts and that the loss receives as `old_params`
    keeps_old_policy: ClassVar[bool] = False
    # its rows are drawn at random: the update gives them a key of their own
    draws_rows: ClassVar[bool] = False
    # its rows are PPO transitions (each action's sampling log-prob stored): `train.replay`
    # may train them again in later iterations (core/replay.py)
    replays_rows: ClassVar[bool] = False
    # its loss's own figures, averaged over an iteration's minibatches into metrics.jsonl
    # (TensorBoard) and shown on the progress line
    reported_metrics: ClassVar[tuple[str, ...]] = ()

    # -- its own config section (`config.<section>`), or none ------------------------------------
    section: ClassVar[str | None] = None
    # the section's declarations (`tree_grpo_jax.core.settings.Setting`): its defaults,
    # types and ranges, checked whichever method a run uses
    settings: ClassVar[Mapping[str, Setting]] = {}

    def options(self) -> ml_collections.ConfigDict | None:
        """The section's fields at their defaults; the schema composes them into every run's
        config (`tree_grpo_jax.config.base_config`)."""
        return section_of(self.settings) if self.section is not None else None

    # -- config checks: one sentence for the user, or None -------------------------------------
    def check_section(self, config: ml_collections.ConfigDict) -> str | None:
        """The rules of the objective's own section that span its fields (each field's range
        is its declaration's), checked whichever method a run uses."""
        return None

    def check_run(self, config: ml_collections.ConfigDict, spec: tree_spec.TreeSpec) -> str | None:
        """The run's settings when its method trains through this objective (`spec`: its tree
        at iteration 0)."""
        return None

    def check_model(self, config: ml_collections.ConfigDict, model) -> str | None:
        """The run's model (`models.base.TextToImageModel`), once it is built."""
        return None

    # -- training --------------------------------------------------------------------------------
    def rollout_options(self, config: ml_collections.ConfigDict) -> dict:
        """What the rollout must record for this objective's rows besides the tree
        (`core.rollout.rollout`'s keywords, e.g. GRPO-Guard's `record_means`)."""
        return {}

    @abc.abstractmethod
    def rows(
        self,
        method: Any,
        config: ml_collections.ConfigDict,
        source: RowSource,
        key: jax.Array | None = None,
    ):
        """This process's training rows of one rollout; a row's `prompt` indexes the global
        batch. `method` is the table's `Method` (its credit and edge masks); `key` is given
        when `draws_rows`."""

    @abc.abstractmethod
    def loss(self, config: ml_collections.ConfigDict, denoise_fn) -> tuple[Callable, LossSettings]:
        """The loss function `(params, batch, settings, inputs)` and its settings record,
        built from `config` here alone: the train step closes over it, so its fields are
        constants of the compiled step. `inputs` is the `core.loss.LossInputs` the train step
        builds for every loss (schedule, cond, uncond, ref_params, old_params)."""

    @abc.abstractmethod
    def zero_rows(
        self,
        config: ml_collections.ConfigDict,
        rows: int,
        sample_shape,
        max_k: int,
        dtype,
        make=np.zeros,
    ):
        """`rows` rows of zeros of this objective's kind (`make=jax.ShapeDtypeStruct`: their
        shapes alone); `max_k` is the tree's widest branch."""

    def needs_initial_model(self, config: ml_collections.ConfigDict) -> bool:
        """Whether the loss compares with the initial weights (`ref_params`) besides any KL
        term: the run then keeps them even at `train.kl_beta=0`."""
        return False

    def loss_reads_empty_prompt(self, config: ml_collections.ConfigDict) -> bool:
        """Whether the loss needs the empty prompt's embedding (its `uncond`) in a run that
        samples without guidance too (a guided reference of the loss's own)."""
        return False

    def samples_with_old_policy(self, config: ml_collections.ConfigDict, iteration: int) -> bool:
        """Whether iteration `iteration` rolls out with the old policy (when one is kept)
        rather than the trained weights."""
        return self.keeps_old_policy

    def after_update(
        self, config: ml_collections.ConfigDict, old, params, iteration: int
    ) -> tuple[Any, dict]:
        """The old policy after iteration `iteration`'s update of `params`, and the metrics
        that tell its move (only called when `keeps_old_policy`)."""
        return old, {}

    # -- sizes and counts ------------------------------------------------------------------------
    def row_samples(self, config: ml_collections.ConfigDict, spec: tree_spec.TreeSpec) -> int:
        """Samples per prompt its rows store beside the rollout's recorded states."""
        return 0

    def replay_samples(self, config: ml_collections.ConfigDict, spec: tree_spec.TreeSpec) -> int:
        """Samples per prompt one iteration's rows hold in the replay buffer, at most
        (0 for an objective that does not replay)."""
        return 0

    @abc.abstractmethod
    def training_counts(
        self, config: ml_collections.ConfigDict, spec: tree_spec.TreeSpec, prunes: bool
    ) -> dict:
        """Per prompt, counted from `spec` and the settings alone: whether the rollout and the
        train step run with guidance, the rollout's denoiser rows, the trained edges, the
        training rows, their denoiser forwards (`train_forward_rows`) and of those the ones
        the gradient flows back through (`train_grad_rows`: a reference's or an old copy's
        are not), and the spec's own unpruned counts (`spec_trainable_edges`,
        `spec_train_rows`). `prunes`: the method prunes edges."""
