"""The tree's sample efficiency: a sweep of tree settings against flat GRPO and MixGRPO.

    python -m benchmarks.tree_study                    # side by side, the same images each
    python -m benchmarks.tree_study --group screen     # every candidate, a wall-clock budget
    python -m benchmarks.tree_study --group branch_shape   # BranchGRPO-Mix's credit, tree shape
    python -m benchmarks.tree_study --group per_leaf   # edges weighted by their leaves
    python -m benchmarks.tree_study --group epochs     # two updates per iteration, clip ranges
    python -m benchmarks.tree_study --group epochs_both    # two updates for flat and tree alike
    python -m benchmarks.tree_study --group lr         # a larger step against a second update
    python -m benchmarks.tree_study --group nft        # DiffusionNFT beside the trees (flow twin)
    python -m benchmarks.tree_study --group nft_cost   # the same seconds each, fewer sigmas too
    python -m benchmarks.tree_study --group nft_screen # DiffusionNFT's learning rate, beta, tree
    python -m benchmarks.tree_study --group methods    # AWM, DGPO, GRPO-Guard beside them all
    python -m benchmarks.tree_study --group credit --resume    # node rewards, pruning, replay
    python -m benchmarks.tree_study --group per_image --resume \
        --reuse benchmarks/results/tree_study_credit.json  # trees per image and reward call
    python -m benchmarks.tree_study --depth-spread     # how diluted treegrpo's edge credit is
    python -m benchmarks.tree_study --smoke --out /tmp/study   # a stand-in model (~16 s CPU)
    python -m benchmarks.tree_study --replot benchmarks/results/tree_study_final.json
    python -m benchmarks.tree_study --out benchmarks/results   # updates the committed results

Every setting (a preset of `benchmarks.common.PRESETS` or `FLOW_PRESETS`, 16 leaves per
prompt, plus config overrides) trains from the same weights (the shipped DDIM model; in the
groups of `FLOW_GROUPS` its rectified-flow twin, on the JPEG rewards) with the harness of
`benchmarks.training`: the
clock is the sum of the iterations' own `time_iteration`, evaluation on fixed prompts and
noises runs off the clock, and every compile happens before the clock starts. The "final"
runs give every setting the same number of iterations (so the same images); the screen
gives each the same training seconds. Runs are interleaved: reward by reward, seed by seed,
every setting in turn, so a slow spell of a shared machine hits them all alike. Only the
trainer's seam is used: `train.setup`, `Trainer.iteration`, `Evaluator.evaluate`, `reseed`.

Targets per reward: grpo's and mixgrpo's median final eval reward, and 50% / 80% of the way
from the start to the best setting's median final reward. For each the script reports the
images and training seconds a setting's median curve (over seeds) needs to reach it, the
same seed by seed, and the ratios of mixgrpo's (and grpo's) figures to the setting's (above
1: sooner). Results: `<out>/tree_study_<tag>.json` (written after every run), `.md` (the
tables), and per reward a PNG of eval reward against wall-clock and against images for every
setting with the Pareto front (the best reward any setting has reached at that cost), and a
PNG of the settings' cost to the 50% target. `<out>` is `runs/benchmarks/tree_study`
(git-ignored, under the working directory; with --smoke a temporary folder) unless --out is
given; the committed results in `benchmarks/results/` change only with
`--out benchmarks/results` (`--replot` writes beside the JSON it reads).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import costs, training
from benchmarks.common import _plain, default_out, fmt_stats, machine, pyplot, smoke_rng, stats
from benchmarks.presets import Settings, load_model, make_config, minibatches_per_iteration
from tree_grpo_jax import methods
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.run import compile_cache
from tree_grpo_jax.run import loop as train

# ---------------------------------------------------------------------------------------------
# The settings: a preset of `benchmarks.common.PRESETS` (16 leaves per prompt, 10 steps,
# window at step 0) plus config overrides. `updates` is how the iteration's gradient is
# applied: "iteration" (accumulated over its minibatches: one optimizer update per inner
# epoch, the harness's default) or "minibatch" (one update per minibatch).


@dataclasses.dataclass(frozen=True)
class Setting:
    preset: str
    overrides: tuple = ()  # ((section.field, value), ...)
    updates: str = "iteration"
    label: str = ""


PER_DEPTH = (("advantage.edge_normalization", "per_depth"),)
PER_LEAF = (("advantage.edge_normalization", "per_leaf"),)
TREES2 = (("tree.num_trees", 2), ("tree.window", 3))  # 2 trees x 8 leaves
TREES4 = (("tree.num_trees", 4), ("tree.window", 2))  # 4 trees x 4 leaves
BMIX_TREES2 = (("tree.num_trees", 2), ("tree.split_steps", (0, 2, 4)))  # 2 trees x 8 leaves
LR2 = (("train.learning_rate", 2e-4),)
LR3 = (("train.learning_rate", 3e-4),)
NODES = (("advantage.node_rewards", "branch_points"), ("advantage.node_mix", 0.5))


def nodes_at(mix: float, where: str = "branch_points") -> tuple:
    return (("advantage.node_rewards", where), ("advantage.node_mix", mix))


REPLAY = (("train.replay", 1),)
ONE_UPDATE = (("train.updates_per_iteration", 1),)  # however many minibatches the rows fill
EPOCHS2 = (("train.inner_epochs", 2), ("train.clip_range", 1e-2))  # the second update acts

NFT_BETA01 = (("diffusion_nft.beta", 0.1),)
NFT_2_SIGMAS = (("diffusion_nft.timestep_fraction", 0.2),)  # 2 of the 10 sigmas per sample

SETTINGS: dict[str, Setting] = {
    "grpo": Setting("grpo", label="grpo"),
    "diffusion_nft": Setting("diffusion_nft", label="diffusion_nft (16 ODE samples)"),
    "diffusion_nft_lr3e-4": Setting("diffusion_nft", LR3, label="diffusion_nft, lr 3e-4"),
    "diffusion_nft_beta0.1": Setting("diffusion_nft", NFT_BETA01, label="diffusion_nft, beta 0.1"),
    "diffusion_nft_tree": Setting("diffusion_nft_tree", label="diffusion_nft on treegrpo's tree"),
    "diffusion_nft_tree_lr3e-4": Setting(
        "diffusion_nft_tree", LR3, label="diffusion_nft on the tree, lr 3e-4"
    ),
    "diffusion_nft_lr3e-4_2sigmas": Setting(
        "diffusion_nft", LR3 + NFT_2_SIGMAS, label="diffusion_nft, lr 3e-4, 2 sigmas per sample"
    ),
    "diffusion_nft_tree_lr3e-4_2sigmas": Setting(
        "diffusion_nft_tree",
        LR3 + NFT_2_SIGMAS,
        label="diffusion_nft on the tree, lr 3e-4, 2 sigmas per sample",
    ),
    "mixgrpo": Setting("mixgrpo", label="mixgrpo (w4)"),
    "mixgrpo_lr2e-4": Setting("mixgrpo", LR2, label="mixgrpo, lr 2e-4"),
    "mixgrpo_lr3e-4": Setting("mixgrpo", LR3, label="mixgrpo, lr 3e-4"),
    "mixgrpo_epochs2_clip1e-2": Setting(
        "mixgrpo", EPOCHS2, label="mixgrpo, 2 inner epochs, clip 1e-2"
    ),
    "treegrpo": Setting("treegrpo", label="treegrpo (1 tree, w4 k2)"),
    "treegrpo_depthnorm": Setting("treegrpo", PER_DEPTH, label="treegrpo, per-depth norm"),
    "treegrpo_perleaf": Setting("treegrpo", PER_LEAF, label="treegrpo, per-leaf weights"),
    "treegrpo_trees2": Setting("treegrpo", TREES2, label="treegrpo, 2 trees w3"),
    "treegrpo_trees4": Setting("treegrpo", TREES4, label="treegrpo, 4 trees w2"),
    "treegrpo_trees2_depthnorm": Setting(
        "treegrpo", TREES2 + PER_DEPTH, label="treegrpo, 2 trees w3, per-depth"
    ),
    "treegrpo_trees4_depthnorm": Setting(
        "treegrpo", TREES4 + PER_DEPTH, label="treegrpo, 4 trees w2, per-depth"
    ),
    "treegrpo_k4": Setting(
        "treegrpo", (("tree.k", 4), ("tree.window", 2)), label="treegrpo, k4 w2"
    ),
    "treegrpo_lr2e-4": Setting("treegrpo", LR2, label="treegrpo, lr 2e-4"),
    "treegrpo_lr3e-4": Setting("treegrpo", LR3, label="treegrpo, lr 3e-4"),
    "treegrpo_epochs2": Setting(
        "treegrpo", (("train.inner_epochs", 2),), label="treegrpo, 2 inner epochs"
    ),
    "treegrpo_epochs2_clip1e-3": Setting(
        "treegrpo",
        (("train.inner_epochs", 2), ("train.clip_range", 1e-3)),
        label="treegrpo, 2 inner epochs, clip 1e-3",
    ),
    "treegrpo_epochs2_clip1e-2": Setting(
        "treegrpo", EPOCHS2, label="treegrpo, 2 inner epochs, clip 1e-2"
    ),
    "treegrpo_per_minibatch": Setting(
        "treegrpo",
        (("train.rows_per_minibatch", 16),),
        updates="minibatch",
        label="treegrpo, update per minibatch of 16",
    ),
    "treegrpo_slide": Setting(
        "treegrpo", (("tree.window_slide_every", 8),), label="treegrpo, window slides every 8"
    ),
    "treegrpo_start1": Setting(
        "treegrpo", (("tree.window_start", 1),), label="treegrpo, window at 1"
    ),
    "branchgrpo_mix": Setting("branchgrpo_mix", label="branchgrpo_mix (1 tree)"),
    "branchgrpo_mix_leafnorm": Setting(
        "branchgrpo_mix",
        (("advantage.branch_normalization", "leaf"),),
        label="branchgrpo_mix, leaf norm (no depth-wise)",
    ),
    "branchgrpo_mix_splits0123": Setting(
        "branchgrpo_mix",
        (("tree.split_steps", (0, 1, 2, 3)),),
        label="branchgrpo_mix, splits 0-3 (treegrpo's tree)",
    ),
    "branchgrpo_mix_splits0123_epochs2_clip1e-2": Setting(
        "branchgrpo_mix",
        (("tree.split_steps", (0, 1, 2, 3)), *EPOCHS2),
        label="branchgrpo_mix, splits 0-3, 2 inner epochs, clip 1e-2",
    ),
    "branchgrpo_mix_splits0123_lr2e-4": Setting(
        "branchgrpo_mix",
        (("tree.split_steps", (0, 1, 2, 3)), *LR2),
        label="branchgrpo_mix, splits 0-3, lr 2e-4",
    ),
    "branchgrpo_mix_trees2": Setting(
        "branchgrpo_mix", BMIX_TREES2, label="branchgrpo_mix, 2 trees"
    ),
    "branchgrpo_mix_lr3e-4": Setting("branchgrpo_mix", LR3, label="branchgrpo_mix, lr 3e-4"),
    "grpo_lr3e-4": Setting("grpo", LR3, label="grpo, lr 3e-4"),
    "treegrpo_guard_lr3e-4": Setting(
        "treegrpo", LR3 + (("grpo_guard.enabled", True),), label="treegrpo + GRPO-Guard, lr 3e-4"
    ),
    # the methods' own defaults (their sections), on-policy, at their released 3e-4
    "awm_lr3e-4": Setting("awm", LR3 + (("train.clip_range", 1.0),), label="awm, lr 3e-4"),
    "dgpo_lr3e-4": Setting(
        "dgpo",
        LR3 + (("train.kl_beta", 0.02), ("train.rows_per_minibatch", 4)),
        label="dgpo, lr 3e-4",
    ),
    # the tree's credit sharpened (docs/methods.md): node values at the branch points, their
    # gains half of an edge's credit; Pro-GRPO's variance filter on them; the last
    # iteration's rows trained again; and Stepwise-Flow-GRPO (flat chains, every step)
    "treegrpo_nodes_lr3e-4": Setting(
        "treegrpo", LR3 + NODES, label="treegrpo + node rewards, lr 3e-4"
    ),
    "treegrpo_prune_lr3e-4": Setting(
        "treegrpo",
        LR3 + NODES + (("advantage.node_pruning", "variance"),),
        label="treegrpo + node rewards + pruning, lr 3e-4",
    ),
    # replay under `updates="iteration"`: one update per first-iteration's worth of
    # minibatches, so once the held rows double them an iteration takes two updates
    "treegrpo_replay_lr3e-4": Setting(
        "treegrpo", LR3 + REPLAY, label="treegrpo + replay (two updates), lr 3e-4"
    ),
    # replay in the same one update per iteration as every other setting: the held rows
    # join the fresh ones in a larger batch
    "treegrpo_replay1u_lr3e-4": Setting(
        "treegrpo", LR3 + REPLAY + ONE_UPDATE, "minibatch", label="treegrpo + replay, lr 3e-4"
    ),
    "branchgrpo_mix_nodes_lr3e-4": Setting(
        "branchgrpo_mix", LR3 + NODES, label="branchgrpo_mix + node rewards, lr 3e-4"
    ),
    "branchgrpo_mix_replay_lr3e-4": Setting(
        "branchgrpo_mix", LR3 + REPLAY, label="branchgrpo_mix + replay (two updates), lr 3e-4"
    ),
    # the same with the truncated importance weight in place of PPO's clip
    "treegrpo_replay_is_lr3e-4": Setting(
        "treegrpo",
        LR3 + REPLAY + ONE_UPDATE + (("train.replay_correction", "truncated"),),
        "minibatch",
        label="treegrpo + replay, truncated weights, lr 3e-4",
    ),
    "branchgrpo_mix_replay1u_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + REPLAY + ONE_UPDATE,
        "minibatch",
        label="branchgrpo_mix + replay, lr 3e-4",
    ),
    "grpo_stepwise_lr3e-4": Setting(
        "grpo",
        LR3 + (("advantage.node_rewards", "all_steps"),),
        label="grpo, Stepwise-Flow-GRPO credit, lr 3e-4",
    ),
    # the trees per image: how much of an edge's credit is its gain (the mix), node values
    # at every stochastic step, a larger step, and DiffusionNFT's loss on the tree's leaves
    # at one sigma each (its rows per image near a tree's)
    "branchgrpo_mix_nodes075_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + nodes_at(0.75),
        label="branchgrpo_mix + node rewards, mix 0.75, lr 3e-4",
    ),
    "branchgrpo_mix_nodes1_lr3e-4": Setting(
        "branchgrpo_mix", LR3 + nodes_at(1.0), label="branchgrpo_mix + node rewards, mix 1, lr 3e-4"
    ),
    "branchgrpo_mix_allsteps_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + nodes_at(0.5, "all_steps"),
        label="branchgrpo_mix + node rewards at every stochastic step, lr 3e-4",
    ),
    "branchgrpo_mix_allsteps1_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + nodes_at(1.0, "all_steps"),
        label="branchgrpo_mix + node rewards at every stochastic step, mix 1, lr 3e-4",
    ),
    "treegrpo_nodes1_lr3e-4": Setting(
        "treegrpo", LR3 + nodes_at(1.0), label="treegrpo + node rewards, mix 1, lr 3e-4"
    ),
    "branchgrpo_mix_nodes_lr6e-4": Setting(
        "branchgrpo_mix",
        (("train.learning_rate", 6e-4), *NODES),
        label="branchgrpo_mix + node rewards, lr 6e-4",
    ),
    # the gains with no estimate scored: a split's parent valued at its children's mean,
    # backed up from the leaves (node_rewards="leaf_means", one decode per image)
    "branchgrpo_mix_leafmeans_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + nodes_at(0.5, "leaf_means"),
        label="branchgrpo_mix + leaf-mean gains, lr 3e-4",
    ),
    "branchgrpo_mix_leafmeans1_lr3e-4": Setting(
        "branchgrpo_mix",
        LR3 + nodes_at(1.0, "leaf_means"),
        label="branchgrpo_mix + leaf-mean gains, mix 1, lr 3e-4",
    ),
    "treegrpo_leafmeans1_lr3e-4": Setting(
        "treegrpo",
        LR3 + nodes_at(1.0, "leaf_means"),
        label="treegrpo + leaf-mean gains, mix 1, lr 3e-4",
    ),
    # a larger step for the trees and for the references that need the fewest images
    "branchgrpo_mix_lr6e-4": Setting(
        "branchgrpo_mix", (("train.learning_rate", 6e-4),), label="branchgrpo_mix, lr 6e-4"
    ),
    "branchgrpo_mix_leafmeans_lr6e-4": Setting(
        "branchgrpo_mix",
        (("train.learning_rate", 6e-4), *nodes_at(0.5, "leaf_means")),
        label="branchgrpo_mix + leaf-mean gains, lr 6e-4",
    ),
    "branchgrpo_mix_nodes_lr1e-3": Setting(
        "branchgrpo_mix",
        (("train.learning_rate", 1e-3), *NODES),
        label="branchgrpo_mix + node rewards, lr 1e-3",
    ),
    "diffusion_nft_tree_lr3e-4_1sigma": Setting(
        "diffusion_nft_tree",
        LR3 + (("diffusion_nft.timestep_fraction", 0.1),),
        label="diffusion_nft on the tree, lr 3e-4, 1 sigma per sample",
    ),
}


def references_at(lr: str) -> dict:
    """The references that need the fewest images per image (Stepwise-Flow-GRPO,
    DiffusionNFT, AWM at its released clip) at learning rate `lr`, as settings."""
    at = (("train.learning_rate", float(lr)),)
    return {
        f"grpo_stepwise_lr{lr}": Setting(
            "grpo",
            at + (("advantage.node_rewards", "all_steps"),),
            label=f"grpo, Stepwise-Flow-GRPO credit, lr {lr}",
        ),
        f"diffusion_nft_lr{lr}": Setting("diffusion_nft", at, label=f"diffusion_nft, lr {lr}"),
        f"awm_lr{lr}": Setting("awm", at + (("train.clip_range", 1.0),), label=f"awm, lr {lr}"),
    }


# at the trees' larger steps
SETTINGS.update(references_at("6e-4"))
SETTINGS.update(references_at("1e-3"))

GROUPS = {
    # The wide sweep, as measured: the candidates of the time, fewer seeds (not those of
    # "final") and a shorter budget. Later settings have groups of their own.
    "screen": (
        "grpo",
        "mixgrpo",
        "mixgrpo_lr3e-4",
        "treegrpo",
        "treegrpo_depthnorm",
        "treegrpo_trees2",
        "treegrpo_trees4",
        "treegrpo_trees4_depthnorm",
        "treegrpo_k4",
        "treegrpo_lr3e-4",
        "treegrpo_epochs2",
        "treegrpo_per_minibatch",
        "treegrpo_slide",
        "branchgrpo_mix",
        "branchgrpo_mix_trees2",
        "branchgrpo_mix_lr3e-4",
    ),
    # The side-by-side comparison of the chosen defaults against the old ones.
    "final": (
        "grpo",
        "mixgrpo",
        "treegrpo",
        "treegrpo_depthnorm",
        "treegrpo_trees2",
        "treegrpo_trees4_depthnorm",
        "treegrpo_k4",
        "branchgrpo_mix",
        "branchgrpo_mix_leafnorm",
    ),
    # BranchGRPO-Mix's credit on TreeGRPO's tree: tree shape against credit assignment.
    "branch_shape": ("grpo", "mixgrpo", "treegrpo", "branchgrpo_mix", "branchgrpo_mix_splits0123"),
    # Each leaf path's edges weighted as in flat GRPO, on both tree presets' trees.
    "per_leaf": (
        "grpo",
        "mixgrpo",
        "treegrpo",
        "treegrpo_perleaf",
        "branchgrpo_mix",
        "branchgrpo_mix_splits0123",
    ),
    # More than one update per iteration, with the clip range that lets the second one act.
    "epochs": (
        "grpo",
        "mixgrpo",
        "treegrpo",
        "treegrpo_epochs2",
        "treegrpo_epochs2_clip1e-3",
        "treegrpo_epochs2_clip1e-2",
    ),
    # The same two updates per iteration for the flat and the tree presets.
    "epochs_both": (
        "grpo",
        "mixgrpo",
        "mixgrpo_epochs2_clip1e-2",
        "treegrpo",
        "treegrpo_epochs2_clip1e-2",
        "branchgrpo_mix_splits0123",
        "branchgrpo_mix_splits0123_epochs2_clip1e-2",
    ),
    # A larger step in one update per iteration, against the second update (tiny.py's).
    "lr": (
        "grpo",
        "mixgrpo",
        "mixgrpo_lr2e-4",
        "treegrpo",
        "treegrpo_lr2e-4",
        "treegrpo_epochs2_clip1e-2",
        "branchgrpo_mix_splits0123",
        "branchgrpo_mix_splits0123_lr2e-4",
    ),
    "smoke": ("grpo", "treegrpo_depthnorm"),
    # The forward-process baseline beside the trees, on the rectified-flow twin.
    # Every method at the harness's learning rate and at DiffusionNFT's released 3e-4.
    "nft": (
        "grpo",
        "mixgrpo",
        "treegrpo",
        "branchgrpo_mix",
        "diffusion_nft",
        "diffusion_nft_tree",
        "mixgrpo_lr3e-4",
        "treegrpo_lr3e-4",
        "branchgrpo_mix_lr3e-4",
        "diffusion_nft_lr3e-4",
        "diffusion_nft_tree_lr3e-4",
    ),
    # The same training seconds for each (the "flow_time" mode): DiffusionNFT, also with
    # fewer sigmas per sample, against the trees at the same learning rate.
    "nft_cost": (
        "grpo",
        "treegrpo_lr3e-4",
        "branchgrpo_mix_lr3e-4",
        "diffusion_nft_lr3e-4",
        "diffusion_nft_lr3e-4_2sigmas",
        "diffusion_nft_tree_lr3e-4",
        "diffusion_nft_tree_lr3e-4_2sigmas",
    ),
    "nft_screen": (
        "grpo",
        "diffusion_nft",
        "diffusion_nft_lr3e-4",
        "diffusion_nft_beta0.1",
        "diffusion_nft_tree",
        "diffusion_nft_tree_lr3e-4",
    ),
    # Advantage Weighted Matching, DGPO and TreeGRPO with GRPO-Guard beside the trees, the
    # flat methods and DiffusionNFT, every one at lr 3e-4 (section 11's best for each)
    "methods": (
        "grpo_lr3e-4",
        "mixgrpo_lr3e-4",
        "treegrpo_lr3e-4",
        "branchgrpo_mix_lr3e-4",
        "diffusion_nft_lr3e-4",
        "awm_lr3e-4",
        "dgpo_lr3e-4",
        "treegrpo_guard_lr3e-4",
    ),
    # the tree's credit with and without node rewards, pruning and replay, against the flat
    # methods and the forward-process ones at their best rate; cost in forward rows
    "credit": (
        "grpo_lr3e-4",
        "grpo_stepwise_lr3e-4",
        "mixgrpo_lr3e-4",
        "diffusion_nft_lr3e-4",
        "awm_lr3e-4",
        "treegrpo_lr3e-4",
        "treegrpo_nodes_lr3e-4",
        "treegrpo_prune_lr3e-4",
        "treegrpo_replay1u_lr3e-4",
        "treegrpo_replay_is_lr3e-4",
        "branchgrpo_mix_lr3e-4",
        "branchgrpo_mix_nodes_lr3e-4",
        "branchgrpo_mix_replay1u_lr3e-4",
    ),
    # the trees per image and per reward call: the credit group's references and its best
    # tree beside the node-credit mix sweep, node values at every stochastic step, a larger
    # step and DiffusionNFT on the tree's leaves (`--reuse` takes the runs the credit group
    # already has, same mode and settings)
    "per_image": (
        "grpo_lr3e-4",
        "grpo_stepwise_lr3e-4",
        "mixgrpo_lr3e-4",
        "diffusion_nft_lr3e-4",
        "awm_lr3e-4",
        "treegrpo_nodes_lr3e-4",
        "treegrpo_nodes1_lr3e-4",
        "branchgrpo_mix_nodes_lr3e-4",
        "branchgrpo_mix_nodes075_lr3e-4",
        "branchgrpo_mix_nodes1_lr3e-4",
        "branchgrpo_mix_allsteps_lr3e-4",
        "branchgrpo_mix_allsteps1_lr3e-4",
        "branchgrpo_mix_nodes_lr6e-4",
        "diffusion_nft_tree_lr3e-4_1sigma",
        "treegrpo_leafmeans1_lr3e-4",
        "branchgrpo_mix_leafmeans_lr3e-4",
        "branchgrpo_mix_leafmeans1_lr3e-4",
        "branchgrpo_mix_lr6e-4",
        "branchgrpo_mix_leafmeans_lr6e-4",
        "branchgrpo_mix_nodes_lr1e-3",
        "grpo_stepwise_lr6e-4",
        "diffusion_nft_lr6e-4",
        "awm_lr6e-4",
        "grpo_stepwise_lr1e-3",
        "diffusion_nft_lr1e-3",
        "awm_lr1e-3",
    ),
}
# groups on the rectified-flow twin (configs/tiny_flow.py's model) and their modes
FLOW_GROUPS = {
    "nft": "flow",
    "nft_cost": "flow_time",
    "nft_screen": "flow",
    "methods": "flow1",
    "credit": "flow3",
    "per_image": "flow3",
}

MODES = {
    # seeds; budget: training seconds per run (a cap when `iterations` is set); iterations:
    # the same number of iterations (images) for every setting, None: a wall-clock budget;
    # evals: evaluations of a wall-clock run (an image run evaluates at `eval_iterations`)
    "smoke": dict(
        model="standin",
        seeds=(0,),
        budget=5.0,
        iterations=3,
        evals=2,
        rewards=("digit_alignment",),
        num_steps=5,  # smaller programs: the smoke run checks the code, it measures nothing
        prompts=2,
        eval_count=10,
    ),
    "screen": dict(
        model="tiny",
        seeds=(100, 101),
        budget=12.0,
        iterations=None,
        evals=12,
        rewards=("digit_alignment", "jpeg_compressibility"),
    ),
    "final": dict(
        model="tiny",
        seeds=(0, 1, 2),
        budget=150.0,
        iterations=16,
        evals=0,
        rewards=("digit_alignment", "jpeg_compressibility"),
    ),
    # "final" on the flow twin, whose digits start near the reward's ceiling (-0.02):
    # jpeg_compressibility and jpeg_incompressibility leave room both ways
    "flow": dict(
        model="tiny_flow",
        seeds=(0, 1, 2),
        budget=150.0,
        iterations=16,
        evals=0,
        rewards=("jpeg_compressibility", "jpeg_incompressibility"),
    ),
    # "flow" with one seed: a run that a shared machine finishes in about half an hour
    "flow1": dict(
        model="tiny_flow",
        seeds=(0,),
        budget=150.0,
        iterations=16,
        evals=0,
        rewards=("jpeg_compressibility", "jpeg_incompressibility"),
    ),
    # the flow twin again, 30 s of training per run whatever the images
    "flow_time": dict(
        model="tiny_flow",
        seeds=(0, 1, 2),
        budget=30.0,
        iterations=None,
        evals=8,
        rewards=("jpeg_compressibility", "jpeg_incompressibility"),
    ),
}

# "flow" with a third reward: the classifier's log-odds of the prompted digit, which (unlike
# the digit rewards' log-probability) has room above the twin's start
MODES["flow3"] = {**MODES["flow"], "rewards": (*MODES["flow"]["rewards"], "digit_log_odds")}


def config_of(name: str, settings: Settings):
    """The setting's config: the preset under the shared settings, then its overrides."""
    s = SETTINGS[name]
    c = make_config(s.preset, settings)
    c.name = f"study_{name}"
    for path, value in s.overrides:
        section, field = path.split(".")
        c[section][field] = value
    c.train.grad_accumulation = minibatches_per_iteration(c) if s.updates == "iteration" else 1
    return c


