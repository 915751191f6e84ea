"""The checks that turn a bad config value into one clear sentence before anything heavy
starts. The fields and their defaults are schema.py's; a config's shape and types are
shape.py's; the reward string's syntax is the rewards package's (`parse_rewards`)."""

from __future__ import annotations

import importlib.util
import math

import ml_collections

from tree_grpo_jax.config.schema import (  # noqa: F401 - re-exported
    GUARD_ACTIONS,
    LR_SCHEDULES,
    OPTIMIZER_STATE_DTYPES,
    SEED_LIMIT,
    WIDTH_PRUNING,
    flatten,
)
from tree_grpo_jax.config.shape import (
    check_ranges,
    check_shape,
    check_types,
    require,
    shared_default,
)
from tree_grpo_jax.core import tree_spec
from tree_grpo_jax.errors import ConfigError
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as reward_registry


def validate(config: ml_collections.ConfigDict, known_rewards=()) -> dict[str, float]:
    """Raises ConfigError with one sentence for the first bad value found; returns the
    parsed reward weights."""
    # The methods table (and the objectives' jax code) is needed only here: importing the
    # config package does not load it.
    from tree_grpo_jax import methods
    from tree_grpo_jax.methods import node_credit

    check_shape(config)
    check_types(config)
    check_ranges(config)  # each declared field within its range or choices
    require(
        bool(config.name) and "/" not in config.name,
        f"name must be a folder name without '/' (runs/<name>/<time>), got {config.name!r}.",
    )
    _check_model(config.model)
    _check_prompts(config.prompts)

    t = config.tree
    try:
        method = methods.get(t.method)
        spec = method.spec_at(config, 0)
    except methods.UnknownMethodError as e:
        raise ConfigError(str(e)) from e
    except tree_spec.SpecError as e:
        raise ConfigError(f"tree: {e}") from e
    for objective in methods.objectives():  # every objective's own rules, whichever is used
        sentence = objective.check_section(config)
        require(sentence is None, sentence)
    _check_unused_sections(config)
    objective = method.objective
    sentence = objective.check_run(config, spec)
    require(sentence is None, sentence)
    require(
        not config.train.replay or objective.replays_rows,
        f"train.replay trains past iterations' PPO transitions again, but {t.method} trains "
        f"through the {objective.name} objective, whose rows are not PPO transitions; set "
        "train.replay=0.",
    )
    if config.train.replay_correction == "truncated":
        tr = config.train
        require(
            tr.replay > 0,
            "train.replay_correction='truncated' corrects replayed rows; set train.replay=N.",
        )
        require(
            tr.updates_per_iteration == 1 and tr.inner_epochs == 1,
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
    _check_advantage(config.advantage, spec.num_steps)
    sentence = node_credit.check(method, config, spec)
    require(sentence is None, sentence)
    require(
        not (config.train.updates_per_iteration and config.train.grad_accumulation > 1),
        "set train.updates_per_iteration or train.grad_accumulation, not both: each decides "
        "how many minibatches an update spans.",
    )
    _check_accumulation_applies(config)
    rewards = _check_rewards(config, known_rewards)
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


def _check_sequence(config) -> None:
    """mesh.sequence > 1 splits tokens inside transformer blocks: a family without them
    (a UNet, the tiny models) has nothing to split."""
    sequence = config.mesh.get("sequence", 1)
    if sequence == 1:
        return
    try:
        family = model_registry.family_of(config.model.name)
    except ValueError:  # the model section's check names it
        return
    require(
        family.token_blocks,
        f"mesh.sequence={sequence} splits each sample's tokens over devices in the transformer "
        f"(DiT) families, and model.name={config.model.name!r} has no token blocks; set "
        "mesh.sequence=1.",
    )


def _check_prompts(p) -> None:
    require(bool(p.source), "prompts.source must name a prompt set or file.")
    field, category = p.field, p.category_field
    require(
        not field or field != category,
        f"prompts.field and prompts.category_field both name {field!r}; a column is either "
        "the prompt or its category.",
    )
    images = p.get("image_field", "")
    require(
        not images or images not in (field, category),
        f"prompts.image_field names {images!r} as prompts.field or prompts.category_field "
        "does; a column is the prompt, its category or its images.",
    )


def _check_advantage(a, num_steps: int) -> None:
    """The advantage rules that span fields, or the tree's steps."""
    _check_depth_pruning(a, num_steps)
    mix = shared_default("advantage.node_mix")
    require(  # as node pruning, it acts only with node rewards on: never dropped silently
        a.node_rewards != "none" or a.node_mix == mix,
        f"advantage.node_mix={a.node_mix:g} shares an edge's credit between its node-reward "
        "gain and the leaf credit, but node rewards are off: set advantage.node_rewards, or "
        f"leave node_mix at {mix:g}.",
    )
    require(
        a.tracker_buffer >= a.tracker_min_count,
        "advantage.tracker_buffer must be at least advantage.tracker_min_count (>= 1).",
    )


def _check_rewards(config, known_rewards) -> dict[str, float]:
    """The reward string and eval.extra_rewards name known rewards, each with its folder and
    valid settings; returns the parsed weights."""
    rewards = reward_registry.parse_rewards(config.rewards)
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


def _check_outputs(config) -> None:
    """Evaluation, checkpoints, the device mesh and logging."""
    e = config.eval
    require(
        e.guard.held_out_drop == 0 or len(e.extra_rewards) > 0,
        "eval.guard.held_out_drop needs held-out metrics: name them in eval.extra_rewards.",
    )
    require(
        not (config.mesh.data == -1 and config.mesh.fsdp == -1),
        "only one of mesh.data and mesh.fsdp may be -1.",
    )
    _check_sequence(config)
    require(
        not config.log.wandb_project or importlib.util.find_spec("wandb") is not None,
        f"log.wandb_project is {config.log.wandb_project!r} but wandb is not installed; "
        "pip install wandb, or leave log.wandb_project empty.",
    )


def _check_depth_pruning(a, num_steps: int) -> None:
    """Depth d is the node made by step d - 1 (pruning.py), so depths run 1..num_steps."""
    bad = [d for d in a.depth_pruning if not 1 <= d <= num_steps]
    require(
        not bad,
        f"advantage.depth_pruning holds depth(s) {bad} outside 1..{num_steps}: depth d is the "
        f"node made by step d - 1 of the {num_steps} steps.",
    )
    stop = a.depth_pruning_stop
    require(
        stop == -1 or 0 <= stop <= num_steps,
        f"advantage.depth_pruning_stop must be -1 (the last split step) or a depth in "
        f"0..{num_steps}, got {stop}.",
    )


def guard_on(config) -> bool:
    """Whether any test of `eval.guard` is switched on."""
    g = config.eval.guard
    return g.min_diversity_fraction > 0 or g.held_out_drop > 0
