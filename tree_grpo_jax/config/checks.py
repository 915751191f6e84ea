"""The checks that turn a bad config value into one clear sentence before anything heavy
starts, and the reward string's syntax. The fields and their defaults are schema.py's; a
config's shape and types are shape.py's."""

from __future__ import annotations

import importlib.util
import math

import ml_collections

from tree_grpo_jax.config.schema import flatten
from tree_grpo_jax.config.shape import (
    ConfigError,
    check_shape,
    check_types,
    describe,
    is_int,
    is_number,
    require,
    shared_default,
)
from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import pruning, rollout, tree_spec
from tree_grpo_jax.core.loss import REPLAY_CORRECTIONS
from tree_grpo_jax.core.sampling import FLOW_SDES
from tree_grpo_jax.models import attention
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import DTYPES, REMAT_MODES
from tree_grpo_jax.rewards import registry as reward_registry

WIDTH_PRUNING = ("none", *pruning.WIDTH_MODES)
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")
# jax.random.PRNGKey keeps 32 bits without x64: 2**32 would be seed 0 again, 2**64 overflows.
SEED_LIMIT = 2**32


def parse_rewards(text: str) -> dict[str, float]:
    """`"a"` -> {a: 1.0}; `"a:1,b:0.1"` -> {a: 1.0, b: 0.1}; a reward family's member is
    `family:name[:weight]` (`"remote:judge:0.5"` -> {remote:judge: 0.5})."""
    weights = {}
    for part in str(text).split(","):
        name, _, weight = part.strip().partition(":")
        if not name:
            raise ConfigError(f"rewards {text!r} has an empty entry; write name[:weight],...")
        if name in reward_registry.reward_families():
            member, _, weight = weight.partition(":")
            if not member:
                raise ConfigError(
                    f"rewards entry {part.strip()!r} names no {name} reward; write "
                    f"{name}:<name>[:weight] with its settings in reward_options.{name}.<name>."
                )
            name = f"{name}:{member}"
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(
                f"reward weight {weight!r} of {name!r} is not a number; write name:weight."
            ) from None
    return weights


# ---------------------------------------------------------------------------------------------
# Values.


def validate(config: ml_collections.ConfigDict, known_rewards=()) -> dict[str, float]:
    """Raises ConfigError with one sentence for the first bad value found; returns the
    parsed reward weights."""
    # The methods table (and the objectives' jax code) is needed only here: importing the
    # config package does not load it.
    from tree_grpo_jax import methods

    check_shape(config)
    check_types(config)
    require(
        bool(config.name) and "/" not in config.name,
        f"name must be a folder name without '/' (runs/<name>/<time>), got {config.name!r}.",
    )
    _check_seed("seed", config.seed)
    _check_model(config.model)
    _check_prompts(config.prompts)
    _check_sampling(config.sampling)

    t = config.tree
    require(
        t.split_log_prob in rollout.SPLIT_LOG_PROBS,
        f"tree.split_log_prob must be one of {rollout.SPLIT_LOG_PROBS}, got {t.split_log_prob!r}.",
    )
    require(t.window_slide_every >= 0, "tree.window_slide_every must be 0 (fixed) or positive.")
    try:
        spec = methods.spec_at(config, 0)
    except methods.UnknownMethodError as e:
        raise ConfigError(str(e)) from e
    except tree_spec.SpecError as e:
        raise ConfigError(f"tree: {e}") from e
    for objective in methods.objectives():  # every objective's own section, whichever is used
        sentence = objective.check_section(config)
        require(sentence is None, sentence)
    _check_unused_sections(config)
    objective = methods.get(t.method).objective
    sentence = objective.check_run(config, spec)
    require(sentence is None, sentence)
    require(
        not config.train.get("replay", 0) or objective.replays_rows,
        f"train.replay trains past iterations' PPO transitions again, but {t.method} trains "
        f"through the {objective.name} objective, whose rows are not PPO transitions; set "
        "train.replay=0.",
    )
    if config.train.get("replay_correction", "clip") == "truncated":
        tr = config.train
        require(
            tr.get("replay", 0) > 0,
            "train.replay_correction='truncated' corrects replayed rows; set train.replay=N.",
        )
        require(
            tr.get("updates_per_iteration", 0) == 1 and tr.inner_epochs == 1,
            "train.replay_correction='truncated' drops PPO's clip, which is idle only in one "
            "update per iteration: set train.updates_per_iteration=1 and train.inner_epochs=1.",
        )
        require(
            not config.grpo_guard.enabled,
            "train.replay_correction='truncated' weights the plain ratio; GRPO-Guard "
            "(grpo_guard.enabled) normalises it: use one or the other.",
        )
    require(
        spec.leaves >= 2,
        f"the {t.method} tree has {spec.leaves} leaf per prompt; group-relative advantages "
        "need at least 2 (raise tree.group_size, tree.k or tree.num_trees).",
    )
    _check_tree_fields(t)  # what the method in use does not read, after its own tree's checks

    _check_advantage(config.advantage, spec.num_steps)
    sentence = methods.get(t.method).check_node_rewards(config, spec)
    require(sentence is None, sentence)
    _check_train(config.train)
    _check_accumulation_applies(config)
    rewards = _check_rewards(config, known_rewards)
    _check_lora(config.lora)
    _check_reward_options(config.reward_options)
    _check_outputs(config)
    return rewards