def save_json(out_dir: str, name: str, payload: dict) -> str:
    """Compact JSON (one line): the curves of every run make an indented file large."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(_plain(payload), f, separators=(",", ":"))
        f.write("\n")
    return path


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# Running.


def setup_runs(names, settings: Settings, model, workdir: str) -> dict:
    """One trainer per setting on one shared model (identical rollouts compile once), each
    warmed by one iteration and one evaluation so that no compile lands on a clock."""
    runs = {}
    for name in names:
        t0 = time.perf_counter()
        config = config_of(name, settings)
        trainer, state = train.setup(config, workdir, model=model)
        pr = training.PresetRun(name, config, trainer, state, training._copy(state.params))
        warm, warm_state = training.fresh_run(pr, 12345)
        warm.iteration(warm_state, 0)
        warm.evaluator.evaluate(pr.initial_params)
        runs[name] = pr
        spec = methods.get(config.tree.method).spec_at(config)
        log(f"[setup] {name}: {spec.describe()}, warm in {time.perf_counter() - t0:.1f} s")
    return runs


def eval_iterations(iterations: int) -> list[int]:
    """Iterations after which a run with an image budget is evaluated: every one of the
    first six (where the windowed methods move), then every other one, and the last."""
    return sorted({*range(1, min(iterations, 6) + 1), *range(6, iterations + 1, 2), iterations})


def iteration_cost(config, iteration: int) -> tuple[float, int]:
    """Iteration `iteration`'s cost over its prompts, as the method counts it: forward-row
    equivalents (`benchmarks.costs.row_equivalents`) and decodes scored (the leaves and any
    node estimates). Exact, whatever the machine's load."""
    counts = costs.derived_counts(config, iteration)
    prompts = config.prompts.batch_size
    rows = prompts * costs.row_equivalents(counts, config.train.inner_epochs)
    return rows, prompts * (counts["leaves"] + counts.get("node_decodes", 0))


