"""A config of the wrong shape, a field of the wrong type and a value out of range are one
sentence each, raised by `config.validate` before anything starts; on the command line a
stray argument or a near-miss flag points at `--config.<field>`, `--print_config` lists the
fields, and nothing is written for a bad config."""

import json
import math
import os
import pathlib
import sys
import uuid

import jax
import ml_collections
import pytest

from configs import tiny
from tree_grpo_jax import config as cfg
from tree_grpo_jax.config import base_config
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as rewards
from tree_grpo_jax.run import fingerprint as run_fingerprint

ROOT = pathlib.Path(__file__).parents[2]
KNOWN = rewards.available_rewards()
NAN, INF = math.nan, math.inf


def with_values(config, **values) -> ml_collections.ConfigDict:
    """A copy of `config` with `section__field=value` set as given, whatever its type (a
    ConfigDict refuses a value of another type than the field's, so rebuild it)."""
    d = config.to_dict()
    for key, value in values.items():
        *parents, field = key.split("__")
        node = d
        for p in parents:
            node = node[p]
        node[field] = value
    return ml_collections.ConfigDict(d)


def sentence(config) -> str:
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(config, known_rewards=KNOWN)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_rebuilt_config_still_validates():
    c = tiny.get_config()
    assert cfg.validate(with_values(c), known_rewards=KNOWN) == rewards.parse_rewards(c.rewards)


# ---------------------------------------------------------------------------------------------
# Shape: a ConfigDict with every section and field of the schema, and no other.


