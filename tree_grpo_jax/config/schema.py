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

import ml_collections

from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as reward_registry


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
    reward from its family's record), without the registered records' sections; each
    section is built by its own function below."""
    c = ml_collections.ConfigDict()
    c.name = "base"  # names the default workdir: runs/<name>/<timestamp>
    c.seed = 0  # the same seed gives the same run
    c.model = _model()
    c.prompts = _prompts()
    c.sampling = _sampling()
    c.tree = _tree()
    c.advantage = _advantage()
    c.train = _train()
    c.lora = _lora()
    # Rewards: "name" or a weighted sum "name:weight,name:weight" (see tree_grpo_jax.rewards).
    c.rewards = ""  # the default run's
    # Folders of the rewards that read a model (docs/prompts-and-rewards.md), one field per
    # such reward (its record says what folder it reads); "" = none configured (clip_score
    # then falls back to the hub id openai/clip-vit-large-patch14).
    c.reward_models = ml_collections.ConfigDict()
    c.reward_options = _reward_options()
    c.eval = _eval()
    c.checkpoint = _checkpoint()
    c.compile_cache = _compile_cache()
    c.mesh = _mesh()
    c.log = _log()

    for path, value in model_registry.default_run().items():
        section, _, field = path.rpartition(".")
        node = c[section] if section else c
        if field not in node:
            raise ValueError(f"the default run sets {path}, which is not a config field.")
        node[field] = value
    return c


def _model() -> ml_collections.ConfigDict:
    # The model: "tiny" (DDIM, ships in the package), "tiny_flow" (rectified flow, ships in the
    # package), "random_tiny" / "random_tiny_flow" (same architecture, random weights, for
    # tests), "sd" (Stable Diffusion 1.x), "sd3" (SD3 / 3.5), "flux" (FLUX.1) or "wan" (Wan2.1
    # text-to-video), each from `path`: a local diffusers-layout folder or a hub id. A family's
    # own settings are its sub-section `model.<family>`, with the defaults its record gives
    # (tree_grpo_jax/models/<family>/family.py). The default run's model, prompts and reward
    # are the tiny family's (its record's `default_run`).
    s = ml_collections.ConfigDict()
    s.name = ""  # the default run's
    s.path = ""  # a diffusers-layout folder, for "sd", "sd3", "flux" and "wan"
    s.param_dtype = "float32"  # master weights (optimizer updates are always fp32 math)
    s.compute_dtype = "float32"  # "bfloat16" runs rollouts and forwards in bf16
    # Recompute the denoiser's activations in the backward pass: "none" (False), "block"
    # (True: each transformer block, or the whole denoiser of a model without blocks) or
    # "block_save_attention" (each block, keeping its attention's q, k, v and output).
    s.remat = ml_collections.FieldReference(False, field_type=object)
    # Runs of identical transformer blocks (SD3, FLUX) as one scanned block over stacked
    # params: the same numbers, one block's program to compile; models without such runs
    # ignore it. Folders, LoRA targets and exports keep the blocks' own names.
    s.scan_layers = True
    # Attention: "xla" (materialised scores), "blockwise" (pure JAX online softmax over key
    # blocks, O(L) memory, any platform), "cudnn" (NVIDIA GPUs), "pallas" (TPUs) or "auto"
    # (cudnn on GPUs, pallas on TPUs, elsewhere blockwise for long sequences).
    s.attention = "xla"
    return s


def _prompts() -> ml_collections.ConfigDict:
    # Prompts: a built-in set name ("digits", "animals", ...) or a prompt file: .txt (one
    # prompt per line), .jsonl / .json (objects with a prompt field; the other fields are the
    # prompt's metadata) or .csv / .tsv / .parquet (a prompt column and any others)
    # (docs/prompts-and-rewards.md).
    s = ml_collections.ConfigDict()
    s.source = ""  # the default run's
    s.batch_size = 4  # prompts per iteration (per host)
    s.eval_source = ""  # defaults to `source`
    # The prompt's field or column in a .jsonl/.json/.csv/.tsv/.parquet source; empty: the
    # one of "prompt", "Prompt", "prompts", "Prompts" the file has.
    s.field = ""
    # The category's field or column (evaluate reports each reward per category); empty:
    # the one of "category", "Category", "tag" the file has, else none.
    s.category_field = ""
    s.eval_count = 10  # fixed evaluation prompts (the first of the eval set, cycled)
    return s


def _sampling() -> ml_collections.ConfigDict:
    # Sampling.
    s = ml_collections.ConfigDict()
    s.num_steps = 10
    s.eta = 1.0  # DDIM stochasticity of SDE and branch steps
    # The flow SDE's noise scale: Flow-GRPO's `a`, or the `eta` of the "dancegrpo" SDE (the
    # DanceGRPO and BranchGRPO FLUX runs use 0.3).
    s.noise_level = 0.7
    # The flow SDE: "flow_grpo" (sig_t = a * sqrt(sigma / (1 - sigma))) or "dancegrpo" (the
    # released FLUX codes': std = eta * sqrt(sigma_t - sigma_t+1)). DDIM models ignore it.
    s.flow_sde = "flow_grpo"
    # dancegrpo: add the velocity's score term to the mean (their `sde_solver=True`, which
    # both releases run); off, the mean is the Euler step.
    s.flow_score_correction = True
    s.shift = 1.0  # flow sigma shift
    s.guidance_scale = 1.0  # classifier-free guidance; 1.0 switches it off
    s.log_prob_reduce = "mean"  # "mean" or "sum" over the image's dimensions
    # Rows through the denoiser at once in the rollout and the evaluation (a level's rows, the
    # conditional and unconditional ones both with guidance, go in chunks of this many: less
    # activation memory, the same numbers); 0: all of them at once.
    s.denoise_rows = 0
    return s


def _tree() -> ml_collections.ConfigDict:
    # The tree: one of "grpo", "mixgrpo", "treegrpo", "branchgrpo", "branchgrpo_mix", or the
    # forward-process methods "diffusion_nft" (tree.group_size ODE samples per prompt) and
    # "diffusion_nft_tree" (the leaves of treegrpo's tree), "awm" / "awm_tree" (Advantage
    # Weighted Matching, likewise), "dgpo", "dpo" (online Diffusion-DPO) and "crd" (Centered
    # Reward Distillation), each on tree.group_size ODE samples per prompt, flow models only
    # (their sections below).
    s = ml_collections.ConfigDict()
    s.method = "treegrpo"
    s.group_size = 16  # grpo / mixgrpo: chains per prompt
    s.shared_init_noise = False  # grpo: chains of a prompt share their initial noise
    s.window = 4  # treegrpo / mixgrpo / branchgrpo_mix: steps in the window
    s.window_start = 0  # where the window starts at iteration 0
    s.window_slide_every = 0  # slide the window one step every N iterations (0: fixed)
    s.k = 2  # children per branch
    s.num_trees = 1  # treegrpo / branchgrpo: roots per prompt
    s.split_steps = (0, 3, 6, 9)  # branchgrpo / branchgrpo_mix
    s.split_noise_scale = 1.0  # branchgrpo: widens the Gaussian at split steps
    # How split children are scored: "sampled" (under the widened Gaussian they were drawn
    # from) or "unscaled" (under the unwidened one, as the released BranchGRPO code does).
    s.split_log_prob = "sampled"
    return s


def _advantage() -> ml_collections.ConfigDict:
    # Advantages and pruning.
    s = ml_collections.ConfigDict()
    s.clip = 5.0
    s.fusion = "mean"  # branchgrpo: "mean" or "path_prob"
    s.fusion_alpha = 1.0  # branchgrpo path-probability softmax temperature
    # branchgrpo: "depthwise" (normalize each depth of each tree, BranchGRPO's) or "leaf"
    # (normalize the prompt's leaves, then fuse up the tree without rescaling any depth)
    s.branch_normalization = "depthwise"
    s.std_ddof = 0  # grpo / treegrpo leaf std: 0 population, 1 sample (DanceGRPO)
    # treegrpo edge advantages: "none" (mean of the leaf advantages below the edge, the
    # paper's), "per_depth" (those means normalized again within each depth) or "per_leaf"
    # (those means weighted by the leaves below the edge: every trained step weighs in the
    # loss as in flat GRPO)
    s.edge_normalization = "none"
    s.stat_tracker = False  # grpo: per-prompt statistics across iterations
    s.tracker_buffer = 32
    s.tracker_min_count = 16
    s.depth_pruning = ()  # branchgrpo: depths left out of the loss
    s.depth_pruning_slide_every = 0  # slide pruned depths one down every N iters
    s.depth_pruning_stop = -1  # deepest depth the slide may reach (-1: last)
    s.width_pruning = "none"  # "none", "top_per_branch" or "best_worst"
    s.width_pruning_ratio = 0.5
    # Prune only during the first `pruning_step_ratio` of train.iterations (BranchGRPO's
    # pruning_step_ratio; 1.0: always).
    s.pruning_step_ratio = 1.0
    # Count iterations for the depth-pruning slide from 0, or from 1 as the released
    # BranchGRPO code does (its window has already moved once when the slide interval is 1).
    s.depth_pruning_count_from = 0
    # Node rewards (the PPO methods): whose x0 estimates are decoded and scored by the run's
    # reward besides the leaves: "none" (off), "all_steps" (the parents of every recorded
    # stochastic step) or "branch_points" (the parents of the BRANCH steps only)
    s.node_rewards = "none"
    # With node rewards, the share of an edge's credit that is its normalized gain,
    # value(child) - value(parent) (Stepwise-Flow-GRPO); the rest is the method's leaf credit
    s.node_mix = 1.0
    # Node pruning on node values (Pro-GRPO): "none", "cluster" (drop the nodes within
    # node_pruning_threshold stds of their level's mean), "quantile" (drop those below the
    # node_pruning_quantile quantile) or "variance" (keep the node_pruning_keep share whose
    # values vary most, Pro-GRPO's Optimal Variance Filtering: max(2, round(keep * nodes)),
    # rounded half to even, so 0.5 of 5 nodes keeps 2 and of 7 keeps 4); the dropped
    # subtrees leave the credit and the loss
    s.node_pruning = "none"
    s.node_pruning_threshold = 0.5
    s.node_pruning_quantile = 0.25
    s.node_pruning_keep = 0.5
    return s


def _train() -> ml_collections.ConfigDict:
    # Optimization.
    s = ml_collections.ConfigDict()
    s.iterations = 20
    s.learning_rate = 1e-4
    s.lr_schedule = "constant"  # "constant" or "cosine"
    s.warmup_iterations = 0
    s.weight_decay = 1e-4
    s.adam_b1 = 0.9
    s.adam_b2 = 0.999
    s.adam_eps = 1e-8
    # Adam's two moments: "float32", or "bfloat16" (half their memory; each update computes
    # in float32 and rounds the new moments to bfloat16)
    s.optimizer_state_dtype = "float32"
    s.max_grad_norm = 1.0
    s.inner_epochs = 1  # passes over each iteration's transitions
    s.rows_per_minibatch = 32  # denoiser rows (parents) per train step
    s.grad_accumulation = 1  # minibatches per optimizer update
    # 0: as grad_accumulation says; N > 0: N updates per iteration, each over a run of its
    # minibatches (all epochs'), whatever their count (1: one update per iteration); above
    # the count, one update per minibatch, said in one `note:` line
    s.updates_per_iteration = 0
    s.clip_range = 1e-4  # PPO clip epsilon
    # Replay (PPO methods): the rows of the last N iterations trained again beside each
    # iteration's own, with their own advantages and sampling log-probs (core/replay.py;
    # held on the host, N x one iteration's rows); 0: off
    s.replay = 0
    # How a replayed row's drift from the policy that drew it is corrected: "clip", PPO's
    # clip of its ratio to that policy (most replayed rows then sit past a small clip range
    # and give no gradient); "truncated", every row's term -A * min(r, replay_weight_max)
    # * grad log-prob with r its ratio to the drawing policy, unclipped (one update per
    # iteration, where a fresh row's ratio is 1 and PPO's clip is idle)
    s.replay_correction = "clip"
    s.replay_weight_max = 1.0
    s.kl_beta = 0.0  # KL to the initial model (0: off, no reference copy kept)
    return s


def _lora() -> ml_collections.ConfigDict:
    # LoRA (rank 0: full fine-tuning): W + (alpha / rank) * A @ B on the `targets` kernels
    # (module names; () = the family's defaults in tree_grpo_jax.lora), the base frozen in
    # the compute dtype; only the factors are optimized and checkpointed.
    s = ml_collections.ConfigDict()
    s.rank = 0
    s.alpha = 0.0  # 0: alpha = rank (scale 1)
    s.targets = ()
    return s


def _reward_options() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.dtype = "float32"  # the reward models' compute dtype (or "bfloat16")
    s.chunk_size = 16  # images through a reward model at once (bounds memory)
    # The decoded images come in this many parts, and a reward on the host (numpy, or a
    # server over HTTP) scores each part while the next ones decode; 1: decode all, then
    # score. Cut along a prompt's leaves: the largest divisor of them not above this.
    s.decode_chunks = 4
    # A reward's own settings are its sub-section (see its module in tree_grpo_jax/rewards).
    return s


def _eval() -> ml_collections.ConfigDict:
    # Evaluation on fixed prompts with fixed noise and the deterministic sampler.
    s = ml_collections.ConfigDict()
    s.every = 5  # iterations (0: only at the start and the end)
    s.seed = 1234
    s.num_steps = 0  # 0: the training steps
    s.extra_rewards = ()  # reported beside the training reward, e.g. ("digit_accuracy",)
    # fixed noises per eval prompt; `diversity` (tree_grpo_jax/evaluation/diversity.py)
    # compares the samples of a prompt: its repeats in the eval list (tiny: 10 of each digit)
    # and these
    s.samples_per_prompt = 1
    # the exact KL of the eval trajectories to the initial model (LoRA: the base), logged also
    # with the guard on or train.kl_beta > 0; full fine-tuning keeps a copy of the initial
    # weights for it when train.kl_beta is 0
    s.kl = False
    # The guard: checked at every evaluation against the first one; it keeps the best eval
    # step's checkpoint and stops the run (or warns) when diversity falls below
    # `min_diversity_fraction` of its first value, or a held-out metric (eval.extra_rewards)
    # falls by more than `held_out_drop` while the eval reward rises. 0 switches a test off.
    s.guard = ml_collections.ConfigDict()
    s.guard.min_diversity_fraction = 0.0  # e.g. 0.5
    s.guard.held_out_drop = 0.0  # in the metric's units, e.g. 0.05
    s.guard.action = "stop"  # "stop" or "warn"
    return s


def _checkpoint() -> ml_collections.ConfigDict:
    # Checkpoints: in <workdir>/checkpoints, or in `dir` (a local folder or a gs:// URL,
    # which every host of a pod can reach); a restart with the same workdir resumes.
    s = ml_collections.ConfigDict()
    s.dir = ""
    s.every = 10
    s.keep = 2
    return s


def _compile_cache() -> ml_collections.ConfigDict:
    # JAX's persistent compilation cache (the command line only): a second run starts warm.
    s = ml_collections.ConfigDict()
    s.enabled = True
    s.dir = ""  # "" = $TREE_GRPO_JAX_COMPILE_CACHE or ~/.cache/tree_grpo_jax/jax
    return s


def _mesh() -> ml_collections.ConfigDict:
    # Devices: mesh axes; -1 takes every remaining device.
    s = ml_collections.ConfigDict()
    s.data = -1
    s.fsdp = 1
    return s


def _log() -> ml_collections.ConfigDict:
    # Output.
    s = ml_collections.ConfigDict()
    s.progress = True
    s.tensorboard = True
    s.wandb_project = ""  # set to log to wandb as well
    return s


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