def resumed(old: dict, names, seeds) -> tuple[dict, list]:
    """A resumed reward's curves {setting: runs} and the (seed, setting) runs still to do:
    the file's runs of other seeds stay as they are, its runs of `seeds` are kept, and each
    (seed, setting) without one is to do, seed by seed."""
    curves = {n: [r for r in old.get(n, []) if r["seed"] not in seeds] for n in names}
    todo = []
    for seed in seeds:
        for name in names:
            kept = [r for r in old.get(name, []) if r["seed"] == seed]
            curves[name] += kept
            if not kept:
                todo.append((seed, name))
    return curves, todo


MODE_FIELDS = ("model", "iterations", "num_steps", "prompts", "eval_count")  # what a run depends on


def reused_runs(path: str, payload: dict, done: dict) -> dict:
    """`done` ({reward: {"curves": {setting: runs}}}) with the runs of the study at `path`
    of the settings `payload` runs (same definition, same mode), per reward and seed where
    `done` has none. A setting or mode that differs is not taken; one line says what is."""
    try:
        with open(path) as f:
            other = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reuse {path}: cannot read it as a study's JSON ({e}).") from None
    mode, theirs = payload["mode"], other.get("mode", {})
    differs = [k for k in MODE_FIELDS if mode.get(k) != theirs.get(k)]
    if differs:
        raise SystemExit(f"--reuse {path}: its mode differs in {', '.join(differs)}.")
    names = [
        n for n, s in payload["settings"].items() if other.get("settings", {}).get(n) == _plain(s)
    ]
    out = {r: {"curves": dict(b.get("curves", {}))} for r, b in done.items()}
    taken = 0
    for reward, block in other.get("rewards", {}).items():
        if reward not in mode["rewards"]:
            continue
        curves = out.setdefault(reward, {"curves": {}})["curves"]
        for name in names:
            have = {r["seed"] for r in curves.get(name, [])}
            new = [r for r in block["curves"].get(name, []) if r["seed"] not in have]
            curves[name] = curves.get(name, []) + new
            taken += len(new)
    log(f"[reuse] {taken} runs of {', '.join(names) or 'no setting'} from {path}")
    return out