def test_shipped_configs_add_no_field_to_the_base():
    """Why an unknown field is refused: no shipped config holds one."""
    fields = set(cfg.flatten(base_config()))
    for path in sorted((ROOT / "configs").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = __import__(f"configs.{path.stem}", fromlist=["get_config"])
        assert set(cfg.flatten(module.get_config())) == fields, path.stem


def test_a_plain_dict_is_one_sentence():
    message = sentence(tiny.get_config().to_dict())
    assert message.startswith("the config is a dict, not an ml_collections ConfigDict")


@pytest.mark.parametrize(
    "section, field, missing",
    [("train", "clip_range", "train.clip_range"), (None, "advantage", "advantage")],
)
def test_a_missing_field_or_section_is_named(section, field, missing):
    c = tiny.get_config()
    del (c[section] if section else c)[field]
    assert sentence(c) == (
        f"the config lacks {missing}; start it from tree_grpo_jax.config.base_config()."
    )
    with pytest.raises(cfg.ConfigError, match=f"^configs/x.py's get_config\\(\\) lacks {missing};"):
        cfg.check_shape(c, source="configs/x.py's get_config()")


@pytest.mark.parametrize(
    "path, suggestion",
    [("trian", "train"), ("train.clip_rnage", "train.clip_range"), ("eval.guard.actoin", None)],
)
def test_an_unknown_field_is_refused_with_a_suggestion(path, suggestion):
    c = tiny.get_config()
    section, _, field = path.rpartition(".")
    node = c
    for p in section.split(".") if section else ():
        node = node[p]
    node[field] = 3
    message = sentence(c)
    assert message.startswith(f"the config sets {path}, which is not a config field")
    if suggestion:
        assert message.endswith(f"did you mean {suggestion}?")


def test_a_moved_field_still_names_its_new_place():
    c = base_config()
    c.model.use_t5 = False
    assert "sets model.use_t5, which moved to model.sd3.use_t5" in sentence(c)


def test_a_registered_family_may_add_its_section():
    family = model_registry.register(
        model_registry.ModelFamily(
            name="checks_toy",
            model_names=("checks_toy",),
            load=lambda request: None,
            options=lambda: ml_collections.ConfigDict({"width": 3}),
        )
    )
    try:
        c = tiny.get_config()
        c.model[family.name] = ml_collections.ConfigDict({"width": 4})
        cfg.validate(c, known_rewards=KNOWN)
        c.model[family.name].widht = 4
        assert sentence(c).endswith("did you mean model.checks_toy.width?")
        c = with_values(tiny.get_config(), model__checks_toy={"width": "4"})
        assert sentence(c).startswith("model.checks_toy.width must be a whole number")
    finally:
        model_registry.unregister(family.name)


def test_the_schema_needs_no_configs_folder(monkeypatch):
    """The package holds the schema: with no `configs` importable, the shape is still checked."""
    monkeypatch.setitem(sys.modules, "configs", None)
    assert cfg.base_config().model.name == "tiny"
    c = tiny.get_config()
    c.trian = 3
    assert sentence(c).startswith("the config sets trian, which is not a config field")


def test_a_registered_section_may_be_left_out_but_not_mistyped():
    """A family's or a reward's own section is its record's: a config without it runs at the
    record's defaults, one that holds it is checked field by field."""
    c = tiny.get_config()
    del c.model["sd3"]
    del c.reward_options["pickscore"]
    del c.reward_models["hpsv2"]
    cfg.validate(c, known_rewards=KNOWN)
    c.model.sd3 = ml_collections.ConfigDict({"use_t5": "yes"})
    assert sentence(c).startswith("model.sd3.use_t5 must be True or False")
    c.model.sd3 = ml_collections.ConfigDict({"use_t6": True})
    assert sentence(c).endswith("did you mean model.sd3.use_t5?")


# ---------------------------------------------------------------------------------------------
# Types: each field has its default's type.


def test_every_tuple_field_has_an_element_type():
    for path, default in cfg.flatten(base_config()).items():
        if isinstance(default, tuple):
            kind, _ = cfg.tuple_fields()[path]
            assert all(type(v) is kind for v in default), path


TYPE_CASES = [
    (
        {"tree__split_steps": "0,3"},
        "tree.split_steps must be a tuple of ints, e.g. --config.tree.split_steps='(0,3,6,9)'; "
        "got the string '0,3'.",
    ),
    (
        {"eval__extra_rewards": "digit_accuracy"},
        "eval.extra_rewards must be a tuple of strings, e.g. --config.eval.extra_rewards="
        "\"('digit_accuracy','clip_score')\"; got the string 'digit_accuracy'.",
    ),
    ({"lora__targets": "to_q"}, "lora.targets must be a tuple of strings"),
    (  # the example is the one the family's record declares
        {"model__wan__resolution": 480},
        "model.wan.resolution must be a tuple of ints, e.g. "
        "--config.model.wan.resolution='(480,832)'; got 480.",
    ),
    ({"advantage__depth_pruning": 3}, "advantage.depth_pruning must be a tuple of ints"),
    ({"advantage__depth_pruning": (2.5,)}, "got (2.5,)"),
    ({"advantage__depth_pruning": (True,)}, "advantage.depth_pruning must be a tuple of ints"),
    ({"eval__extra_rewards": ("digit_accuracy,clip_score",)}, "holds a comma; quote each entry"),
    (
        {"model__remat": 1},
        "model.remat must be True, False or one of none, block, block_save_attention, e.g. "
        "--config.model.remat=block; got 1.",
    ),
    ({"model__remat": "blocks"}, "model.remat must be True, False or one of none, block"),
    ({"model__scan_layers": "yes"}, "model.scan_layers must be True or False"),
    (
        {"model__attention": "flash"},
        "model.attention must be one of xla, blockwise, cudnn, pallas, auto, got 'flash'.",
    ),
    ({"train__iterations": True}, "train.iterations must be a whole number"),
    ({"train__iterations": 2.5}, "train.iterations must be a whole number"),
    ({"train__learning_rate": "1e-4"}, "train.learning_rate must be a finite number"),
    ({"rewards": 3}, "rewards must be a string, e.g. --config.rewards=digit_alignment"),
    ({"seed": "0"}, "seed must be a whole number"),
    ({"train": 3}, "train must be a section"),
]


@pytest.mark.parametrize("values, message", TYPE_CASES, ids=[m[:40] for _, m in TYPE_CASES])
def test_a_wrong_type_is_one_sentence(values, message):
    assert message in sentence(with_values(tiny.get_config(), **values))


@pytest.mark.parametrize("remat", [True, False, "none", "block", "block_save_attention"])
def test_remat_takes_old_booleans_and_policy_names(remat):
    cfg.validate(with_values(tiny.get_config(), model__remat=remat), known_rewards=KNOWN)


def test_lists_for_tuples_and_ints_for_floats_pass():
    c = with_values(
        tiny.get_config(),
        tree__method="branchgrpo",
        tree__split_steps=[0, 3],
        eval__extra_rewards=["digit_accuracy"],
        train__learning_rate=1,
        advantage__clip=5,
    )
    cfg.validate(c, known_rewards=KNOWN)


# ---------------------------------------------------------------------------------------------
# Ranges: every number of the schema.


RANGE_CASES = [
    ("seed", 2**70, "seed must be in [0, 2**32) (what jax.random.PRNGKey keeps)"),
    ("seed", 2**32, "seed must be in [0, 2**32) (what jax.random.PRNGKey keeps)"),
    ("seed", -1, "seed must be in [0, 2**32) (what jax.random.PRNGKey keeps)"),
    ("model.sd3.t5_max_length", 0, "model.sd3.t5_max_length must be at least 1"),
    ("model.sd3.sample_size", -1, "model.sd3.sample_size must be >= 0"),
    ("model.flux.guidance", -1.0, "model.flux.guidance must be >= 0"),
    ("model.flux.t5_max_length", 600, "model.flux.t5_max_length must be in [0, 512]"),
    ("model.flux.resolution", -1, "model.flux.resolution must be >= 0"),
    ("model.flux.reference_images", 2, "model.flux.reference_images must be in [0, 1]"),
    (
        "model.flux.reference_resolution",
        4096,
        "model.flux.reference_resolution must be in [0, 2048]",
    ),
    ("model.wan.num_frames", 0, "model.wan.num_frames must be a positive integer 4k + 1"),
    ("model.wan.num_frames", 80, "model.wan.num_frames must be 4k + 1"),
    ("model.wan.shift", -1.0, "model.wan.shift must be >= 0"),
    ("model.wan.t5_max_length", 0, "model.wan.t5_max_length must be in [1, 512]"),
    ("model.wan.decode_batch_size", 0, "model.wan.decode_batch_size must be at least 1"),
    ("model.flux.shift", -1.0, "model.flux.shift must be >= 0"),
    ("model.zimage.text_max_length", 0, "model.zimage.text_max_length must be at least 1"),
    ("model.zimage.resolution", -1, "model.zimage.resolution must be >= 0"),
    ("model.zimage.shift", -1.0, "model.zimage.shift must be >= 0"),
    ("model.qwenimage.text_max_length", 0, "model.qwenimage.text_max_length must be in [1, 1024]"),
    ("model.qwenimage.resolution", -1, "model.qwenimage.resolution must be >= 0"),
    ("model.qwenimage.shift", -1.0, "model.qwenimage.shift must be >= 0"),
    ("model.flux2.text_max_length", 0, "model.flux2.text_max_length must be at least 1"),
    ("model.flux2.guidance", -1.0, "model.flux2.guidance must be >= 0"),
    ("model.flux2.resolution", -1, "model.flux2.resolution must be >= 0"),
    ("model.flux2.shift", -1.0, "model.flux2.shift must be >= 0"),
    ("model.flux2.reference_images", -1, "model.flux2.reference_images must be >= 0"),
    (
        "model.flux2.reference_resolution",
        2048,
        "model.flux2.reference_resolution must be in [0, 1024]",
    ),
    ("prompts.batch_size", 0, "prompts.batch_size must be at least 1"),
    ("prompts.eval_count", 0, "prompts.eval_count must be at least 1"),
    ("sampling.num_steps", 1, "sampling.num_steps must be at least 2"),
    ("sampling.eta", 0.0, "sampling.eta must be in (0, 1]"),
    ("sampling.noise_level", NAN, "sampling.noise_level must be a finite number"),
    ("sampling.noise_level", 0.0, "sampling.noise_level must be positive"),
    ("sampling.shift", 0.0, "sampling.shift must be positive (the flow sigma shift)"),
    (
        "sampling.denoise_rows",
        -1,
        "sampling.denoise_rows must be >= 0 (0: every row at once), got -1.",
    ),
    ("sampling.guidance_scale", -1.0, "sampling.guidance_scale must be in [0, 100]"),
    ("sampling.guidance_scale", 1e30, "sampling.guidance_scale must be in [0, 100], got 1e+30"),
    ("tree.group_size", 0, "tree.group_size must be at least 1"),
    ("tree.window", 0, "tree.window must be at least 1, got 0."),
    ("tree.window_start", 8, "runs past the last step"),
    (
        "tree.window_slide_every",
        -1,
        "tree.window_slide_every must be 0 (fixed) or at least 1, got -1.",
    ),
    ("tree.k", 1, "tree.k must be at least 2 (children per branch), got 1."),
    ("tree.num_trees", 0, "num_trees must be at least 1"),
    ("tree.split_noise_scale", 0.0, "tree.split_noise_scale must be positive"),
    ("advantage.clip", INF, "advantage.clip must be a finite number"),
    ("advantage.clip", 0.0, "advantage.clip must be positive"),
    ("advantage.fusion_alpha", NAN, "advantage.fusion_alpha must be a finite number"),
    (
        "advantage.fusion_alpha",
        0.0,
        "advantage.fusion_alpha must be positive (a softmax temperature)",
    ),
    ("advantage.std_ddof", 2, "advantage.std_ddof must be 0 or 1"),
    ("advantage.node_mix", -0.1, "advantage.node_mix must be in [0, 1]"),
    ("advantage.node_pruning_threshold", 1.0, "advantage.node_pruning_threshold must be in (0, 1)"),
    ("advantage.node_pruning_quantile", 0.0, "advantage.node_pruning_quantile must be in (0, 1)"),
    ("advantage.node_pruning_keep", 0.0, "advantage.node_pruning_keep must be in (0, 1]"),
    ("advantage.tracker_buffer", 8, "advantage.tracker_buffer must be at least"),
    ("advantage.tracker_min_count", 0, "advantage.tracker_min_count must be at least 1"),
    ("advantage.depth_pruning", (0,), "advantage.depth_pruning holds depth(s) [0] outside 1..10"),
    ("advantage.depth_pruning", (3, 11), "holds depth(s) [11] outside 1..10"),
    ("advantage.depth_pruning_slide_every", -1, "advantage.depth_pruning_slide_every must be 0"),
    ("advantage.depth_pruning_stop", -2, "advantage.depth_pruning_stop must be -1"),
    ("advantage.depth_pruning_stop", 11, "advantage.depth_pruning_stop must be -1"),
    ("advantage.width_pruning_ratio", 0.0, "advantage.width_pruning_ratio must be in (0, 1]"),
    ("advantage.pruning_step_ratio", -0.5, "advantage.pruning_step_ratio must be >= 0"),
    ("advantage.depth_pruning_count_from", 2, "advantage.depth_pruning_count_from must be 0"),
    ("train.iterations", 0, "train.iterations must be at least 1"),
    ("train.learning_rate", 0.0, "train.learning_rate must be positive, got 0.0."),
    ("train.warmup_iterations", -1, "train.warmup_iterations must be >= 0"),
    ("train.weight_decay", -1e-4, "train.weight_decay must be >= 0"),
    ("train.weight_decay", NAN, "train.weight_decay must be a finite number"),
    ("train.adam_b1", 1.0, "train.adam_b1 must be in [0, 1)"),
    ("train.adam_b1", -0.1, "train.adam_b1 must be in [0, 1)"),
    ("train.adam_b1", NAN, "train.adam_b1 must be a finite number, e.g. --config.train.adam_b1"),
    ("train.adam_b2", 1.5, "train.adam_b2 must be in [0, 1)"),
    ("train.adam_eps", -1e-8, "train.adam_eps must be positive"),
    ("train.adam_eps", 0.0, "train.adam_eps must be positive"),
    ("train.adam_eps", NAN, "train.adam_eps must be a finite number"),
    ("train.max_grad_norm", 0.0, "train.max_grad_norm must be positive"),
    ("train.inner_epochs", 0, "train.inner_epochs must be at least 1"),
    ("train.rows_per_minibatch", 0, "train.rows_per_minibatch must be at least 1"),
    ("train.grad_accumulation", 0, "train.grad_accumulation must be at least 1"),
    ("train.updates_per_iteration", -1, "train.updates_per_iteration must be 0"),
    ("train.clip_range", 0.0, "train.clip_range must be positive"),
    ("train.kl_beta", -1.0, "train.kl_beta must be >= 0"),
    ("train.replay", -1, "train.replay must be 0 (off) or at least 1, got -1."),
    ("train.replay_weight_max", 0.0, "train.replay_weight_max must be positive"),
    ("diffusion_nft.beta", 0.0, "diffusion_nft.beta must be positive"),
    ("diffusion_nft.old_policy_flat", -1, "diffusion_nft.old_policy_flat must be >= 0"),
    ("diffusion_nft.old_policy_rate", -0.1, "diffusion_nft.old_policy_rate must be >= 0"),
    ("diffusion_nft.old_policy_max", 1.0, "diffusion_nft.old_policy_max must be in [0, 1)"),
    ("diffusion_nft.timestep_fraction", 0.0, "diffusion_nft.timestep_fraction must be in (0, 1]"),
    ("diffusion_nft.timestep_fraction", 1.5, "diffusion_nft.timestep_fraction must be in (0, 1]"),
    ("lora.rank", -1, "lora.rank must be >= 0"),
    ("lora.alpha", -1.0, "lora.alpha must be >= 0"),
    ("reward_options.chunk_size", 0, "reward_options.chunk_size must be at least 1"),
    ("reward_options.decode_chunks", 0, "reward_options.decode_chunks must be at least 1"),
    ("reward_options.pickscore.divisor", 0.0, "reward_options.pickscore.divisor must be positive"),
    ("eval.every", -1, "eval.every must be >= 0"),
    ("eval.seed", -5, "eval.seed must be in [0, 2**32) (what jax.random.PRNGKey keeps)"),
    ("eval.num_steps", -3, "eval.num_steps must be 0 (the training steps) or at least 2"),
    ("eval.num_steps", 1, "eval.num_steps must be 0 (the training steps) or at least 2"),
    ("eval.samples_per_prompt", 0, "eval.samples_per_prompt must be at least 1, got 0."),
    ("eval.guard.min_diversity_fraction", 1.0, "eval.guard.min_diversity_fraction must be in"),
    ("eval.guard.held_out_drop", -0.1, "eval.guard.held_out_drop must be >= 0 (0: off), got -0.1."),
    ("checkpoint.every", -1, "checkpoint.every must be >= 0"),
    ("checkpoint.keep", 0, "checkpoint.keep must be at least 1"),
    ("mesh.data", 0, "mesh.data must be -1 (every remaining device) or at least 1"),
    ("mesh.fsdp", -2, "mesh.fsdp must be -1 (every remaining device) or at least 1"),
    ("mesh.sequence", 0, "mesh.sequence must be at least 1"),
    # the 2026 methods' sections (checked whatever the method)
    ("awm.advantage_max", -1.0, "awm.advantage_max must be positive"),
    ("awm.ema_beta", -1.0, "awm.ema_beta must be >= 0"),
    ("awm.ema_decay_max", 1.0, "awm.ema_decay_max must be in [0, 1)"),
    ("awm.ema_decay_rate", -1.0, "awm.ema_decay_rate must be >= 0"),
    ("awm.ghuber_power", 0.0, "awm.ghuber_power must be positive"),
    ("awm.time_shift", -1.0, "awm.time_shift must be positive"),
    ("awm.timestep_fraction", 0.0, "awm.timestep_fraction must be in (0, 1]"),
    ("awm.train_timesteps", 0, "awm.train_timesteps must be at least 1"),
    ("dgpo.beta_dpo", 0.0, "dgpo.beta_dpo must be positive"),
    ("dgpo.clip_range", -1.0, "dgpo.clip_range must be positive"),
    ("dgpo.ema_decay_max", 1.0, "dgpo.ema_decay_max must be in [0, 1)"),
    ("dgpo.ema_decay_rate", -1.0, "dgpo.ema_decay_rate must be >= 0"),
    ("dgpo.switch_ema_ref", -1, "dgpo.switch_ema_ref must be >= 0"),
    ("dgpo.train_timesteps", 0, "dgpo.train_timesteps must be at least 1"),
    ("dgpo.trunc_steps", -1, "dgpo.trunc_steps must be >= 0"),
    ("dpo.beta", 0.0, "dpo.beta must be positive"),
    ("dpo.train_timesteps", 0, "dpo.train_timesteps must be at least 1"),
    ("dpo.timestep_range", 1.5, "dpo.timestep_range must be in (0, 1]"),
    ("dpo.logit_mean", float("inf"), "dpo.logit_mean must be a finite number"),
    ("dpo.logit_std", 0.0, "dpo.logit_std must be positive"),
    ("dpo.time_shift", -1.0, "dpo.time_shift must be positive"),
    ("crd.beta", 0.0, "crd.beta must be positive"),
    ("crd.weight_temp", float("nan"), "crd.weight_temp must be a finite number"),
    ("crd.train_timesteps", -1, "crd.train_timesteps must be >= 0"),
    ("crd.timestep_range", 0.0, "crd.timestep_range must be in (0, 1]"),
    ("crd.time_shift", 0.0, "crd.time_shift must be positive"),
    ("crd.kl_cfg", 0.5, "crd.kl_cfg must be at least 1"),
    ("crd.old_decay_start", -1, "crd.old_decay_start must be >= 0"),
    ("crd.old_decay_initial", 1.5, "crd.old_decay_initial must be in [0, 1]"),
    ("crd.old_decay_slope", -0.1, "crd.old_decay_slope must be >= 0"),
    ("crd.old_decay_max", -0.1, "crd.old_decay_max must be in [0, 1]"),
]
# Strings, checked against their choices (or as names) in their own tests or here.
NAME_CASES = [
    ("name", "", "name must be a folder name without '/'"),
    ("name", "a/b", "name must be a folder name without '/'"),
    ("prompts.source", "", "prompts.source must name a prompt set or file"),
    ("train.optimizer_state_dtype", "float16", "train.optimizer_state_dtype must be one of"),
    (
        "train.optimizer_state_dtype",
        "bf16",
        "float32, bfloat16 (the dtype Adam's two moments are kept in), got 'bf16'.",
    ),
    ("crd.loss_type", "l1", "crd.loss_type must be one of mse, bce"),
    ("crd.time_sampling", "sometimes", "crd.time_sampling must be one of discrete"),
]


@pytest.mark.parametrize(
    "path, value, message",
    RANGE_CASES + NAME_CASES,
    ids=[f"{p}={v}" for p, v, _ in RANGE_CASES + NAME_CASES],
)
def test_a_value_out_of_range_is_one_sentence(path, value, message):
    c = with_values(tiny.get_config(), **{path.replace(".", "__"): value})
    assert message in sentence(c)


def test_every_number_of_the_base_has_a_range_case():
    numbers = {
        path
        for path, v in cfg.flatten(base_config()).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    assert numbers <= {path for path, _, _ in RANGE_CASES}, numbers - {p for p, _, _ in RANGE_CASES}


@pytest.mark.parametrize(
    "values, message",
    [  # the fields a method does not read are checked too
        ({"tree__method": "grpo", "tree__k": 1}, "tree.k must be at least 2 (children per branch)"),
        ({"tree__method": "grpo", "tree__split_steps": (-1,)}, "tree.split_steps must be step"),
        ({"tree__method": "grpo", "tree__window_start": -1}, "tree.window_start must be >= 0"),
        ({"mesh__data": -1, "mesh__fsdp": -1}, "only one of mesh.data and mesh.fsdp may be -1"),
        (  # a family without transformer blocks has no tokens to split over devices
            {"mesh__sequence": 2},
            "mesh.sequence=2 splits each sample's tokens over devices in the transformer (DiT) "
            "families, and model.name='tiny' has no token blocks; set mesh.sequence=1.",
        ),
        (
            {"model__name": "sd", "model__path": "/models/sd15", "mesh__sequence": 4},
            "mesh.sequence=4 splits each sample's tokens over devices in the transformer (DiT) "
            "families, and model.name='sd' has no token blocks",
        ),
        (
            {"tree__method": "diffusion_nft", "sampling__guidance_scale": 4.5},
            "diffusion_nft samples and trains the conditional velocity without guidance",
        ),
        (
            {"tree__method": "diffusion_nft", "tree__group_size": 1},
            "the diffusion_nft tree has 1 leaf per prompt",
        ),
        (
            {"tree__method": "dpo", "model__name": "tiny_flow", "tree__group_size": 1},
            "tree.method=dpo pairs each prompt's best sample with its worst",
        ),
        (
            {"tree__method": "crd", "model__name": "tiny_flow", "tree__group_size": 1},
            "tree.method=crd centres rewards within each prompt's group",
        ),
    ],
)
def test_unused_fields_and_pairs(values, message):
    assert message in sentence(with_values(tiny.get_config(), **values))


def test_the_seed_bound_is_what_prng_key_keeps():
    """Without x64 PRNGKey keeps 32 bits: 2**32 would give seed 0's key again."""
    assert not jax.config.jax_enable_x64
    last = jax.random.PRNGKey(cfg.SEED_LIMIT - 1)
    assert (last != jax.random.PRNGKey(0)).any()
    assert (jax.random.PRNGKey(cfg.SEED_LIMIT) == jax.random.PRNGKey(0)).all()
    for field in ("seed", "eval__seed"):
        c = with_values(tiny.get_config(), **{field: cfg.SEED_LIMIT - 1})
        cfg.validate(c, known_rewards=KNOWN)


def test_depth_pruning_within_the_tree_passes():
    c = with_values(
        tiny.get_config(),
        tree__method="branchgrpo",
        advantage__depth_pruning=(1, 10),
        advantage__depth_pruning_stop=10,
    )
    cfg.validate(c, known_rewards=KNOWN)


# ---------------------------------------------------------------------------------------------
# The command line, in this process.


def run_in_process(*args):
    from in_process import run_in_process as run

    from tree_grpo_jax.cli import main as cli

    sys.modules.pop("config_config", None)  # config_flags' module of the last file loaded
    return run(cli, *args, prog="tree_grpo_jax.main")


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0].removeprefix("error: ")


CONFIG_FILES = {
    "returns_a_dict": "    return base_config().to_dict()\n",
    "calls_exit": "    import sys\n    sys.exit(0)\n",
    "lacks_a_field": "    c = base_config()\n    del c.train['clip_range']\n    return c\n",
    "lacks_a_section": "    c = base_config()\n    del c['advantage']\n    return c\n",
    "has_a_typo": "    c = base_config()\n    c.trian = 3\n    return c\n",
    "wrong_type": "    c = base_config()\n    c.tree.split_steps = '0,3'\n    return c\n",
}
FILE_MESSAGES = {
    "returns_a_dict": "get_config() returned a dict, not an ml_collections ConfigDict",
    "calls_exit": "called sys.exit(0) while loading",
    "lacks_a_field": "get_config() lacks train.clip_range; start it from tree_grpo_jax.config",
    "lacks_a_section": "get_config() lacks advantage; start it from tree_grpo_jax.config",
    "has_a_typo": "get_config() sets trian, which is not a config field; did you mean train?",
    "wrong_type": "could not be loaded (line 6): TypeError: Could not override field 'split_steps'",
}


@pytest.mark.parametrize("which", list(CONFIG_FILES))
def test_a_bad_config_file_is_one_sentence_and_writes_nothing(tmp_path, which):
    path = tmp_path / f"{which}.py"
    header = "from tree_grpo_jax.config import base_config\n\n\ndef get_config():\n"
    path.write_text(header + CONFIG_FILES[which])
    result = run_in_process(f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert FILE_MESSAGES[which] in one_error_line(result)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.iterations=3"], "stray argument 'train.iterations=3'; did you mean "
         "--config.train.iterations=3?"),
        (["--iterations=3"], "did you mean --config.train.iterations=3?"),
        (["--adam_b1=0.5"], "did you mean --config.train.adam_b1=0.5?"),
        (["--num_steps=4"], "--config.eval.num_steps=4 or --config.sampling.num_steps=4?"),
        (["--iteratons=3"], "did you mean --config.train.iterations=3?"),
        (["--workdri=x"], "Unknown command line flag 'workdri'. Did you mean: workdir?"),
        (["hello"], "stray argument 'hello': the command takes flags only"),
        (["--config.train.adam_b1=1.0"], "train.adam_b1 must be in [0, 1)"),
        (["--config.tree.split_steps=0,3", "--config.tree.method=branchgrpo",
          "--config.advantage.depth_pruning=11"], "advantage.depth_pruning holds depth(s) [11]"),
        # an option without its switch, as node_pruning without node rewards
        (["--config.advantage.node_mix=0.5"], "advantage.node_mix=0.5 shares an edge's credit "
         "between its node-reward gain and the leaf credit, but node rewards are off: set "
         "advantage.node_rewards, or leave node_mix at 1."),
    ],
)  # fmt: skip
def test_a_bad_command_line_is_one_sentence_and_writes_nothing(tmp_path, args, message):
    cache = tmp_path / "cache"
    result = run_in_process(
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        f"--config.compile_cache.dir={cache}",
        *args,
    )
    assert result.returncode == 2
    assert message in one_error_line(result)
    assert not (tmp_path / "run").exists() and not cache.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.tree.split_steps=(0,3)", "--config.tree.split_steps=(1,2)"],
         "--config.tree.split_steps is given twice (--config.tree.split_steps=(0,3) and "
         "--config.tree.split_steps=(1,2)); give each field once."),
        (["--config.train.iterations=3", "--noconfig.train.iterations"],
         "--config.train.iterations is given twice"),
        (["--noconfig.train.iterations"],
         "--noconfig.train.iterations has the wrong type for that field (an integer is expected)."),
        (["--config.log.tensorboard=False", "--config.log.tensorboard"],
         "--config.log.tensorboard is given twice"),
        (["--config.train.iterations"], "--config.train.iterations needs a value"),
        (["--config.log.tensorboard=maybe"], "(true or false is expected)."),
        (["--config.tree=3"], "--config.tree is a section of the config"),
        (["--config.tree.split_steps=a b,c"], "quote each entry"),
    ],
)  # fmt: skip
def test_an_override_is_given_once_and_typed_by_its_field(tmp_path, args, message):
    result = run_in_process("--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", *args)
    assert result.returncode == 2
    assert message in one_error_line(result)
    assert not (tmp_path / "run").exists()