def _check_accumulation_applies(config) -> None:
    """An update that gathers more minibatches than the whole run trains would never apply."""
    tr = config.train
    if tr.grad_accumulation <= 1:
        return
    from tree_grpo_jax import methods  # as in `validate`: only where a check needs it
    from tree_grpo_jax.core.transitions import num_minibatches

    rows = methods.get(config.tree.method).training_counts(config)["train_rows"]
    minibatches = num_minibatches(rows * config.prompts.batch_size, tr.rows_per_minibatch)
    per_iteration = minibatches * tr.inner_epochs
    in_all = per_iteration * tr.iterations
    require(
        tr.grad_accumulation <= in_all,
        f"train.grad_accumulation={tr.grad_accumulation} gathers that many minibatches per "
        f"update, but the whole run trains {in_all} ({per_iteration} per iteration x "
        f"{tr.iterations} iterations): no update would ever apply; lower it, or raise "
        "train.iterations.",
    )


def _check_unused_sections(config) -> None:
    """A field changed in another objective's section would be dropped without a word (GRPO-
    Guard switched on for an awm run, say): it is refused, naming the methods it applies to."""
    from tree_grpo_jax import methods

    for section, objective in methods.other_sections(config.tree.method).items():
        defaults = flatten(objective.options(), f"{section}.", leaves_only=True)
        given = flatten(config[section], f"{section}.", leaves_only=True)
        changed = [path for path, value in given.items() if defaults.get(path) != value]
        if changed:
            users = ", ".join(methods.methods_of(objective))
            raise ConfigError(
                f"{changed[0]} is set, but the {section} section applies only to "
                f"tree.method {users}; this run's tree.method is {config.tree.method} "
                f"(leave {section} at its defaults, or change the method)."
            )


