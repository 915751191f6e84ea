"""Every setting of a training run, with its default: `base_config()`, which experiment files
start from (`from tree_grpo_jax.config import base_config`).

Any field can be overridden on the command line, e.g. `--config.train.learning_rate=3e-5`.
The shared fields are written here; the sections that belong to a registered record come
from the record, which holds their defaults: `model.<family>` from each model family
(models/<family>/family.py), `reward_options.<name>` from each reward with settings of its
own and `reward_models.<name>` (its folder, "" = none configured) from each reward that reads
a model (tree_grpo_jax/rewards), and an objective's options from the objective
(`diffusion_nft` from tree_grpo_jax/methods/nft.py, `awm`, `dgpo`, `dpo`, `crd`, and
`grpo_guard` of the PPO objective).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import pruning, rollout
from tree_grpo_jax.core.loss import REPLAY_CORRECTIONS
from tree_grpo_jax.core.sampling import FLOW_SDES
from tree_grpo_jax.core.settings import Setting, describe, flat, section
from tree_grpo_jax.models import attention
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import DTYPES, REMAT_MODES
from tree_grpo_jax.rewards import registry as reward_registry

WIDTH_PRUNING = ("none", *pruning.WIDTH_MODES)
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")
GUARD_ACTIONS = ("stop", "warn")
# jax.random.PRNGKey keeps 32 bits without x64: 2**32 would be seed 0 again, 2**64 overflows.
SEED_LIMIT = 2**32
# Classifier-free guidance is used at 1-10 (SD1.5 7.5, FLUX 3.5); far beyond, the guided
# prediction overflows and the run diverges for no reason the loss can show.
MAX_GUIDANCE_SCALE = 100.0


def _remat_sentence(value) -> str | None:
    if isinstance(value, bool) or value in REMAT_MODES:
        return None
    return (
        f"model.remat must be True, False or one of {', '.join(REMAT_MODES)}, e.g. "
        f"--config.model.remat=block; got {describe(value)}."
    )


def _split_steps_sentence(value) -> str | None:
    if all(step >= 0 for step in value):
        return None
    return f"tree.split_steps must be step indices >= 0, got {tuple(value)}."


def _targets_sentence(value) -> str | None:
    if all(isinstance(t, str) and t for t in value):
        return None
    return f"lora.targets must be module names, got {tuple(value)!r}."


def _seed(meaning: str) -> Setting:
    return Setting(
        0, meaning, low=0, high=SEED_LIMIT, open_high=True, note="what jax.random.PRNGKey keeps"
    )


def _fraction(default: float, meaning: str = "", **bounds) -> Setting:
    """A share in [0, 1] (`bounds` open either end)."""
    return Setting(default, meaning, low=0, high=1, **bounds)


def _positive(default, meaning: str = "", **more) -> Setting:
    return Setting(default, meaning, low=0, open_low=True, **more)


def _at_least(low, default, meaning: str = "", **more) -> Setting:
    return Setting(default, meaning, low=low, **more)


DTYPE_NAMES = tuple(DTYPES)

# The model: "tiny" (DDIM, ships in the package), "tiny_flow" (rectified flow, ships in the
# package), "random_tiny" / "random_tiny_flow" (same architecture, random weights, for tests),
# "sd" (Stable Diffusion 1.x), "sd3" (SD3 / 3.5), "flux" (FLUX.1) or "wan" (Wan2.1
# text-to-video), each from `path`: a local diffusers-layout folder or a hub id. A family's own
# settings are its sub-section `model.<family>`, with the defaults its record gives
# (tree_grpo_jax/models/<family>/family.py). The default run's model, prompts and reward are
# the tiny family's (its record's `default_run`).
MODEL = {
    "name": Setting("", "the model (the default run's: its family's record)"),
    "path": Setting("", 'a diffusers-layout folder, for "sd", "sd3", "flux" and "wan"'),
    "param_dtype": Setting(
        "float32",
        "master weights (optimizer updates are always fp32 math)",
        choices=DTYPE_NAMES,
    ),
    "compute_dtype": Setting(
        "float32", '"bfloat16" runs rollouts and forwards in bf16', choices=DTYPE_NAMES
    ),
    "remat": Setting(
        False,
        'recompute the denoiser\'s activations in the backward pass: "none" (False), '
        '"block" (True: each transformer block, or the whole denoiser of a model without '
        'blocks) or "block_save_attention" (each block, keeping its attention\'s q, k, v '
        "and output)",
        check=_remat_sentence,
        any_type=True,
    ),
    "scan_layers": Setting(
        True,
        "runs of identical transformer blocks (SD3, FLUX) as one scanned block over stacked "
        "params: the same numbers, one block's program to compile; models without such runs "
        "ignore it. Folders, LoRA targets and exports keep the blocks' own names.",
    ),
    "attention": Setting(
        "xla",
        '"xla" (materialised scores), "blockwise" (pure JAX online softmax over key blocks, '
        'O(L) memory, any platform), "cudnn" (NVIDIA GPUs), "pallas" (TPUs) or "auto" '
        "(cudnn on GPUs, pallas on TPUs, elsewhere blockwise for long sequences)",
        choices=attention.BACKENDS,
    ),
}

# Prompts: a built-in set name ("digits", "animals", ...) or a prompt file: .txt (one prompt
# per line), .jsonl / .json (objects with a prompt field; the other fields are the prompt's
# metadata) or .csv / .tsv / .parquet (a prompt column and any others)
# (docs/prompts-and-rewards.md).
PROMPTS = {
    "source": Setting("", "the prompt set or file (the default run's)"),
    "batch_size": _at_least(1, 4, "prompts per iteration (per host)"),
    "eval_source": Setting("", "defaults to `source`"),
    "field": Setting(
        "",
        "the prompt's field or column in a .jsonl/.json/.csv/.tsv/.parquet source; empty: the "
        'one of "prompt", "Prompt", "prompts", "Prompts" the file has',
    ),
    "category_field": Setting(
        "",
        "the category's field or column (evaluate reports each reward per category); empty: "
        'the one of "category", "Category", "tag" the file has, else none',
    ),
    "image_field": Setting(
        "",
        "the input images' field or column (a path relative to the prompt file, an http(s) URL "
        'or a list of them, for editing and image-to-video); empty: the one of "image", '
        '"images", "input_image", "input_images" the file has, else none; "none": read no images',
    ),
    "eval_count": _at_least(1, 10, "fixed evaluation prompts (the first of the eval set, cycled)"),
}

SAMPLING = {
    "num_steps": _at_least(2, 10, "sampler steps"),
    "eta": _positive(
        1.0,
        "DDIM stochasticity of SDE and branch steps",
        high=1,
        note="DDIM's stochasticity; 1 is DDPM-like",
    ),
    "noise_level": _positive(
        0.7,
        "the flow SDE's noise scale: Flow-GRPO's `a`, or the `eta` of the \"dancegrpo\" SDE "
        "(the DanceGRPO and BranchGRPO FLUX runs use 0.3)",
    ),
    "flow_sde": Setting(
        "flow_grpo",
        'the flow SDE: "flow_grpo" (sig_t = a * sqrt(sigma / (1 - sigma))) or "dancegrpo" (the '
        "released FLUX codes': std = eta * sqrt(sigma_t - sigma_t+1)). DDIM models ignore it.",
        choices=FLOW_SDES,
    ),
    "flow_score_correction": Setting(
        True,
        "dancegrpo: add the velocity's score term to the mean (their `sde_solver=True`, which "
        "both releases run); off, the mean is the Euler step",
    ),
    "shift": _positive(1.0, "flow sigma shift", note="the flow sigma shift"),
    "guidance_scale": Setting(
        1.0,
        "classifier-free guidance; 1.0 switches it off",
        low=0,
        high=MAX_GUIDANCE_SCALE,
    ),
    "log_prob_reduce": Setting("mean", "over the image's dimensions", choices=("mean", "sum")),
    "denoise_rows": _at_least(
        0,
        0,
        "rows through the denoiser at once in the rollout and the evaluation (a level's rows, "
        "the conditional and unconditional ones both with guidance, go in chunks of this many: "
        "less activation memory, the same numbers), a multiple of the batch shards (mesh data "
        "x fsdp); 0: all of them at once",
        note="0: every row at once",
    ),
}

# The tree: one of "grpo", "mixgrpo", "treegrpo", "branchgrpo", "branchgrpo_mix", or the
# forward-process methods "diffusion_nft" (tree.group_size ODE samples per prompt) and
# "diffusion_nft_tree" (the leaves of treegrpo's tree), "awm" / "awm_tree" (Advantage Weighted
# Matching, likewise), "dgpo", "dpo" (online Diffusion-DPO) and "crd" (Centered Reward
# Distillation), each on tree.group_size ODE samples per prompt, flow models only (their
# sections below).
TREE = {
    "method": Setting("treegrpo", "the method (methods/table.py)"),
    "group_size": _at_least(1, 16, "grpo / mixgrpo: chains per prompt"),
    "shared_init_noise": Setting(False, "grpo: chains of a prompt share their initial noise"),
    "window": _at_least(1, 4, "treegrpo / mixgrpo / branchgrpo_mix: steps in the window"),
    "window_start": _at_least(0, 0, "where the window starts at iteration 0"),
    "window_slide_every": _at_least(
        1, 0, "slide the window one step every N iterations (0: fixed)", also=(0,), note="fixed"
    ),
    "k": _at_least(2, 2, "children per branch", note="children per branch"),
    "num_trees": _at_least(1, 1, "treegrpo / branchgrpo: roots per prompt"),
    "split_steps": Setting(
        (0, 3, 6, 9),
        "branchgrpo / branchgrpo_mix",
        element=int,
        example="'(0,3,6,9)'",
        check=_split_steps_sentence,
    ),
    "split_noise_scale": _positive(1.0, "branchgrpo: widens the Gaussian at split steps"),
    "split_log_prob": Setting(
        "sampled",
        'how split children are scored: "sampled" (under the widened Gaussian they were drawn '
        'from) or "unscaled" (under the unwidened one, as the released BranchGRPO code does)',
        choices=rollout.SPLIT_LOG_PROBS,
    ),
}

# Advantages and pruning.
ADVANTAGE = {
    "clip": _positive(5.0, "advantages are clipped to +-clip"),
    "fusion": Setting("mean", 'branchgrpo: "mean" or "path_prob"', choices=adv.FUSIONS),
    "fusion_alpha": _positive(
        1.0, "branchgrpo path-probability softmax temperature", note="a softmax temperature"
    ),
    "branch_normalization": Setting(
        "depthwise",
        'branchgrpo: "depthwise" (normalize each depth of each tree, BranchGRPO\'s) or "leaf" '
        "(normalize the prompt's leaves, then fuse up the tree without rescaling any depth)",
        choices=adv.BRANCH_NORMALIZATIONS,
    ),
    "std_ddof": Setting(
        0, "grpo / treegrpo leaf std: 0 population, 1 sample (DanceGRPO)", choices=(0, 1)
    ),
    "edge_normalization": Setting(
        "none",
        'treegrpo edge advantages: "none" (mean of the leaf advantages below the edge, the '
        'paper\'s), "per_depth" (those means normalized again within each depth) or "per_leaf" '
        "(those means weighted by the leaves below the edge: every trained step weighs in the "
        "loss as in flat GRPO)",
        choices=adv.EDGE_NORMALIZATIONS,
    ),
    "stat_tracker": Setting(False, "grpo: per-prompt statistics across iterations"),
    "tracker_buffer": _at_least(1, 32, "rewards kept per prompt (at least tracker_min_count)"),
    "tracker_min_count": _at_least(1, 16, "rewards of a prompt before its own statistics"),
    "depth_pruning": Setting(
        (), "branchgrpo: depths left out of the loss", element=int, example="'(2,3)'"
    ),
    "depth_pruning_slide_every": _at_least(
        1, 0, "slide pruned depths one down every N iters", also=(0,), note="no slide"
    ),
    "depth_pruning_stop": _at_least(
        0,
        -1,
        "deepest depth the slide may reach (-1: last)",
        also=(-1,),
        note="the last split step",
    ),
    "width_pruning": Setting(
        "none", '"none", "top_per_branch" or "best_worst"', choices=WIDTH_PRUNING
    ),
    "width_pruning_ratio": _fraction(
        0.5, "the share of a branch's children width pruning keeps", open_low=True
    ),
    "pruning_step_ratio": _at_least(
        0,
        1.0,
        "prune only during the first `pruning_step_ratio` of train.iterations (BranchGRPO's "
        "pruning_step_ratio; 1.0: always)",
    ),
    "depth_pruning_count_from": Setting(
        0,
        "count iterations for the depth-pruning slide from 0, or from 1 as the released "
        "BranchGRPO code does (its window has already moved once when the slide interval is 1)",
        choices=(0, 1),
    ),
    "node_rewards": Setting(
        "none",
        "node rewards (the PPO methods): whose x0 estimates are decoded and scored by the "
        'run\'s reward besides the leaves: "none" (off), "all_steps" (the parents of every '
        'recorded stochastic step), "branch_points" (the parents of the BRANCH steps only) or '
        "\"leaf_means\" (none scored: a BRANCH parent's value is the mean of its children's, "
        "backed up from the leaves' rewards; no extra decodes)",
        choices=adv.NODE_REWARDS,
    ),
    "node_mix": _fraction(
        1.0,
        "with node rewards, the share of an edge's credit that is its normalized gain, "
        "value(child) - value(parent) (Stepwise-Flow-GRPO); the rest is the method's leaf "
        "credit",
    ),
    "node_pruning": Setting(
        "none",
        'node pruning on node values (Pro-GRPO): "none", "cluster" (drop the nodes within '
        'node_pruning_threshold stds of their level\'s mean), "quantile" (drop those below '
        'the node_pruning_quantile quantile) or "variance" (keep the node_pruning_keep share '
        "whose values vary most, Pro-GRPO's Optimal Variance Filtering: max(2, round(keep * "
        "nodes)), rounded half to even, so 0.5 of 5 nodes keeps 2 and of 7 keeps 4); the "
        "dropped subtrees leave the credit and the loss",
        choices=pruning.NODE_PRUNINGS,
    ),
    "node_pruning_threshold": _fraction(
        0.5,
        "cluster: the band around a level's mean, in its standard deviations",
        open_low=True,
        open_high=True,
        note="standard deviations from the level's mean; at 1 or more every node could go",
    ),
    "node_pruning_quantile": _fraction(
        0.25, "quantile: the nodes below it are dropped", open_low=True, open_high=True
    ),
    "node_pruning_keep": _fraction(0.5, "variance: the share of nodes kept", open_low=True),
}

# Optimization.
TRAIN = {
    "iterations": _at_least(1, 20, "rollouts and updates of the run"),
    "learning_rate": _positive(1e-4, "AdamW's peak learning rate"),
    "lr_schedule": Setting(
        "constant", "after the warmup: constant, or a cosine decay to 0", choices=LR_SCHEDULES
    ),
    "warmup_iterations": _at_least(0, 0, "iterations of linear warmup", note="0: no warmup"),
    "weight_decay": _at_least(0, 1e-4, "AdamW's decoupled weight decay"),
    "adam_b1": _fraction(0.9, "Adam's first-moment decay", open_high=True),
    "adam_b2": _fraction(0.999, "Adam's second-moment decay", open_high=True),
    "adam_eps": _positive(1e-8, "Adam's epsilon"),
    "optimizer_state_dtype": Setting(
        "float32",
        'Adam\'s two moments: "float32", or "bfloat16" (half their memory; each update '
        "computes in float32 and rounds the new moments to bfloat16)",
        choices=OPTIMIZER_STATE_DTYPES,
        note="the dtype Adam's two moments are kept in",
    ),
    "max_grad_norm": _positive(1.0, "gradients clipped to this global norm"),
    "inner_epochs": _at_least(1, 1, "passes over each iteration's transitions"),
    "rows_per_minibatch": _at_least(1, 32, "denoiser rows (parents) per train step"),
    "grad_accumulation": _at_least(1, 1, "minibatches per optimizer update"),
    "updates_per_iteration": _at_least(
        1,
        0,
        "0: as grad_accumulation says; N > 0: N updates per iteration, each over a run of its "
        "minibatches (all epochs'), whatever their count (1: one update per iteration); above "
        "the count, one update per minibatch, said in one `note:` line",
        also=(0,),
        note="off",
    ),
    "clip_range": _positive(1e-4, "PPO clip epsilon"),
    "replay": _at_least(
        1,
        0,
        "replay (PPO methods): the rows of the last N iterations trained again beside each "
        "iteration's own, with their own advantages and sampling log-probs (core/replay.py; "
        "held on the host, N x one iteration's rows); 0: off",
        also=(0,),
        note="off",
    ),
    "replay_correction": Setting(
        "clip",
        "how a replayed row's drift from the policy that drew it is corrected: \"clip\", PPO's "
        "clip of its ratio to that policy (most replayed rows then sit past a small clip range "
        'and give no gradient); "truncated", every row\'s term -A * min(r, replay_weight_max) '
        "* grad log-prob with r its ratio to the drawing policy, unclipped (one update per "
        "iteration, where a fresh row's ratio is 1 and PPO's clip is idle)",
        choices=REPLAY_CORRECTIONS,
    ),
    "replay_weight_max": _positive(1.0, "truncated: a replayed row's ratio cap"),
    "kl_beta": _at_least(0, 0.0, "KL to the initial model (0: off, no reference copy kept)"),
}

# LoRA (rank 0: full fine-tuning): W + (alpha / rank) * A @ B on the `targets` kernels (module
# names; () = the family's defaults in tree_grpo_jax.lora), the base frozen in the compute
# dtype; only the factors are optimized and checkpointed.
LORA = {
    "rank": _at_least(0, 0, "the factors' rank (0: full fine-tuning)", note="0: full fine-tuning"),
    "alpha": _at_least(0, 0.0, "0: alpha = rank (scale 1)", note="0: alpha = rank"),
    "targets": Setting(
        (),
        "module names; () = the family's defaults",
        element=str,
        example="\"('to_q','to_v')\"",
        check=_targets_sentence,
    ),
}

# A reward's own settings are its sub-section (see its module in tree_grpo_jax/rewards).
REWARD_OPTIONS = {
    "dtype": Setting("float32", "the reward models' compute dtype", choices=DTYPE_NAMES),
    "chunk_size": _at_least(1, 16, "images through a reward model at once (bounds memory)"),
    "decode_chunks": _at_least(
        1,
        4,
        "the decoded images come in this many parts, and a reward on the host (numpy, or a "
        "server over HTTP) scores each part while the next ones decode; 1: decode all, then "
        "score. Cut along a prompt's leaves: the largest divisor of them not above this.",
        note="1: decode all, then score",
    ),
}

# Evaluation on fixed prompts with fixed noise and the deterministic sampler.
EVAL = {
    "every": _at_least(0, 5, "iterations (0: only at the start and the end)"),
    "seed": dataclasses.replace(_seed("the evaluation's noise"), default=1234),
    "num_steps": _at_least(2, 0, "0: the training steps", also=(0,), note="the training steps"),
    "extra_rewards": Setting(
        (),
        'reported beside the training reward, e.g. ("digit_accuracy",)',
        element=str,
        example="\"('digit_accuracy','clip_score')\"",
    ),
    "samples_per_prompt": _at_least(
        1,
        1,
        "fixed noises per eval prompt; `diversity` (tree_grpo_jax/evaluation/diversity.py) "
        "compares the samples of a prompt: its repeats in the eval list (tiny: 10 of each "
        "digit) and these",
    ),
    "kl": Setting(
        False,
        "the exact KL of the eval trajectories to the initial model (LoRA: the base), logged "
        "also with the guard on or train.kl_beta > 0; full fine-tuning keeps a copy of the "
        "initial weights for it when train.kl_beta is 0",
    ),
    # The guard: checked at every evaluation against the first one; it keeps the best eval
    # step's checkpoint and stops the run (or warns) when diversity falls below
    # `min_diversity_fraction` of its first value, or a held-out metric (eval.extra_rewards)
    # falls by more than `held_out_drop` while the eval reward rises. 0 switches a test off.
    "guard": {
        "min_diversity_fraction": _fraction(0.0, "e.g. 0.5", open_high=True, note="0: off"),
        "held_out_drop": _at_least(0, 0.0, "in the metric's units, e.g. 0.05", note="0: off"),
        "action": Setting("stop", '"stop" or "warn"', choices=GUARD_ACTIONS),
    },
}

# Checkpoints: in <workdir>/checkpoints, or in `dir` (a local folder or a gs:// URL, which
# every host of a pod can reach); a restart with the same workdir resumes.
CHECKPOINT = {
    "dir": Setting("", '"" = <workdir>/checkpoints; a local folder or a gs:// URL'),
    "every": _at_least(0, 10, "iterations between checkpoints"),
    "keep": _at_least(1, 2, "checkpoints kept"),
}


def _mesh_axis(default: int) -> Setting:
    return _at_least(
        1, default, "-1 takes every remaining device", also=(-1,), note="every remaining device"
    )


# The whole schema: each section's declarations (a run's config also holds the registered
# records' sections).
SHARED = {
    "name": Setting("base", "names the default workdir: runs/<name>/<timestamp>"),
    "seed": _seed("the same seed gives the same run"),
    "model": MODEL,
    "prompts": PROMPTS,
    "sampling": SAMPLING,
    "tree": TREE,
    "advantage": ADVANTAGE,
    "train": TRAIN,
    "lora": LORA,
    # Rewards: "name" or a weighted sum "name:weight,name:weight" (see tree_grpo_jax.rewards).
    "rewards": Setting("", "the default run's"),
    # Folders of the rewards that read a model (docs/prompts-and-rewards.md), one field per
    # such reward (its record says what folder it reads); "" = none configured (clip_score
    # then falls back to the hub id openai/clip-vit-large-patch14).
    "reward_models": {},
    "reward_options": REWARD_OPTIONS,
    "eval": EVAL,
    "checkpoint": CHECKPOINT,
    # JAX's persistent compilation cache (the command line only): a second run starts warm.
    "compile_cache": {
        "enabled": Setting(True, "a second run starts warm"),
        "dir": Setting("", '"" = $TREE_GRPO_JAX_COMPILE_CACHE or ~/.cache/tree_grpo_jax/jax'),
    },
    # Devices: mesh axes. data x fsdp x sequence covers the devices; `sequence` splits each
    # sample's tokens over that many devices in the DiT families (docs/devices-and-hosts.md).
    "mesh": {
        "data": _mesh_axis(-1),
        "fsdp": _mesh_axis(1),
        "sequence": _at_least(1, 1, "devices one sample's tokens are split over (DiT families)"),
    },
    "log": {
        "progress": Setting(True, "the progress line and the eval lines"),
        "tensorboard": Setting(True, "TensorBoard event files beside metrics.jsonl"),
        "wandb_project": Setting("", "set to log to wandb as well"),
    },
}


def flatten(node, prefix: str = "", leaves_only: bool = False) -> dict:
    """path -> value of every field below `node` (a ConfigDict, or anything with `items`),
    sections too unless `leaves_only`, each parent before its children, in the node's order
    (a ConfigDict's is sorted)."""
    out = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if hasattr(value, "items"):
            if not leaves_only:
                out[path] = value
            out.update(flatten(value, f"{path}.", leaves_only))
        else:
            out[path] = value
    return out


def registered_sections() -> dict[str, object]:
    """The registered records' sections and fields: path -> default (a ConfigDict for a
    section; None for a section whose record declares no fields, which may hold any). A
    path without a dot is a section of its own (an objective's options)."""
    from tree_grpo_jax import methods  # the objectives' jax code, on the first config built

    sections = {}
    for family in model_registry.families():
        sections[f"model.{family.name}"] = family.options() if family.options else None
    for objective in methods.objectives():
        if objective.section is not None:
            sections[objective.section] = objective.options()
    for name in reward_registry.available_rewards():
        options = reward_registry.options_of(name, ml_collections.ConfigDict())
        if options is not None:
            sections[f"reward_options.{name}"] = options
        if reward_registry.needs_weights(name):
            sections[f"reward_models.{name}"] = ""
    for family in reward_registry.reward_families():  # its members' settings, checked by it
        sections[f"reward_options.{family}"] = None
    return sections


def shared_config() -> ml_collections.ConfigDict:
    """The fields every run has, at their defaults (the default run's model, prompts and
    reward from its family's record), without the registered records' sections."""
    c = section(SHARED)
    for path, value in model_registry.default_run().items():
        parent, _, field = path.rpartition(".")
        node = c[parent] if parent else c
        if field not in node:
            raise ValueError(f"the default run sets {path}, which is not a config field.")
        node[field] = value
    return c


def registered_settings() -> dict[str, Setting]:
    """path -> Setting of every declared field of the registered records' sections."""
    from tree_grpo_jax import methods

    found = {}
    for family in model_registry.families():
        found.update(flat(getattr(family.options, "settings", {}), f"model.{family.name}."))
    for objective in methods.objectives():
        if objective.section is not None:
            found.update(flat(objective.settings, f"{objective.section}."))
    for name in reward_registry.available_rewards():
        options = reward_registry.options_function(name)
        found.update(flat(getattr(options, "settings", {}), f"reward_options.{name}."))
        if reward_registry.needs_weights(name):
            found[f"reward_models.{name}"] = Setting("", 'its folder; "" = none configured')
    return found


def declared_settings() -> dict[str, Setting]:
    """path -> Setting of every declared field: the shared ones and the registered sections'."""
    return {**flat(SHARED), **registered_settings()}


def base_config() -> ml_collections.ConfigDict:
    """A fresh config of every field at its default: the shared fields and the registered
    records' sections (those that declare their fields)."""
    c = shared_config()
    for path, default in registered_sections().items():
        if default is None:
            continue
        section, _, name = path.partition(".")
        if name:
            c[section][name] = default
        else:
            c[section] = default
    return c


def saved_config(saved: dict) -> ml_collections.ConfigDict:
    """A run's config.json laid over `base_config()`: fields added since the run was saved
    take their defaults (JSON lists become the tuples they were)."""
    config = base_config()
    config.update(saved)
    return config