def train_for_images(pr: training.PresetRun, seed: int, iterations: int, max_s: float) -> dict:
    """Trains a fresh copy for `iterations` iterations (the same images for every setting:
    every preset has 16 leaves per prompt), or until its training clock passes `max_s`.
    The clock and the evaluations are those of `training.train_for_budget`."""
    trainer, state = training.fresh_run(pr, seed)
    leaves = trainer.spec().leaves * pr.config.prompts.batch_size
    curve = [{**training._eval_point(trainer, state.params, 0.0, 0, 0), "rows": 0.0, "decodes": 0}]
    clock, images, rows, decodes, times, clipped = 0.0, 0, 0.0, 0, [], []
    at = set(eval_iterations(iterations))
    for iteration in range(iterations):
        state, metrics = trainer.iteration(state, iteration)
        clock += metrics["time_iteration"]
        images += leaves
        iteration_rows, iteration_decodes = iteration_cost(pr.config, iteration)
        rows, decodes = rows + iteration_rows, decodes + iteration_decodes
        times.append(metrics["time_iteration"])
        clipped.append(metrics.get("clip_fraction", 0.0))
        if iteration + 1 in at or clock >= max_s:
            point = training._eval_point(trainer, state.params, clock, images, iteration + 1)
            curve.append({**point, "rows": rows, "decodes": decodes})
        if clock >= max_s:
            break
    return {
        "seed": seed,
        "curve": curve,
        "iterations": len(times),
        "iteration_times": times,
        "clip_fractions": clipped,  # per iteration, the mean over its minibatches and epochs
    }


