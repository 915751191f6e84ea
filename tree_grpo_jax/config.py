"""The checks that turn a bad config value into one clear sentence before anything heavy
starts, and the reward string's syntax."""

from __future__ import annotations

import importlib.util
import json
import math

import ml_collections

from tree_grpo_jax import advantages as adv
from tree_grpo_jax import methods, pruning, rollout, tree_spec
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import DTYPES
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.sampling import FLOW_SDES

WIDTH_PRUNING = ("none", *pruning.WIDTH_MODES)
LR_SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
    """A config value that cannot work; the message is one sentence for the user."""


def parse_rewards(text: str) -> dict[str, float]:
    """`"a"` -> {a: 1.0}; `"a:1,b:0.1"` -> {a: 1.0, b: 0.1}."""
    weights = {}
    for part in str(text).split(","):
        name, _, weight = part.strip().partition(":")
        if not name:
            raise ConfigError(f"rewards {text!r} has an empty entry; write name[:weight],...")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(
                f"reward weight {weight!r} of {name!r} is not a number; write name:weight."
            ) from None
    return weights


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def moved_fields() -> dict[str, str]:
    """Config fields that moved into a model family's or a reward's own section
    (old path -> new path), from their records."""
    moved = reward_registry.moved_fields()
    for family in model_registry.families():
        moved.update(family.moved_fields)
    return moved


def _has_field(config, path: str) -> bool:
    node = config
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _check_moved(config) -> None:
    for old, new in moved_fields().items():
        _require(
            not _has_field(config, old),
            f"the config sets {old}, which moved to {new}; set that instead.",
        )


