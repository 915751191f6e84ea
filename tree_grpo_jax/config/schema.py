"""Every setting of a training run, with its default: `base_config()`, which experiment files
start from (`from tree_grpo_jax.config import base_config`).

Any field can be overridden on the command line, e.g. `--config.train.learning_rate=3e-5`.
The shared fields are written here; the sections that belong to a registered record come
from the record, which holds their defaults: `model.<family>` from each model family
(models/<family>/family.py), `reward_options.<name>` from each reward with settings of its
own and `reward_models.<name>` (its folder, "" = none configured) from each reward that reads
a model (tree_grpo_jax/rewards), and an objective's options from the objective
(`diffusion_nft` from tree_grpo_jax/methods/nft.py, `awm`, `dgpo`, and `grpo_guard` of
the PPO objective).
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
    return sections


def shared_config() -> ml_collections.ConfigDict:
    """The fields every run has, at their defaults (the default run's model, prompts and
    reward from its family's record), without the registered records' sections."""
    c = ml_collections.ConfigDict()
    c.name = "base"  # names the default workdir: runs/<name>/<timestamp>
    c.seed = 0  # the same seed gives the same run

    # The model: "tiny" (DDIM, ships in the package), "tiny_flow" (rectified flow, ships in the
    # package), "random_tiny" / "random_tiny_flow" (same architecture, random weights, for
    # tests), "sd" (Stable Diffusion 1.x), "sd3" (SD3 / 3.5), "flux" (FLUX.1) or "wan" (Wan2.1
    # text-to-video), each from `path`: a local diffusers-layout folder or a hub id. A family's
    # own settings are its sub-section `model.<family>`, with the defaults its record gives
    # (tree_grpo_jax/models/<family>/family.py). The default run's model, prompts and reward
    # are the tiny family's (its record's `default_run`).
    c.model = ml_collections.ConfigDict()
    c.model.name = ""  # the default run's
    c.model.path = ""  # a diffusers-layout folder, for "sd", "sd3", "flux" and "wan"
    c.model.param_dtype = "float32"  # master weights (optimizer updates are always fp32 math)
    c.model.compute_dtype = "float32"  # "bfloat16" runs rollouts and forwards in bf16
    # Recompute the denoiser's activations in the backward pass: "none" (False), "block"
    # (True: each transformer block, or the whole denoiser of a model without blocks) or
    # "block_save_attention" (each block, keeping its attention's q, k, v and output).
    c.model.remat = ml_collections.FieldReference(False, field_type=object)
    # Runs of identical transformer blocks (SD3, FLUX) as one scanned block over stacked
    # params: the same numbers, one block's program to compile; models without such runs
    # ignore it. Folders, LoRA targets and exports keep the blocks' own names.
    c.model.scan_layers = True
    # Attention: "xla" (materialised scores), "blockwise" (pure JAX online softmax over key
    # blocks, O(L) memory, any platform), "cudnn" (NVIDIA GPUs), "pallas" (TPUs) or "auto"
    # (cudnn on GPUs, pallas on TPUs, elsewhere blockwise for long sequences).
    c.model.attention = "xla"

    # Prompts: a built-in set name ("digits", "animals", ...) or a text file, one per line.
    c.prompts = ml_collections.ConfigDict()
    c.prompts.source = ""  # the default run's
    c.prompts.batch_size = 4  # prompts per iteration (per host)
    c.prompts.eval_source = ""  # defaults to `source`
    c.prompts.eval_count = 10  # fixed evaluation prompts (the first of the eval set, cycled)

    # Sampling.
    c.sampling = ml_collections.ConfigDict()
    c.sampling.num_steps = 10
    c.sampling.eta = 1.0  # DDIM stochasticity of SDE and branch steps
    # The flow SDE's noise scale: Flow-GRPO's `a`, or the `eta` of the "dancegrpo" SDE (the
    # DanceGRPO and BranchGRPO FLUX runs use 0.3).
    c.sampling.noise_level = 0.7
    # The flow SDE: "flow_grpo" (sig_t = a * sqrt(sigma / (1 - sigma))) or "dancegrpo" (the
    # released FLUX codes': std = eta * sqrt(sigma_t - sigma_t+1)). DDIM models ignore it.
    c.sampling.flow_sde = "flow_grpo"
    # dancegrpo: add the velocity's score term to the mean (their `sde_solver=True`, which
    # both releases run); off, the mean is the Euler step.
    c.sampling.flow_score_correction = True
    c.sampling.shift = 1.0  # flow sigma shift
    c.sampling.guidance_scale = 1.0  # classifier-free guidance; 1.0 switches it off
    c.sampling.log_prob_reduce = "mean"  # "mean" or "sum" over the image's dimensions
    # Rows through the denoiser at once in the rollout and the evaluation (a level's rows, the
    # conditional and unconditional ones both with guidance, go in chunks of this many: less
    # activation memory, the same numbers); 0: all of them at once.
    c.sampling.denoise_rows = 0

    # The tree: one of "grpo", "mixgrpo", "treegrpo", "branchgrpo", "branchgrpo_mix", or the
    # forward-process methods "diffusion_nft" (tree.group_size ODE samples per prompt) and
    # "diffusion_nft_tree" (the leaves of treegrpo's tree), "awm" / "awm_tree" (Advantage
    # Weighted Matching, likewise) and "dgpo" (tree.group_size ODE samples per prompt), flow
    # models only (their sections below).
    c.tree = ml_collections.ConfigDict()
    c.tree.method = "treegrpo"
    c.tree.group_size = 16  # grpo / mixgrpo: chains per prompt
    c.tree.shared_init_noise = False  # grpo: chains of a prompt share their initial noise
    c.tree.window = 4  # treegrpo / mixgrpo / branchgrpo_mix: steps in the window
    c.tree.window_start = 0  # where the window starts at iteration 0
    c.tree.window_slide_every = 0  # slide the window one step every N iterations (0: fixed)
    c.tree.k = 2  # children per branch
    c.tree.num_trees = 1  # treegrpo / branchgrpo: roots per prompt
    c.tree.split_steps = (0, 3, 6, 9)  # branchgrpo / branchgrpo_mix
    c.tree.split_noise_scale = 1.0  # branchgrpo: widens the Gaussian at split steps
    # How split children are scored: "sampled" (under the widened Gaussian they were drawn
    # from) or "unscaled" (under the unwidened one, as the released BranchGRPO code does).
    c.tree.split_log_prob = "sampled"

    # Advantages and pruning.
    c.advantage = ml_collections.ConfigDict()
    c.advantage.clip = 5.0
    c.advantage.fusion = "mean"  # branchgrpo: "mean" or "path_prob"
    c.advantage.fusion_alpha = 1.0  # branchgrpo path-probability softmax temperature
    # branchgrpo: "depthwise" (normalize each depth of each tree, BranchGRPO's) or "leaf"
    # (normalize the prompt's leaves, then fuse up the tree without rescaling any depth)
    c.advantage.branch_normalization = "depthwise"
    c.advantage.std_ddof = 0  # grpo / treegrpo leaf std: 0 population, 1 sample (DanceGRPO)
    # treegrpo edge advantages: "none" (mean of the leaf advantages below the edge, the
    # paper's), "per_depth" (those means normalized again within each depth) or "per_leaf"
    # (those means weighted by the leaves below the edge: every trained step weighs in the
    # loss as in flat GRPO)
    c.advantage.edge_normalization = "none"
    c.advantage.stat_tracker = False  # grpo: per-prompt statistics across iterations
    c.advantage.tracker_buffer = 32
    c.advantage.tracker_min_count = 16
    c.advantage.depth_pruning = ()  # branchgrpo: depths left out of the loss
    c.advantage.depth_pruning_slide_every = 0  # slide pruned depths one down every N iters
    c.advantage.depth_pruning_stop = -1  # deepest depth the slide may reach (-1: last)
    c.advantage.width_pruning = "none"  # "none", "top_per_branch" or "best_worst"
    c.advantage.width_pruning_ratio = 0.5
    # Prune only during the first `pruning_step_ratio` of train.iterations (BranchGRPO's
    # pruning_step_ratio; 1.0: always).
    c.advantage.pruning_step_ratio = 1.0
    # Count iterations for the depth-pruning slide from 0, or from 1 as the released
    # BranchGRPO code does (its window has already moved once when the slide interval is 1).
    c.advantage.depth_pruning_count_from = 0

    # Optimization.
    c.train = ml_collections.ConfigDict()
    c.train.iterations = 20
    c.train.learning_rate = 1e-4
    c.train.lr_schedule = "constant"  # "constant" or "cosine"
    c.train.warmup_iterations = 0
    c.train.weight_decay = 1e-4
    c.train.adam_b1 = 0.9
    c.train.adam_b2 = 0.999
    c.train.adam_eps = 1e-8
    c.train.max_grad_norm = 1.0
    c.train.inner_epochs = 1  # passes over each iteration's transitions
    c.train.rows_per_minibatch = 32  # denoiser rows (parents) per train step
    c.train.grad_accumulation = 1  # minibatches per optimizer update
    # 0: as grad_accumulation says; N > 0: N updates per iteration, each over a run of its
    # minibatches (all epochs'), whatever their count (1: one update per iteration); above
    # the count, one update per minibatch, said in one `note:` line
    c.train.updates_per_iteration = 0
    c.train.clip_range = 1e-4  # PPO clip epsilon
    c.train.kl_beta = 0.0  # KL to the initial model (0: off, no reference copy kept)

    # LoRA (rank 0: full fine-tuning): W + (alpha / rank) * A @ B on the `targets` kernels
    # (module names; () = the family's defaults in tree_grpo_jax.lora), the base frozen in
    # the compute dtype; only the factors are optimized and checkpointed.
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0
    c.lora.alpha = 0.0  # 0: alpha = rank (scale 1)
    c.lora.targets = ()

    # Rewards: "name" or a weighted sum "name:weight,name:weight" (see tree_grpo_jax.rewards).
    c.rewards = ""  # the default run's
    # Folders of the rewards that read a model (docs/prompts-and-rewards.md), one field per
    # such reward (its record says what folder it reads); "" = none configured (clip_score
    # then falls back to the hub id openai/clip-vit-large-patch14).
    c.reward_models = ml_collections.ConfigDict()
    c.reward_options = ml_collections.ConfigDict()
    c.reward_options.dtype = "float32"  # the reward models' compute dtype (or "bfloat16")
    c.reward_options.chunk_size = 16  # images through a reward model at once (bounds memory)
    # A reward's own settings are its sub-section (see its module in tree_grpo_jax/rewards).

    # Evaluation on fixed prompts with fixed noise and the deterministic sampler.
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 5  # iterations (0: only at the start and the end)
    c.eval.seed = 1234
    c.eval.num_steps = 0  # 0: the training steps
    c.eval.extra_rewards = ()  # reported beside the training reward, e.g. ("digit_accuracy",)
    # fixed noises per eval prompt; `diversity` (tree_grpo_jax/evaluation/diversity.py)
    # compares the samples of a prompt: its repeats in the eval list (tiny: 10 of each digit)
    # and these
    c.eval.samples_per_prompt = 1
    # the exact KL of the eval trajectories to the initial model (LoRA: the base), logged also
    # with the guard on or train.kl_beta > 0; full fine-tuning keeps a copy of the initial
    # weights for it when train.kl_beta is 0
    c.eval.kl = False
    # The guard: checked at every evaluation against the first one; it keeps the best eval
    # step's checkpoint and stops the run (or warns) when diversity falls below
    # `min_diversity_fraction` of its first value, or a held-out metric (eval.extra_rewards)
    # falls by more than `held_out_drop` while the eval reward rises. 0 switches a test off.
    c.eval.guard = ml_collections.ConfigDict()
    c.eval.guard.min_diversity_fraction = 0.0  # e.g. 0.5
    c.eval.guard.held_out_drop = 0.0  # in the metric's units, e.g. 0.05
    c.eval.guard.action = "stop"  # "stop" or "warn"

    # Checkpoints: in <workdir>/checkpoints, or in `dir` (a local folder or a gs:// URL,
    # which every host of a pod can reach); a restart with the same workdir resumes.
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.dir = ""
    c.checkpoint.every = 10
    c.checkpoint.keep = 2

    # JAX's persistent compilation cache (the command line only): a second run starts warm.
    c.compile_cache = ml_collections.ConfigDict()
    c.compile_cache.enabled = True
    c.compile_cache.dir = ""  # "" = $TREE_GRPO_JAX_COMPILE_CACHE or ~/.cache/tree_grpo_jax/jax

    # Devices: mesh axes; -1 takes every remaining device.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1

    # Output.
    c.log = ml_collections.ConfigDict()
    c.log.progress = True
    c.log.tensorboard = True
    c.log.wandb_project = ""  # set to log to wandb as well

    for path, value in model_registry.default_run().items():
        section, _, field = path.rpartition(".")
        node = c[section] if section else c
        if field not in node:
            raise ValueError(f"the default run sets {path}, which is not a config field.")
        node[field] = value
    return c


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