def _crossing(results: list, key: str, target: float, end: float | None = None):
    """(first x on the seeds' median curve reaching `target`, the same per seed)."""
    end = end or max(r["curve"][-1][key] for r in results)
    grid = np.linspace(0.0, end, 4000)
    median = np.median(training.seed_curves(results, key, grid), axis=0)
    seeds = []
    for r in results:
        g = np.array([p[key] for p in r["curve"]], float)
        v = np.array([p["reward"] for p in r["curve"]], float)
        seeds.append(training.first_crossing(g, v, target))
    return training.first_crossing(grid, median, target), seeds


def _ratio(base, other):
    if base is None or other is None or other <= 0:
        return None
    return base / other


def _median_at(results: list, key: str, x: float) -> dict:
    return stats(
        [
            float(np.interp(x, [p[key] for p in r["curve"]], [p["reward"] for p in r["curve"]]))
            for r in results
        ]
    )


BASELINES = ("grpo", "mixgrpo")  # the targets: their median final eval rewards
GAP_FRACTIONS = (0.5, 0.8)  # and these fractions of the way from the start to the best


def describe_target(name: str) -> str:
    if name.startswith("gap"):
        return f"{name[3:]}% of the way from the start to the best median final reward"
    return f"{name}'s median final eval reward"


def summarize(curves: dict, mode: dict, references: tuple = ()) -> dict:
    """Per target (grpo's and mixgrpo's median final eval reward): images and training
    seconds each setting needs to reach it, on the seeds' median curve and seed by seed, and
    the ratios of mixgrpo's and grpo's figures (and the `references`') to the setting's."""
    common = min(r["curve"][-1]["images"] for rs in curves.values() for r in rs)
    out = {
        "start_reward": float(np.median([r["curve"][0]["reward"] for r in curves["grpo"]])),
        "budget_s": mode["budget"],
        "iterations": mode.get("iterations"),
        "common_images": common,
        "targets": {},
        "settings": {},
    }
    for base in BASELINES:
        if base in curves:
            out["targets"][base] = float(
                np.median([r["curve"][-1]["reward"] for r in curves[base]])
            )
    # Levels on the way from the start to the best setting's median final reward: they stay
    # meaningful where grpo ends below its start (a flat target is then met at 0 images).
    best = max(float(np.median([r["curve"][-1]["reward"] for r in rs])) for rs in curves.values())
    for fraction in GAP_FRACTIONS:
        start = out["start_reward"]
        out["targets"][f"gap{int(100 * fraction)}"] = start + fraction * (best - start)
    for name, results in curves.items():
        s = out["settings"][name] = {
            "final_reward": stats([r["curve"][-1]["reward"] for r in results]),
            "final_accuracy": stats([r["curve"][-1]["accuracy"] for r in results]),
            "reward_at_common_images": _median_at(results, "images", common),
            "reward_at_quarter_images": _median_at(results, "images", common / 4),
            "iterations": stats([r["iterations"] for r in results]),
            "images": stats([r["curve"][-1]["images"] for r in results]),
            "train_s": stats([r["curve"][-1]["time"] for r in results]),
            "iteration_s": stats([t for r in results for t in r["iteration_times"]]),
            # runs written before clip fractions were recorded have none
            "clip_fraction": stats([c for r in results for c in r.get("clip_fractions", [])])
            if any(r.get("clip_fractions") for r in results)
            else None,
            "to": {},
        }
        counted = all("rows" in p for r in results for p in r["curve"])  # older runs: none
        s["rows"] = stats([r["curve"][-1]["rows"] for r in results]) if counted else None
        last = results[0]["curve"][-1]
        s["decodes_per_image"] = last.get("decodes", 0) / last["images"] if counted else None
        for base, target in out["targets"].items():
            img, img_seeds = _crossing(results, "images", target, common)
            sec, sec_seeds = _crossing(results, "time", target)
            s["to"][base] = {
                "images": img,
                "time_s": sec,
                "per_seed_images": img_seeds,
                "per_seed_time_s": sec_seeds,
                "seeds_reaching": sum(v is not None for v in img_seeds),
            }
            if counted:  # forward-row equivalents and decodes to it, on the median curve
                s["to"][base]["rows"] = _crossing(results, "rows", target)[0]
                s["to"][base]["decodes"] = _crossing(results, "decodes", target)[0]
    for target in out["targets"]:
        for base in dict.fromkeys((*BASELINES, *references)):
            if base not in out["settings"]:
                continue
            b = out["settings"][base]["to"][target]
            for s in out["settings"].values():
                t = s["to"][target]
                t[f"images_ratio_vs_{base}"] = _ratio(b["images"], t["images"])
                t[f"time_ratio_vs_{base}"] = _ratio(b["time_s"], t["time_s"])
                for key, field in (("images", "per_seed_images"), ("time", "per_seed_time_s")):
                    pairs = [_ratio(x, y) for x, y in zip(b[field], t[field])]  # seed s vs seed s
                    pairs = [p for p in pairs if p is not None]
                    t[f"per_seed_{key}_ratio_vs_{base}"] = stats(pairs) if pairs else None
    return out


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(summary: dict, labels: dict) -> str:
    """One table per target: images and seconds to it, ratios of mixgrpo's to the setting's."""
    common = summary["common_images"]
    parts = []
    head = [
        "| setting | final reward, median [min, max] | reward at "
        f"{common / 4:.0f} images | reward at {common:.0f} images | iterations | s / iteration "
        "| clip fraction |",
        "|" + "---|" * 7,
    ]
    for name, s in summary["settings"].items():
        head.append(
            f"| {labels.get(name, name)} | {fmt_stats(s['final_reward'])} | "
            f"{s['reward_at_quarter_images']['median']:.4f} | "
            f"{s['reward_at_common_images']['median']:.4f} | {s['iterations']['median']:.0f} | "
            f"{s['iteration_s']['median']:.3f} | "
            f"{_f(s['clip_fraction'] and s['clip_fraction']['median'], '.3f')} |"
        )
    parts.append("\n".join(head))
    for target, value in summary["targets"].items():
        rows = [
            f"Target: {describe_target(target)}, {value:.4f} (start "
            f"{summary['start_reward']:.4f}).",
            "",
            "| setting | images to target (median curve) | forward-row equivalents to target "
            "| s to target | images: mixgrpo / setting | s: mixgrpo / setting | images: grpo / "
            "setting | per seed: images ratio vs mixgrpo | per seed: s ratio vs mixgrpo | seeds "
            "reaching |",
            "|" + "---|" * 10,
        ]
        for name, s in summary["settings"].items():
            t = s["to"][target]
            pi, pt = (
                t.get("per_seed_images_ratio_vs_mixgrpo"),
                t.get("per_seed_time_ratio_vs_mixgrpo"),
            )
            rows.append(
                f"| {labels.get(name, name)} | {_f(t['images'], '.0f')} | "
                f"{_f(t.get('rows'), '.0f')} | {_f(t['time_s'], '.2f')} | "
                f"{_f(t.get('images_ratio_vs_mixgrpo'), '.2f')} | "
                f"{_f(t.get('time_ratio_vs_mixgrpo'), '.1f')} | "
                f"{_f(t.get('images_ratio_vs_grpo'), '.2f')} | "
                f"{fmt_stats(pi, 2) if pi else '-'} | {fmt_stats(pt, 1) if pt else '-'} | "
                f"{t['seeds_reaching']}/{s['final_reward']['n']} |"
            )
        parts.append("\n".join(rows))
    budget = (
        f"{summary['iterations']} iterations ({common:.0f} images) per run, at most "
        f"{summary['budget_s']:.0f} s of training"
        if summary["iterations"]
        else f"{summary['budget_s']:.0f} s of training wall-clock per run"
    )
    return "\n\n".join(parts) + f"\n\nBudget: {budget}. Ratios above 1: sooner than mixgrpo."