def validate(config: ml_collections.ConfigDict, known_rewards=()) -> dict[str, float]:
    """Raises ConfigError with one sentence for the first bad value found; returns the
    parsed reward weights."""
    m, s, t, a, tr = config.model, config.sampling, config.tree, config.advantage, config.train
    _check_moved(config)
    try:
        family = model_registry.family_of(m.name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _require(
        not family.needs_path or bool(m.path),
        f"model.name {m.name!r} needs model.path: set --config.model.path to {family.path_hint}.",
    )
    if family.check_options is not None:
        sentence = family.check_options(model_registry.options_of(family, m))
        _require(sentence is None, sentence)
    dtypes = tuple(DTYPES)
    for field in ("param_dtype", "compute_dtype"):
        _require(m[field] in dtypes, f"model.{field} must be one of {dtypes}, got {m[field]!r}.")

    _require(config.prompts.batch_size >= 1, "prompts.batch_size must be at least 1.")
    _require(config.prompts.eval_count >= 1, "prompts.eval_count must be at least 1.")

    _require(s.num_steps >= 2, f"sampling.num_steps must be at least 2, got {s.num_steps}.")
    _require(
        0 < s.eta <= 1,
        f"sampling.eta must be in (0, 1] (DDIM's stochasticity; 1 is DDPM-like), got {s.eta}.",
    )
    _require(s.noise_level > 0, f"sampling.noise_level must be positive, got {s.noise_level}.")
    flow_sde = s.get("flow_sde", "flow_grpo")
    _require(
        flow_sde in FLOW_SDES,
        f"sampling.flow_sde must be one of {FLOW_SDES}, got {flow_sde!r}.",
    )
    _require(
        s.guidance_scale >= 0, f"sampling.guidance_scale must be >= 0, got {s.guidance_scale}."
    )
    _require(
        s.log_prob_reduce in ("mean", "sum"),
        f"sampling.log_prob_reduce must be 'mean' or 'sum', got {s.log_prob_reduce!r}.",
    )

    _require(
        t.split_log_prob in rollout.SPLIT_LOG_PROBS,
        f"tree.split_log_prob must be one of {rollout.SPLIT_LOG_PROBS}, got {t.split_log_prob!r}.",
    )
    try:
        spec = methods.spec_at(config, 0)
        if t.window_slide_every < 0:
            raise ConfigError("tree.window_slide_every must be 0 (fixed) or positive.")
    except methods.UnknownMethodError as e:
        raise ConfigError(str(e)) from e
    except tree_spec.SpecError as e:
        raise ConfigError(f"tree: {e}") from e
    _require(spec.trainable_edges > 0, f"the {t.method} tree has no trainable step.")
    _require(
        spec.leaves >= 2,
        f"the {t.method} tree has {spec.leaves} leaf per prompt; group-relative advantages "
        "need at least 2 (raise tree.group_size, tree.k or tree.num_trees).",
    )

    _require(a.clip > 0, f"advantage.clip must be positive, got {a.clip}.")
    _require(a.std_ddof in (0, 1), f"advantage.std_ddof must be 0 or 1, got {a.std_ddof}.")
    _require(
        a.edge_normalization in adv.EDGE_NORMALIZATIONS,
        f"advantage.edge_normalization must be one of {adv.EDGE_NORMALIZATIONS}, "
        f"got {a.edge_normalization!r}.",
    )
    _require(
        a.branch_normalization in adv.BRANCH_NORMALIZATIONS,
        f"advantage.branch_normalization must be one of {adv.BRANCH_NORMALIZATIONS}, "
        f"got {a.branch_normalization!r}.",
    )
    _require(
        a.pruning_step_ratio >= 0,
        f"advantage.pruning_step_ratio must be >= 0, got {a.pruning_step_ratio}.",
    )
    _require(
        a.depth_pruning_count_from in (0, 1),
        f"advantage.depth_pruning_count_from must be 0 or 1, got {a.depth_pruning_count_from}.",
    )
    _require(
        a.fusion in adv.FUSIONS, f"advantage.fusion must be one of {adv.FUSIONS}, got {a.fusion!r}."
    )
    _require(
        a.width_pruning in WIDTH_PRUNING,
        f"advantage.width_pruning must be one of {WIDTH_PRUNING}, got {a.width_pruning!r}.",
    )
    _require(0 < a.width_pruning_ratio <= 1, "advantage.width_pruning_ratio must be in (0, 1].")
    _require(
        a.tracker_min_count >= 1 and a.tracker_buffer >= a.tracker_min_count,
        "advantage.tracker_buffer must be at least advantage.tracker_min_count (>= 1).",
    )

    _require(tr.iterations >= 1, f"train.iterations must be at least 1, got {tr.iterations}.")
    _require(
        tr.learning_rate > 0 and math.isfinite(tr.learning_rate),
        f"train.learning_rate must be a positive number, got {tr.learning_rate}.",
    )
    _require(tr.lr_schedule in LR_SCHEDULES, f"train.lr_schedule must be one of {LR_SCHEDULES}.")
    _require(tr.inner_epochs >= 1, "train.inner_epochs must be at least 1.")
    _require(tr.rows_per_minibatch >= 1, "train.rows_per_minibatch must be at least 1.")
    _require(tr.grad_accumulation >= 1, "train.grad_accumulation must be at least 1.")
    _require(
        tr.get("updates_per_iteration", 0) >= 0,
        "train.updates_per_iteration must be 0 (off) or a number of updates per iteration.",
    )
    _require(
        not (tr.get("updates_per_iteration", 0) and tr.grad_accumulation > 1),
        "set train.updates_per_iteration or train.grad_accumulation, not both: each decides "
        "how many minibatches an update spans.",
    )
    _require(tr.clip_range > 0, f"train.clip_range must be positive, got {tr.clip_range}.")
    _require(tr.kl_beta >= 0, f"train.kl_beta must be >= 0, got {tr.kl_beta}.")
    _require(tr.max_grad_norm > 0, "train.max_grad_norm must be positive.")

    rewards = parse_rewards(config.rewards)
    for name, weight in rewards.items():
        _require(
            not known_rewards or name in known_rewards,
            f"unknown reward {name!r}; known rewards: {', '.join(sorted(known_rewards))}.",
        )
        _require(math.isfinite(weight), f"reward weight for {name!r} must be finite.")
    for name in config.eval.extra_rewards:
        _require(
            not known_rewards or name in known_rewards,
            f"unknown eval.extra_rewards entry {name!r}; known rewards: "
            f"{', '.join(sorted(known_rewards))}.",
        )
    for name in (*rewards, *config.eval.extra_rewards):
        if name in reward_registry.available_rewards():
            sentence = reward_registry.missing_weights(name, config.reward_models.get(name))
            _require(sentence is None, sentence)
            sentence = reward_registry.check_options(name, config.reward_options)
            _require(sentence is None, sentence)
    lo = config.lora
    _require(lo.rank >= 0, f"lora.rank must be >= 0 (0: full fine-tuning), got {lo.rank}.")
    _require(
        lo.alpha >= 0 and math.isfinite(lo.alpha),
        f"lora.alpha must be >= 0 (0: alpha = rank), got {lo.alpha}.",
    )
    _require(
        all(isinstance(t, str) and t for t in lo.targets),
        f"lora.targets must be module names, got {tuple(lo.targets)!r}.",
    )
    opts = config.reward_options
    _require(
        opts.dtype in DTYPES,
        f"reward_options.dtype must be one of {tuple(DTYPES)}, got {opts.dtype!r}.",
    )
    _require(opts.chunk_size >= 1, "reward_options.chunk_size must be at least 1.")
    _require(config.eval.every >= 0, "eval.every must be >= 0.")
    _check_eval(config.eval)
    _require(config.checkpoint.every >= 0, "checkpoint.every must be >= 0.")
    _require(config.checkpoint.keep >= 1, "checkpoint.keep must be at least 1.")
    _require(
        not config.log.wandb_project or importlib.util.find_spec("wandb") is not None,
        f"log.wandb_project is {config.log.wandb_project!r} but wandb is not installed; "
        "pip install wandb, or leave log.wandb_project empty.",
    )
    return rewards


GUARD_ACTIONS = ("stop", "warn")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def guard_on(config) -> bool:
    """Whether any test of `eval.guard` is switched on."""
    g = config.eval.get("guard")
    return g is not None and (g.min_diversity_fraction > 0 or g.held_out_drop > 0)


def _check_eval(e) -> None:
    k = e.get("samples_per_prompt", 1)
    _require(
        isinstance(k, int) and not isinstance(k, bool) and k >= 1,
        f"eval.samples_per_prompt must be a whole number >= 1, got {k!r}.",
    )
    _require(isinstance(e.get("kl", False), bool), f"eval.kl must be True or False, got {e.kl!r}.")
    g = e.get("guard")
    if g is None:
        return
    fraction = g.min_diversity_fraction
    _require(
        _is_number(fraction) and 0 <= fraction < 1,
        f"eval.guard.min_diversity_fraction must be in [0, 1) (0: off), got {fraction!r}.",
    )
    _require(
        _is_number(g.held_out_drop) and g.held_out_drop >= 0,
        f"eval.guard.held_out_drop must be a number >= 0 (0: off), got {g.held_out_drop!r}.",
    )
    _require(
        g.held_out_drop == 0 or len(e.extra_rewards) > 0,
        "eval.guard.held_out_drop needs held-out metrics: name them in eval.extra_rewards.",
    )
    _require(
        g.action in GUARD_ACTIONS,
        f"eval.guard.action must be one of {GUARD_ACTIONS}, got {g.action!r}.",
    )


# Fields a resumed run may change: they decide how long it runs and what it reports, not
# what any finished iteration computed.
RESUME_MAY_CHANGE = (
    "name",
    "train.iterations",
    "model.remat",
    "model.compute_dtype",
    "prompts.eval_source",
    "prompts.eval_count",
    "eval.",
    "checkpoint.",
    "log.",
    "mesh.",
    "compile_cache.",
    "reward_models.",  # where the same reward weights live now
    "reward_options.chunk_size",
)


def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """Every setting a resume must keep, flat (`section.field` -> JSON value)."""

    def flat(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, ml_collections.ConfigDict):
                yield from flat(value, f"{path}.")
            elif not any(
                path == k or (k.endswith(".") and path.startswith(k)) for k in RESUME_MAY_CHANGE
            ):
                yield path, json.loads(json.dumps(value, default=str))

    return dict(flat(config))