def _check_model(m) -> None:
    """The model section, and every registered family's own (the run's family's first)."""
    try:
        family = model_registry.family_of(m.name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    require(
        not family.needs_path or bool(m.path),
        f"model.name {m.name!r} needs model.path: set --config.model.path to {family.path_hint}.",
    )
    for other in sorted(model_registry.families(), key=lambda f: f is not family):
        if other.check_options is not None:  # every family's section, the run's first
            sentence = other.check_options(model_registry.options_of(other, m))
            require(sentence is None, sentence)
    dtypes = tuple(DTYPES)
    for field in ("param_dtype", "compute_dtype"):
        require(m[field] in dtypes, f"model.{field} must be one of {dtypes}, got {m[field]!r}.")
    remat = m.get("remat", False)
    require(
        isinstance(remat, bool) or remat in REMAT_MODES,
        f"model.remat must be True, False or one of {', '.join(REMAT_MODES)}, e.g. "
        f"--config.model.remat=block; got {describe(remat)}.",
    )
    chosen = m.get("attention", "xla")
    require(
        chosen in attention.BACKENDS,
        f"model.attention must be one of {', '.join(attention.BACKENDS)}, got {chosen!r}.",
    )


def _check_prompts(p) -> None:
    require(bool(p.source), "prompts.source must name a prompt set or file.")
    require(p.batch_size >= 1, "prompts.batch_size must be at least 1.")
    require(p.eval_count >= 1, "prompts.eval_count must be at least 1.")
    field, category = p.get("field", ""), p.get("category_field", "")
    require(
        not field or field != category,
        f"prompts.field and prompts.category_field both name {field!r}; a column is either "
        "the prompt or its category.",
    )


MAX_GUIDANCE_SCALE = 100.0


def _check_sampling(s) -> None:
    require(s.num_steps >= 2, f"sampling.num_steps must be at least 2, got {s.num_steps}.")
    require(
        0 < s.eta <= 1,
        f"sampling.eta must be in (0, 1] (DDIM's stochasticity; 1 is DDPM-like), got {s.eta}.",
    )
    require(s.noise_level > 0, f"sampling.noise_level must be positive, got {s.noise_level}.")
    flow_sde = s.get("flow_sde", "flow_grpo")
    require(
        flow_sde in FLOW_SDES,
        f"sampling.flow_sde must be one of {FLOW_SDES}, got {flow_sde!r}.",
    )
    require(s.shift > 0, f"sampling.shift (the flow sigma shift) must be positive, got {s.shift}.")
    # Classifier-free guidance is used at 1-10 (SD1.5 7.5, FLUX 3.5); far beyond, the
    # guided prediction overflows and the run diverges for no reason the loss can show.
    require(
        0 <= s.guidance_scale <= MAX_GUIDANCE_SCALE,
        f"sampling.guidance_scale must be in [0, {MAX_GUIDANCE_SCALE:g}], got {s.guidance_scale}.",
    )
    require(
        s.log_prob_reduce in ("mean", "sum"),
        f"sampling.log_prob_reduce must be 'mean' or 'sum', got {s.log_prob_reduce!r}.",
    )
    rows = s.get("denoise_rows", 0)
    require(
        isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0,
        f"sampling.denoise_rows must be a whole number >= 0 (0: every row at once), got {rows!r}.",
    )


def _check_advantage(a, num_steps: int) -> None:
    require(a.clip > 0, f"advantage.clip must be positive, got {a.clip}.")
    require(a.std_ddof in (0, 1), f"advantage.std_ddof must be 0 or 1, got {a.std_ddof}.")
    require(
        a.edge_normalization in adv.EDGE_NORMALIZATIONS,
        f"advantage.edge_normalization must be one of {adv.EDGE_NORMALIZATIONS}, "
        f"got {a.edge_normalization!r}.",
    )
    require(
        a.branch_normalization in adv.BRANCH_NORMALIZATIONS,
        f"advantage.branch_normalization must be one of {adv.BRANCH_NORMALIZATIONS}, "
        f"got {a.branch_normalization!r}.",
    )
    require(
        a.pruning_step_ratio >= 0,
        f"advantage.pruning_step_ratio must be >= 0, got {a.pruning_step_ratio}.",
    )
    require(
        a.depth_pruning_count_from in (0, 1),
        f"advantage.depth_pruning_count_from must be 0 or 1, got {a.depth_pruning_count_from}.",
    )
    _check_depth_pruning(a, num_steps)
    require(
        a.fusion in adv.FUSIONS, f"advantage.fusion must be one of {adv.FUSIONS}, got {a.fusion!r}."
    )
    require(
        a.fusion_alpha > 0,
        f"advantage.fusion_alpha (a softmax temperature) must be positive, got {a.fusion_alpha}.",
    )
    require(
        a.width_pruning in WIDTH_PRUNING,
        f"advantage.width_pruning must be one of {WIDTH_PRUNING}, got {a.width_pruning!r}.",
    )
    require(0 < a.width_pruning_ratio <= 1, "advantage.width_pruning_ratio must be in (0, 1].")
    _check_node_options(a)
    require(
        a.tracker_min_count >= 1 and a.tracker_buffer >= a.tracker_min_count,
        "advantage.tracker_buffer must be at least advantage.tracker_min_count (>= 1).",
    )


def _check_node_options(a) -> None:
    require(
        a.node_rewards in adv.NODE_REWARDS,
        f"advantage.node_rewards must be one of {adv.NODE_REWARDS}, got {a.node_rewards!r}.",
    )
    require(0 <= a.node_mix <= 1, f"advantage.node_mix must be in [0, 1], got {a.node_mix}.")
    mix = shared_default("advantage.node_mix")
    require(  # as node pruning, it acts only with node rewards on: never dropped silently
        a.node_rewards != "none" or a.node_mix == mix,
        f"advantage.node_mix={a.node_mix:g} shares an edge's credit between its node-reward "
        "gain and the leaf credit, but node rewards are off: set advantage.node_rewards, or "
        f"leave node_mix at {mix:g}.",
    )
    require(
        a.node_pruning in pruning.NODE_PRUNINGS,
        f"advantage.node_pruning must be one of {pruning.NODE_PRUNINGS}, got {a.node_pruning!r}.",
    )
    require(
        0 < a.node_pruning_threshold < 1,
        "advantage.node_pruning_threshold must be in (0, 1) (standard deviations from the "
        f"level's mean; at 1 or more every node could go), got {a.node_pruning_threshold}.",
    )
    require(
        0 < a.node_pruning_quantile < 1,
        f"advantage.node_pruning_quantile must be in (0, 1), got {a.node_pruning_quantile}.",
    )
    require(
        0 < a.node_pruning_keep <= 1,
        f"advantage.node_pruning_keep must be in (0, 1], got {a.node_pruning_keep}.",
    )


def _check_train(tr) -> None:
    require(tr.iterations >= 1, f"train.iterations must be at least 1, got {tr.iterations}.")
    require(
        tr.learning_rate > 0 and math.isfinite(tr.learning_rate),
        f"train.learning_rate must be a positive number, got {tr.learning_rate}.",
    )
    require(tr.lr_schedule in LR_SCHEDULES, f"train.lr_schedule must be one of {LR_SCHEDULES}.")
    require(
        tr.warmup_iterations >= 0,
        f"train.warmup_iterations must be >= 0 (0: no warmup), got {tr.warmup_iterations}.",
    )
    _check_adam(tr)
    require(tr.inner_epochs >= 1, "train.inner_epochs must be at least 1.")
    require(tr.rows_per_minibatch >= 1, "train.rows_per_minibatch must be at least 1.")
    require(tr.grad_accumulation >= 1, "train.grad_accumulation must be at least 1.")
    require(
        tr.get("updates_per_iteration", 0) >= 0,
        "train.updates_per_iteration must be 0 (off) or a number of updates per iteration.",
    )
    require(
        not (tr.get("updates_per_iteration", 0) and tr.grad_accumulation > 1),
        "set train.updates_per_iteration or train.grad_accumulation, not both: each decides "
        "how many minibatches an update spans.",
    )
    require(tr.clip_range > 0, f"train.clip_range must be positive, got {tr.clip_range}.")
    require(
        tr.get("replay", 0) >= 0,
        f"train.replay must be 0 (off) or a number of past iterations, got {tr.get('replay')}.",
    )
    require(
        tr.get("replay_correction", "clip") in REPLAY_CORRECTIONS,
        f"train.replay_correction must be one of {REPLAY_CORRECTIONS}, got "
        f"{tr.get('replay_correction')!r}.",
    )
    require(
        tr.get("replay_weight_max", 1.0) > 0,
        f"train.replay_weight_max must be positive, got {tr.get('replay_weight_max')}.",
    )
    require(tr.kl_beta >= 0, f"train.kl_beta must be >= 0, got {tr.kl_beta}.")
    require(tr.max_grad_norm > 0, "train.max_grad_norm must be positive.")


def _check_rewards(config, known_rewards) -> dict[str, float]:
    """The reward string and eval.extra_rewards name known rewards, each with its folder and
    valid settings; returns the parsed weights."""
    rewards = parse_rewards(config.rewards)
    for name, weight in rewards.items():
        require(
            not known_rewards or name in known_rewards or reward_registry.split_name(name),
            f"unknown reward {name!r}; known rewards: {', '.join(sorted(known_rewards))}.",
        )
        require(math.isfinite(weight), f"reward weight for {name!r} must be finite.")
    for name in config.eval.extra_rewards:
        require(
            not known_rewards or name in known_rewards or reward_registry.split_name(name),
            f"unknown eval.extra_rewards entry {name!r}; known rewards: "
            f"{', '.join(sorted(known_rewards))}.",
        )
    used = (*rewards, *config.eval.extra_rewards)
    for name in used:
        if name in reward_registry.available_rewards():
            sentence = reward_registry.missing_weights(name, config.reward_models.get(name))
            require(sentence is None, sentence)
    for name in sorted(reward_registry.available_rewards(), key=lambda n: n not in used):
        sentence = reward_registry.check_options(name, config.reward_options)  # the used first
        require(sentence is None, sentence)
    sentence = reward_registry.check_instances(used, config.reward_options)  # remote:<name>
    require(sentence is None, sentence)
    return rewards


def _check_lora(lo) -> None:
    require(lo.rank >= 0, f"lora.rank must be >= 0 (0: full fine-tuning), got {lo.rank}.")
    require(
        lo.alpha >= 0 and math.isfinite(lo.alpha),
        f"lora.alpha must be >= 0 (0: alpha = rank), got {lo.alpha}.",
    )
    require(
        all(isinstance(t, str) and t for t in lo.targets),
        f"lora.targets must be module names, got {tuple(lo.targets)!r}.",
    )


def _check_reward_options(opts) -> None:
    """The settings shared by the rewards that read a model."""
    require(
        opts.dtype in DTYPES,
        f"reward_options.dtype must be one of {tuple(DTYPES)}, got {opts.dtype!r}.",
    )
    require(opts.chunk_size >= 1, "reward_options.chunk_size must be at least 1.")
    require(
        opts.decode_chunks >= 1,
        f"reward_options.decode_chunks must be at least 1 (1: decode all, then score), got "
        f"{opts.decode_chunks}.",
    )


def _check_outputs(config) -> None:
    """Evaluation, checkpoints, the device mesh and logging."""
    require(config.eval.every >= 0, "eval.every must be >= 0.")
    _check_eval(config.eval)
    require(config.checkpoint.every >= 0, "checkpoint.every must be >= 0.")
    require(config.checkpoint.keep >= 1, "checkpoint.keep must be at least 1.")
    _check_mesh(config.mesh)
    require(
        not config.log.wandb_project or importlib.util.find_spec("wandb") is not None,
        f"log.wandb_project is {config.log.wandb_project!r} but wandb is not installed; "
        "pip install wandb, or leave log.wandb_project empty.",
    )


def _check_seed(field: str, seed) -> None:
    require(
        is_int(seed) and 0 <= seed < SEED_LIMIT,
        f"{field} must be a whole number in [0, 2**32) (what jax.random.PRNGKey keeps), "
        f"got {seed!r}.",
    )


def _check_tree_fields(t) -> None:
    """The tree fields, whichever method reads them (its own tree was built already)."""
    require(t.group_size >= 1, f"tree.group_size must be at least 1, got {t.group_size}.")
    require(t.window >= 1, f"tree.window must hold at least 1 step, got {t.window}.")
    require(t.window_start >= 0, f"tree.window_start must be >= 0, got {t.window_start}.")
    require(t.k >= 2, f"tree.k (children per branch) must be at least 2, got {t.k}.")
    require(t.num_trees >= 1, f"tree.num_trees must be at least 1, got {t.num_trees}.")
    require(
        all(step >= 0 for step in t.split_steps),
        f"tree.split_steps must be step indices >= 0, got {tuple(t.split_steps)}.",
    )
    require(
        t.split_noise_scale > 0,
        f"tree.split_noise_scale must be positive, got {t.split_noise_scale}.",
    )


def _check_depth_pruning(a, num_steps: int) -> None:
    """Depth d is the node made by step d - 1 (pruning.py), so depths run 1..num_steps."""
    bad = [d for d in a.depth_pruning if not 1 <= d <= num_steps]
    require(
        not bad,
        f"advantage.depth_pruning holds depth(s) {bad} outside 1..{num_steps}: depth d is the "
        f"node made by step d - 1 of the {num_steps} steps.",
    )
    require(
        a.depth_pruning_slide_every >= 0,
        "advantage.depth_pruning_slide_every must be 0 (no slide) or a number of iterations, "
        f"got {a.depth_pruning_slide_every}.",
    )
    stop = a.depth_pruning_stop
    require(
        stop == -1 or 0 <= stop <= num_steps,
        f"advantage.depth_pruning_stop must be -1 (the last split step) or a depth in "
        f"0..{num_steps}, got {stop}.",
    )


def _check_adam(tr) -> None:
    for field in ("adam_b1", "adam_b2"):
        require(0 <= tr[field] < 1, f"train.{field} must be in [0, 1), got {tr[field]}.")
    require(tr.adam_eps > 0, f"train.adam_eps must be positive, got {tr.adam_eps}.")
    require(tr.weight_decay >= 0, f"train.weight_decay must be >= 0, got {tr.weight_decay}.")
    state_dtype = tr.get("optimizer_state_dtype", "float32")
    require(
        state_dtype in OPTIMIZER_STATE_DTYPES,
        f"train.optimizer_state_dtype must be one of {', '.join(OPTIMIZER_STATE_DTYPES)} (the "
        f"dtype Adam's two moments are kept in), got {describe(state_dtype)}.",
    )


def _check_mesh(mesh) -> None:
    for field in ("data", "fsdp"):
        require(
            mesh[field] == -1 or mesh[field] >= 1,
            f"mesh.{field} must be -1 (every remaining device) or at least 1, got {mesh[field]}.",
        )
    require(
        not (mesh.data == -1 and mesh.fsdp == -1), "only one of mesh.data and mesh.fsdp may be -1."
    )


GUARD_ACTIONS = ("stop", "warn")


def guard_on(config) -> bool:
    """Whether any test of `eval.guard` is switched on."""
    g = config.eval.get("guard")
    return g is not None and (g.min_diversity_fraction > 0 or g.held_out_drop > 0)


def _check_eval(e) -> None:
    _check_seed("eval.seed", e.seed)
    require(
        e.num_steps == 0 or e.num_steps >= 2,
        f"eval.num_steps must be 0 (the training steps) or at least 2, got {e.num_steps}.",
    )
    k = e.get("samples_per_prompt", 1)
    require(
        isinstance(k, int) and not isinstance(k, bool) and k >= 1,
        f"eval.samples_per_prompt must be a whole number >= 1, got {k!r}.",
    )
    require(isinstance(e.get("kl", False), bool), f"eval.kl must be True or False, got {e.kl!r}.")
    g = e.get("guard")
    if g is None:
        return
    fraction = g.min_diversity_fraction
    require(
        is_number(fraction) and 0 <= fraction < 1,
        f"eval.guard.min_diversity_fraction must be in [0, 1) (0: off), got {fraction!r}.",
    )
    require(
        is_number(g.held_out_drop) and g.held_out_drop >= 0,
        f"eval.guard.held_out_drop must be a number >= 0 (0: off), got {g.held_out_drop!r}.",
    )
    require(
        g.held_out_drop == 0 or len(e.extra_rewards) > 0,
        "eval.guard.held_out_drop needs held-out metrics: name them in eval.extra_rewards.",
    )
    require(
        g.action in GUARD_ACTIONS,
        f"eval.guard.action must be one of {GUARD_ACTIONS}, got {g.action!r}.",
    )