# groups whose report adds a cost table against references of their own (ratios above 1:
# the setting needs fewer images than the reference)
COST_REFERENCES = {
    "credit": ("grpo_lr3e-4", "mixgrpo_lr3e-4", "diffusion_nft_lr3e-4"),
    "per_image": (
        "grpo_lr3e-4",
        "mixgrpo_lr3e-4",
        "diffusion_nft_lr3e-4",
        "awm_lr3e-4",
        "grpo_stepwise_lr3e-4",
        "grpo_stepwise_lr6e-4",
        "diffusion_nft_lr6e-4",
        "awm_lr6e-4",
        "grpo_stepwise_lr1e-3",
        "diffusion_nft_lr1e-3",
        "awm_lr1e-3",
    ),
}
SHORT = {
    "grpo_stepwise_lr1e-3": "stepwise 1e-3",
    "diffusion_nft_lr1e-3": "nft 1e-3",
    "awm_lr1e-3": "awm 1e-3",
    "grpo_stepwise_lr6e-4": "stepwise 6e-4",
    "diffusion_nft_lr6e-4": "nft 6e-4",
    "awm_lr6e-4": "awm 6e-4",
    "grpo_lr3e-4": "grpo",
    "mixgrpo_lr3e-4": "mixgrpo",
    "diffusion_nft_lr3e-4": "nft",
    "awm_lr3e-4": "awm",
    "grpo_stepwise_lr3e-4": "stepwise",
}


def cost_table(summary: dict, labels: dict, references: tuple) -> str:
    """Per setting: its final reward, and for 50% and 80% of the way to the best final
    reward the images, forward-row equivalents and decodes scored (leaves and node
    estimates) it needs (median curve) with each reference's images over its own, seed by
    seed (median over the seeds both reached)."""
    refs = [r for r in references if r in summary["settings"]]
    head = ["| setting | final reward |"]
    for target in ("gap50", "gap80"):
        head.append(f" images to {target[3:]}% | rows to {target[3:]}% | decodes | rows + calls |")
        head.extend(f" {SHORT.get(r, r)} / it ({target[3:]}%) |" for r in refs)
    lines = ["".join(head), "|" + "---|" * (2 + 2 * (4 + len(refs)))]
    for name, s in summary["settings"].items():
        cells = [f"| {labels.get(name, name)} | {fmt_stats(s['final_reward'], 4)} |"]
        for target in ("gap50", "gap80"):
            t = s["to"][target]
            reached = f"{t['seeds_reaching']}/{s['final_reward']['n']}"
            images = "-" if t["images"] is None else f"{t['images']:.0f} ({reached})"
            cells.append(
                f" {images} | {_f(t.get('rows'), '.0f')} | {_f(t.get('decodes'), '.0f')} |"
                f" {_f(_priced(t), '.0f')} |"
            )
            for r in refs:
                ratio = t.get(f"per_seed_images_ratio_vs_{r}")
                cells.append(f" {_f(ratio and ratio['median'], '.2f')} |")
        lines.append("".join(cells))
    return "\n".join(lines)


def _priced(to: dict) -> float | None:
    """Forward-row equivalents to a target with each decode and reward call priced like one
    forward row (a served judge or a detector costs about a denoiser pass)."""
    if to.get("rows") is None or to.get("decodes") is None:
        return None
    return to["rows"] + to["decodes"]