def test_overrides_take_the_fields_types(tmp_path):
    """Each value is read as its field's type: an int for a float field, a bare bool flag,
    `--noconfig.` for False, a tuple literal and a bare word as a one-entry tuple, a value
    after a space."""
    result = run_in_process(
        "--config=configs/tiny.py",
        "--config.train.learning_rate=3",
        "--config.train.iterations=0x10",
        "--noconfig.log.tensorboard",
        "--config.log.progress",
        "--config.tree.split_steps=0,3",
        "--config.eval.extra_rewards=digit_accuracy",
        "--config.name=1e3",
        "--config.train.rows_per_minibatch",  # a value after a space, for a field no bool
        "8",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for line in (
        "train.learning_rate: 3.0",
        "train.iterations: 16",
        "log.tensorboard: False",
        "log.progress: True",
        "tree.split_steps: (0, 3)",
        "eval.extra_rewards: ('digit_accuracy',)",
        "name: '1e3'",
        "train.rows_per_minibatch: 8",
    ):
        assert line in lines


def test_no_default_workdir_for_a_bad_value():
    name = f"config_checks_{uuid.uuid4().hex[:8]}"
    result = run_in_process(
        "--config=configs/tiny.py", f"--config.name={name}", "--config.train.adam_eps=-1.0"
    )
    assert result.returncode == 2
    assert "train.adam_eps must be positive" in one_error_line(result)
    assert not (ROOT / "runs" / name).exists()


def test_print_config_lists_every_field_with_the_overrides(tmp_path):
    result = run_in_process(
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        "--config.train.iterations=7",
        "--config.tree.split_steps=(0,3)",  # the shell's --config.tree.split_steps='(0,3)'
        "--config.eval.extra_rewards=digit_accuracy",  # a bare word is a one-entry tuple
        "--print_config",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    fields = [path for path, v in cfg.flatten(base_config()).items() if not hasattr(v, "items")]
    assert sorted(line.split(":")[0] for line in lines) == sorted(fields)
    for line in (
        "train.iterations: 7",
        "tree.split_steps: (0, 3)",
        "eval.extra_rewards: ('digit_accuracy',)",
        "model.path: ''",
    ):
        assert line in lines
    assert not (tmp_path / "run").exists()


def test_the_done_line_prints_rewards_as_the_eval_line_does(tmp_path, monkeypatch):
    from tree_grpo_jax.run import loop as train

    summary = {
        "first_eval_reward": -0.458312,
        "last_eval_reward": -4.6e-05,
        "session_s": 1.0,
        "wall_time_s": 1.0,
        "rollout_denoiser_calls_per_leaf": 6.94,
        "first_grid": "a.png",
        "last_grid": "b.png",
        "reward_curve": "c.png",
        "iterations": 4,
    }
    monkeypatch.setattr(train, "train", lambda config, workdir, reward_weights: summary)
    result = run_in_process(
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        "--config.compile_cache.enabled=False",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: eval reward -0.4583 -> -4.6e-05;" in result.stdout
    assert "--config.train.iterations=8" in result.stdout  # the line that trains further
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tensorboard", [True, False])
def test_the_done_lines_say_where_the_metrics_events_and_checkpoints_are(
    tmp_path, monkeypatch, tensorboard
):
    """The README's promise: the run prints where its metrics, TensorBoard events, pictures
    and checkpoints went (`checkpoint.dir` when it is set elsewhere)."""
    from tree_grpo_jax.run import loop as train

    summary = {
        "first_eval_reward": -0.5, "last_eval_reward": -0.1, "session_s": 1.0,
        "wall_time_s": 1.0, "rollout_denoiser_calls_per_leaf": 6.94, "first_grid": "a.png",
        "last_grid": "b.png", "reward_curve": "c.png", "iterations": 4,
    }  # fmt: skip
    monkeypatch.setattr(train, "train", lambda config, workdir, reward_weights: summary)
    workdir, elsewhere = tmp_path / "run", tmp_path / "ckpt"
    result = run_in_process(
        "--config=configs/tiny.py", f"--workdir={workdir}", "--config.compile_cache.enabled=False",
        f"--config.checkpoint.dir={elsewhere}", f"--config.log.tensorboard={tensorboard}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    metrics = f"  metrics:        {workdir / 'metrics.jsonl'}"
    if tensorboard:
        metrics += f" (TensorBoard: tensorboard --logdir {workdir / 'tensorboard'})"
    assert metrics in lines, lines
    assert f"  checkpoints:    {elsewhere}" in lines, lines
    assert "  samples after:  b.png" in lines  # the pictures, as before


def test_a_run_older_than_a_field_resumes_at_its_default():
    from tree_grpo_jax.run.checkpoint import fingerprint_mismatch

    current = run_fingerprint.fingerprint(tiny.get_config())
    older = {k: v for k, v in current.items() if not k.startswith("diffusion_nft.")}
    assert fingerprint_mismatch(older, current) is not None  # without the defaults
    assert fingerprint_mismatch(run_fingerprint.with_added_defaults(older), current) is None
    changed = with_values(tiny.get_config(), diffusion_nft__beta=0.5)
    differs = fingerprint_mismatch(
        run_fingerprint.with_added_defaults(older), run_fingerprint.fingerprint(changed)
    )
    assert differs == "diffusion_nft.beta was 1.0, now 0.5"


# A run saved before the schema moved into the package (from the configs folder): the old
# base config's get_config(), and tiny.py's config.json and checkpoint fingerprint, written
# by that code.
SAVED = json.loads((ROOT / "tests" / "data" / "saved_before_the_schema_moved.json").read_text())


def test_the_schema_keeps_every_default_of_the_old_base_config():
    old = cfg.flatten(ml_collections.ConfigDict(SAVED["base_config"]), leaves_only=True)
    new = {
        path: json.loads(json.dumps(value))
        for path, value in cfg.flatten(cfg.base_config(), leaves_only=True).items()
    }
    assert old.keys() <= new.keys()
    for path, value in old.items():
        assert (type(new[path]), new[path]) == (type(value), value), path


def test_a_run_saved_before_the_schema_moved_resumes():
    from tree_grpo_jax.run.checkpoint import fingerprint_mismatch

    saved = SAVED["tiny_fingerprint"]
    current = run_fingerprint.fingerprint(tiny.get_config())
    # every saved setting as it was; fields added since are at their defaults
    assert {k: v for k, v in current.items() if k in saved} == saved
    assert run_fingerprint.with_added_defaults(saved) == current
    assert (
        fingerprint_mismatch(
            run_fingerprint.with_added_defaults(saved),
            run_fingerprint.with_added_defaults(current),
        )
        is None
    )
    # its config.json, read today (evaluate, export): the same run, and a valid config
    config = cfg.saved_config(SAVED["tiny_config_json"])
    assert cfg.validate(config, known_rewards=KNOWN) == {"digit_alignment": 1.0}
    assert run_fingerprint.with_added_defaults(saved) == run_fingerprint.fingerprint(config)


def test_a_config_without_a_registered_section_resumes_a_run_that_had_it(tmp_path):
    """The resume check sees both sides at the schema's defaults (loop.check_resume)."""
    from tree_grpo_jax.run import loop

    class Saved:
        directory = str(tmp_path)
        latest_step = 1

        @staticmethod
        def read_meta():
            return {"fingerprint": SAVED["tiny_fingerprint"], "identity": None}

    c = tiny.get_config()
    del c.model["sd3"]
    loop.check_resume(c, Saved())
    c.model.sd3 = ml_collections.ConfigDict({"use_t5": False})
    with pytest.raises(loop.CheckpointError, match="model.sd3.use_t5 was True, now False"):
        loop.check_resume(c, Saved())


@pytest.mark.parametrize(
    "method, field",
    [("awm", "grpo_guard.enabled=True"), ("diffusion_nft", "grpo_guard.enabled=True"),
     ("treegrpo", "awm.train_timesteps=3"), ("grpo", "dgpo.beta_dpo=50.0"),
     ("dpo", "crd.beta=2.0")],
)  # fmt: skip
def test_another_methods_section_is_refused_not_dropped(tmp_path, method, field):
    result = run_in_process(
        "--config=configs/tiny_flow.py",
        f"--workdir={tmp_path / 'run'}",
        f"--config.tree.method={method}",
        f"--config.{field}",
    )
    assert result.returncode == 2
    line = one_error_line(result)
    assert (
        f"{field.split('=')[0]} is set, but the {field.split('.')[0]} section applies only to"
        in line
    )
    assert f"this run's tree.method is {method}" in line
    assert not (tmp_path / "run").exists()


def test_an_accumulation_longer_than_the_run_is_refused(tmp_path):
    # the demo's settings train one minibatch per iteration
    args = ("--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}")
    result = run_in_process(
        *args, "--config.train.iterations=12", "--config.train.grad_accumulation=13"
    )
    assert result.returncode == 2
    assert "whole run trains 12 (1 per iteration x 12 iterations)" in one_error_line(result)
    assert not (tmp_path / "run").exists()
    fits = with_values(tiny.get_config(), train__iterations=12, train__grad_accumulation=12)
    cfg.validate(fits, known_rewards=KNOWN)