def verdict(summaries: dict, references: tuple) -> dict:
    """Per setting that is no reference: the rewards on which its median curve needs fewer
    images than every reference to 50% and to 80% of the way (a reference that never gets
    there counts as needing more), its decodes per image, and per reward and target the
    fewest times fewer forward rows than any reference it needs (None where it or every
    reference does not get there). `summaries`: {reward: `summarize`'s output}."""
    out = {}
    for reward, summary in summaries.items():
        for name, s in summary["settings"].items():
            if name in references or name == "grpo":
                continue
            v = out.setdefault(name, {"fewer_images": {"gap50": [], "gap80": []}, "rows": {}})
            v["decodes_per_image"] = s.get("decodes_per_image")
            for target in ("gap50", "gap80"):
                mine = s["to"][target]
                theirs = [
                    summary["settings"][r]["to"][target]
                    for r in references
                    if r in summary["settings"]
                ]
                reached = [t for t in theirs if t["images"] is not None]
                if mine["images"] is not None and all(
                    mine["images"] < t["images"] for t in reached
                ):
                    v["fewer_images"][target].append(reward)
                rows = [
                    t["rows"] / mine["rows"] for t in reached if t.get("rows") and mine.get("rows")
                ]
                v["rows"].setdefault(target, {})[reward] = min(rows) if rows else None
    return out


def verdict_table(summaries: dict, references: tuple, labels: dict) -> str:
    """The per-image verdict as a table: rewards won at 50% and 80%, decodes per image, and
    the fewest times fewer forward rows than a reference, reward by reward."""
    rewards = list(summaries)
    v = verdict(summaries, references)
    head = "| setting | decodes / image | fewer images than every reference: 50% | 80% |"
    head += "".join(f" rows: fewest x fewer ({r}, 50%) |" for r in rewards)
    lines = [head, "|" + "---|" * (4 + len(rewards))]
    for name, x in v.items():
        wins = [", ".join(x["fewer_images"][t]) or "none" for t in ("gap50", "gap80")]
        ratios = [_f(x["rows"]["gap50"].get(r), ".2f") for r in rewards]
        lines.append(
            f"| {labels.get(name, name)} | {_f(x['decodes_per_image'], '.2f')} | {wins[0]} | "
            f"{wins[1]} |" + "".join(f" {c} |" for c in ratios)
        )
    return "\n".join(lines)


def depth_spread(model, reward: str, names, draws: int = 4, prompts: int = 10) -> dict:
    """How diluted treegrpo's edge advantages are at the shipped weights: for each depth of
    the window, the root mean square over prompts and draws of the spread (population std
    over the prompt's edges of that depth) of the mean-of-leaves advantages; beside it the
    same for independent leaves, sqrt((1/m) (N - m) / (N - 1)) for m of N leaves below an
    edge. A depth at the independent figure gets no more credit than averaging unrelated
    leaves gives; near 1, its subtrees decide the reward. Library functions only (rollout,
    advantages), no training."""
    from tree_grpo_jax.core import advantages as adv
    from tree_grpo_jax.core import rollout as tree_rollout
    from tree_grpo_jax.rewards import load_reward
    from tree_grpo_jax.run.prompts import load_prompts

    score = load_reward(reward)
    texts = load_prompts("digits")[:prompts]
    out = {}
    for name in names:
        c = config_of(name, Settings(reward=reward))
        spec = methods.get(c.tree.method).spec_at(c)
        schedule = model.make_schedule(c.sampling.num_steps, c.sampling)
        cond = model.encode_prompts(texts)
        spreads = []
        for draw in range(draws):
            tree = tree_rollout.rollout(
                model.denoise, model.params, cond, jax.random.PRNGKey(draw), schedule,
                spec=spec, sample_shape=model.sample_shape,
            )  # fmt: skip
            leaves = tree.leaves.reshape(-1, *tree.leaves.shape[2:])
            r = np.asarray(
                score(model.decode(leaves), [t for t in texts for _ in range(spec.leaves)])
            )
            levels = adv.backup_mean(
                spec, adv.group_normalize(jnp.asarray(r).reshape(len(texts), -1))
            )
            spreads.append([np.asarray(jnp.var(level, axis=-1)) for level in levels[1:]])
        n = spec.leaves
        sizes = [level.shape[-1] for level in levels[1:]]
        out[name] = {
            "spec": spec.describe(),
            "nodes_per_depth": sizes,
            "spread": [float(np.sqrt(np.mean([d[i] for d in spreads]))) for i in range(len(sizes))],
            "independent": [float(np.sqrt((1 / (n // m)) * (n - n // m) / (n - 1))) for m in sizes],
        }
        log(f"[spread] {reward} {name}: {out[name]}")
    return out


# ---------------------------------------------------------------------------------------------
# Plots.


def pareto_front(xs: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The best reward reached by any setting at a cost of at most x: [settings, grid] ->
    (running max over the grid of the pointwise max over settings, which setting gives it)."""
    best = np.maximum.accumulate(values, axis=1)  # each setting's best so far
    return best.max(axis=0), best.argmax(axis=0)


def plot_reward(curves: dict, summary: dict, labels: dict, title: str, path: str) -> None:
    """The seeds' median eval reward of every setting against training wall-clock and against
    images (log x: the tree settings move in the first seconds), and the Pareto front."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    colors = plt.get_cmap("tab10")(np.arange(10))
    styles = ("-", "--", "-.", (0, (5, 1, 1, 1)))
    for ax, key in zip(axes, ("time", "images")):
        end = max(r["curve"][-1][key] for rs in curves.values() for r in rs)
        first = min(r["curve"][1][key] for rs in curves.values() for r in rs if len(r["curve"]) > 1)
        grid = np.geomspace(max(first, 1e-3), end, 500)
        medians = []
        for i, (name, results) in enumerate(curves.items()):
            stop = min(r["curve"][-1][key] for r in results)
            median = np.median(training.seed_curves(results, key, grid), axis=0)
            median = np.where(grid <= stop * (1 + 1e-9), median, np.nan)  # no extrapolation
            medians.append(median)
            base = name in BASELINES
            ax.plot(grid, median, color="C3" if name == "grpo" else "C0" if name == "mixgrpo"
                    else colors[(i + 2) % 10], ls="-" if base else styles[i % len(styles)],
                    lw=2.4 if base else 1.3, label=labels.get(name, name))  # fmt: skip
        front, _ = pareto_front(grid, np.nan_to_num(np.array(medians), nan=-np.inf))
        ax.plot(grid, front, "k:", lw=2.5, label="Pareto front (best reward at this cost)")
        for base, style in zip(summary["targets"], ("-", "--", "-.", ":")):
            ax.axhline(summary["targets"][base], color="grey", lw=0.8, ls=style)
        ax.set_xscale("log")
        ax.set_xlabel("training wall-clock, s (evaluation excluded)" if key == "time" else
                      "images generated (leaves)")  # fmt: skip
        ax.set_ylabel("eval reward (median of seeds)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title(f"{title}: reward vs wall-clock", fontsize=10)
    axes[1].set_title(
        f"{title}: reward vs images\n(grey: grpo's, mixgrpo's final; 50%, 80% of the way)",
        fontsize=10,
    )
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_costs(summary: dict, labels: dict, title: str, path: str) -> None:
    """Images and seconds each setting needs to reach grpo's final reward, with the front of
    settings no other beats on both."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    target = "gap50" if "gap50" in summary["targets"] else next(iter(summary["targets"]))
    pts = {
        n: (s["to"][target]["time_s"], s["to"][target]["images"])
        for n, s in summary["settings"].items()
        if s["to"][target]["time_s"] and s["to"][target]["images"]
    }
    for n, (t, i) in pts.items():
        ax.scatter(t, i, s=25)
        ax.annotate(labels.get(n, n), (t, i), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = sorted(
        (t, i)
        for n, (t, i) in pts.items()
        if not any(t2 <= t and i2 <= i and (t2, i2) != (t, i) for t2, i2 in pts.values())
    )
    if front:
        ax.step(*zip(*front), "k:", where="post", lw=1.5, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training seconds to the target (median curve)")
    ax.set_ylabel("images to the target (median curve)")
    ax.set_title(
        f"{title}: cost to reach {summary['targets'][target]:.4f}\n({describe_target(target)})",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(payload: dict, out: str, group: str) -> str:
    labels = {n: s.label or n for n, s in SETTINGS.items()}
    parts, summaries = [], {}  # this report's summaries (a stored one may predate a setting)
    for reward, block in payload["rewards"].items():
        # Seed by seed in the same order for every setting (ratios pair seed s with seed s),
        # over the seeds every setting has finished (a study still running reports those)
        seeds = set.intersection(*({r["seed"] for r in runs} for runs in block["curves"].values()))
        if not seeds or "grpo" not in block["curves"]:
            continue  # a reward without one seed finished by every setting
        curves = {
            n: sorted((r for r in runs if r["seed"] in seeds), key=lambda x: x["seed"])
            for n, runs in block["curves"].items()
        }
        references = COST_REFERENCES.get(group, ())
        summary = summarize(curves, payload["mode"], references)
        block["summary"] = summaries[reward] = summary
        title = f"{reward} ({len(curves['grpo'])} seeds)"
        plot_reward(
            curves, summary, labels, title, os.path.join(out, f"tree_study_{group}_{reward}.png")
        )
        plot_costs(
            summary, labels, title, os.path.join(out, f"tree_study_{group}_{reward}_cost.png")
        )
        parts.append(f"### {reward}\n\n{table(summary, labels)}")
        if references:
            parts.append(
                f"#### {reward}: cost to 50% and 80%\n\n" + cost_table(summary, labels, references)
            )
    references = COST_REFERENCES.get(group, ())
    if references and summaries:
        parts.append(
            "### Per image: fewer images than every reference, at how many decodes and rows\n\n"
            + verdict_table(summaries, references, labels)
        )
    text = "\n\n".join(parts)
    with open(os.path.join(out, f"tree_study_{group}.md"), "w") as f:
        f.write(text + "\n")
    return text


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a stand-in model; checks the code")
    p.add_argument("--group", default=None, choices=tuple(GROUPS), help="which settings")
    p.add_argument("--settings", default=None, help="comma-separated settings (overrides --group)")
    p.add_argument("--rewards", default=None, help="comma-separated rewards")
    p.add_argument("--seeds", default=None, help="comma-separated seeds")
    p.add_argument("--budget", type=float, default=None, help="training seconds per run (cap)")
    p.add_argument("--iterations", type=int, default=None, help="iterations per run (0: time)")
    p.add_argument("--evals", type=int, default=None, help="evaluations per run")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default runs/benchmarks/tree_study; smoke: a temporary one; "
        "benchmarks/results updates the committed results)",
    )
    p.add_argument("--tag", default=None, help="names the output files (default: the group)")
    p.add_argument("--resume", action="store_true", help="keep the runs its JSON already has")
    p.add_argument(
        "--reuse",
        default=None,
        metavar="JSON",
        help="take the runs another study's JSON has of this group's settings (the same mode "
        "and settings; runs are deterministic on one machine), e.g. the credit group's",
    )
    p.add_argument("--replot", default=None, metavar="JSON", help="tables and plots from a JSON")
    p.add_argument(
        "--depth-spread",
        action="store_true",
        help="only measure the spread of treegrpo's edge advantages per depth (shipped weights)",
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            payload = json.load(f)
        out = os.path.dirname(os.path.abspath(args.replot))
        log(report(payload, out, payload["tag"]))
        save_json(out, f"tree_study_{payload['tag']}", payload)  # with the summaries redone
        return payload
    group = "smoke" if args.smoke else args.group or "final"
    if args.smoke:
        kind = "smoke"
    else:
        kind = "screen" if group == "screen" else FLOW_GROUPS.get(group, "final")
    mode = dict(MODES[kind])
    # (every group but "screen" runs a mode of the same images for every setting)
    names = tuple(GROUPS[group])
    if args.settings:
        names = tuple(n.strip() for n in args.settings.split(","))
        unknown = [n for n in names if n not in SETTINGS]
        if unknown:
            raise SystemExit(f"unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}.")
    if "grpo" not in names:
        names = ("grpo", *names)  # the target of every ratio
    if args.rewards:
        mode["rewards"] = tuple(r.strip() for r in args.rewards.split(","))
    if args.seeds:
        mode["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.budget is not None:
        mode["budget"] = args.budget
    if args.iterations is not None:
        mode["iterations"] = args.iterations or None
    if args.evals is not None:
        mode["evals"] = args.evals
    tag = args.tag or group
    if args.depth_spread:
        model = load_model(Settings(model=mode["model"]))
        spread = {
            r: depth_spread(model, r, ("treegrpo", "treegrpo_trees2", "treegrpo_trees4"))
            for r in mode["rewards"]
        }
        save_json(args.out or default_out("tree_study"), "tree_study_depth_spread", spread)
        return spread
    smoke_dir = os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks", "study_smoke")
    out = args.out or (smoke_dir if args.smoke else default_out("tree_study"))
    payload = {
        "tag": tag,
        "mode": mode,
        "settings": {n: dataclasses.asdict(SETTINGS[n]) for n in names},
        "machine": machine(),
        "command": "python -m benchmarks.tree_study "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "rewards": {},
    }
    done = {}
    if args.resume and os.path.exists(os.path.join(out, f"tree_study_{tag}.json")):
        with open(os.path.join(out, f"tree_study_{tag}.json")) as f:
            done = json.load(f)["rewards"]
    if args.reuse:
        done = reused_runs(args.reuse, payload, done)  # a bad file stops before anything is written
    os.makedirs(out, exist_ok=True)
    if not args.smoke:
        compile_cache.enable()  # identical train steps of different settings compile once
    # a resumed file keeps every reward it had until this invocation reruns it (those it does
    # not run, `--rewards`, for good): a run stopped before a later reward loses none of its
    payload["rewards"] = dict(done)
    start = time.perf_counter()
    rng = smoke_rng() if args.smoke else contextlib.nullcontext()
    with rng, tempfile.TemporaryDirectory() as workdir:
        model = load_model(Settings(model=mode["model"]))
        for reward in mode["rewards"]:
            settings = Settings(
                model=mode["model"],
                reward=reward,
                num_steps=mode.get("num_steps", 10),
                prompts=mode.get("prompts", 4),
                eval_count=mode.get("eval_count", 50),
            )
            old = done.get(reward, {}).get("curves", {})
            curves, todo = resumed(old, names, mode["seeds"])
            block = payload["rewards"][reward] = {"curves": curves}
            runs = setup_runs(
                sorted({n for _, n in todo}, key=names.index), settings, model, workdir
            )
            for seed, name in todo:
                if mode.get("iterations"):
                    r = train_for_images(runs[name], seed, mode["iterations"], mode["budget"])
                else:
                    r = training.train_for_budget(runs[name], seed, mode["budget"], mode["evals"])
                block["curves"][name].append(r)
                c = r["curve"]
                log(
                    f"[{reward}] seed {seed} {name}: {c[0]['reward']:.4f} -> "
                    f"{c[-1]['reward']:.4f} in {r['iterations']} iterations "
                    f"({c[-1]['images']} images)"
                )
                payload["elapsed_s"] = time.perf_counter() - start
                save_json(out, f"tree_study_{tag}", payload)
            log(report(payload, out, tag))
    payload["elapsed_s"] = time.perf_counter() - start
    save_json(out, f"tree_study_{tag}", payload)
    log(f"wrote {out}/tree_study_{tag}.* in {payload['elapsed_s']:.0f} s")
    return payload


if __name__ == "__main__":
    main()
