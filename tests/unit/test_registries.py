"""Model families, rewards and methods are registered records: a toy family and a toy reward
defined here, outside the package, train the tiny loop; their own config sections reach their
loader and builder; the schema takes their sections from them; moved fields and unknown names
are one sentence each, and a taken name needs overwrite=True."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tree_grpo_jax import config as cfg
from tree_grpo_jax import methods, rewards
from tree_grpo_jax.config import base_config
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.tiny.model import build_tiny
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import loop as train

CALLS = {"load": [], "build": []}


def toy_options() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"weight_seed": 3})


def load_toy(request: model_registry.LoadRequest):
    CALLS["load"].append((request.name, request.options.weight_seed, request.dtype))
    model = build_tiny("ddim", seed=request.options.weight_seed, dtype=request.dtype)
    return dataclasses.replace(model, name="toy")


def build_brightness(path, *, scale, dtype, chunk_size, mesh):
    """A model-based reward in form: reads `path` (a folder holding its offset)."""
    offset = json.loads((pathlib.Path(path) / "offset.json").read_text())["offset"]
    CALLS["build"].append((scale, offset, dtype, chunk_size))

    def fn(images, prompts):
        del prompts
        return scale * (offset - jnp.mean(jnp.asarray(images), axis=(1, 2, 3)))

    return fn


@pytest.fixture
def toys(tmp_path):
    folder = tmp_path / "brightness_model"
    folder.mkdir()
    (folder / "offset.json").write_text(json.dumps({"offset": 0.25}))
    family = model_registry.register(
        model_registry.ModelFamily(
            name="toy",
            model_names=("toy_digits",),
            load=load_toy,
            options=toy_options,
            check_options=lambda o: None if o.weight_seed >= 0 else "model.toy.weight_seed < 0.",
            lora_targets=("to_q", "to_v"),
            prompt_sets={"toy_prompts": ("a handwritten digit one", "a handwritten digit two")},
        )
    )
    reward_registry.register_model(
        "brightness",
        build_brightness,
        weights="a brightness folder",
        default_path=str(folder),
        options=lambda: ml_collections.ConfigDict({"scale": 1.0}),
        check_options=lambda o: None if o.scale > 0 else "reward_options.brightness.scale <= 0.",
    )
    CALLS["load"].clear()
    CALLS["build"].clear()
    yield family
    model_registry.unregister("toy")
    reward_registry.unregister("brightness")


def toy_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.name = "toy"
    c.model.name = "toy_digits"
    c.model.toy = toy_options()
    c.model.toy.weight_seed = 5
    c.prompts.source = "toy_prompts"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.tree.method = "treegrpo"
    c.tree.window = 2
    c.train.iterations = 2
    c.train.learning_rate = 1e-3
    c.train.rows_per_minibatch = 8
    c.rewards = "brightness"
    c.reward_options.brightness = ml_collections.ConfigDict({"scale": 2.0})
    c.eval.every = 0
    c.checkpoint.every = 1
    c.log.progress = False
    c.log.tensorboard = False
    return c


@pytest.mark.slow
def test_a_toy_family_and_reward_from_outside_train_the_loop(toys, tmp_path):
    c = toy_config()
    summary = train.train(c, str(tmp_path / "run"))
    # The family's own section reached its loader, the reward's its builder.
    assert CALLS["load"] == [("toy_digits", 5, jnp.float32)]
    assert CALLS["build"] == [(2.0, 0.25, "float32", 16)]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [1, 2] and all(m["train/trained_edges"] for m in trained)
    # The eval reward is the toy reward of the toy model's samples: recompute it by hand.
    trainer, state = train.setup(c, str(tmp_path / "again"))
    model = load_toy(model_registry.LoadRequest("toy_digits", "", jnp.float32, 0, c.model.toy))
    jax.tree.map(np.testing.assert_array_equal, state.params, model.params)
    first, _ = trainer.evaluator.evaluate(state.params)
    assert summary["first_eval_reward"] == pytest.approx(first["reward_mean"], abs=1e-6)


def test_a_family_defaults_its_section_and_lora_uses_its_targets(toys, tmp_path):
    c = toy_config()
    del c.model["toy"]  # a config without the family's section gets its defaults
    c.lora.rank = 2
    trainer, _ = train.setup(c, str(tmp_path))
    assert CALLS["load"][-1][1] == 3
    modules = {path[-2] for path in trainer.adapter.paths}
    assert modules == {"to_q", "to_v"}


def test_family_and_reward_options_are_checked_in_one_sentence(toys):
    c = toy_config()
    c.model.toy.weight_seed = -1
    with pytest.raises(cfg.ConfigError, match=r"^model\.toy\.weight_seed < 0\.$"):
        cfg.validate(c, rewards.available_rewards())
    c = toy_config()
    c.reward_options.brightness.scale = 0.0
    with pytest.raises(cfg.ConfigError, match=r"^reward_options\.brightness\.scale <= 0\.$"):
        cfg.validate(c, rewards.available_rewards())


def test_registering_a_taken_name_needs_overwrite(toys):
    with pytest.raises(ValueError, match="already registered"):
        model_registry.register(dataclasses.replace(toys, name="other"))
    with pytest.raises(ValueError, match="already registered"):
        reward_registry.register("brightness", lambda i, p: i, on_host=True)
    taken = methods.get("grpo")
    with pytest.raises(ValueError, match="^a method named 'grpo' is already registered; pass"):
        methods.register(dataclasses.replace(taken, stat_tracker=False))
    assert methods.register(taken, overwrite=True) is methods.get("grpo")
    toy = methods.register(dataclasses.replace(taken, name="toy_grpo"))
    try:
        assert (
            methods.get("toy_grpo") is toy and methods.methods_of(toy.objective)[-1] == "toy_grpo"
        )
    finally:
        methods.unregister("toy_grpo")
    with pytest.raises(methods.UnknownMethodError, match="'toy_grpo'"):
        methods.get("toy_grpo")


def test_unknown_model_names_the_registered_ones():
    c = base_config()
    c.model.name = "sd4"
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(c)
    assert str(info.value).startswith("unknown model.name 'sd4'; choose one of ")
    for name in ("tiny", "tiny_flow", "sd", "sd3"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    "old, value, new",
    [
        ("model.use_t5", False, "model.sd3.use_t5"),
        ("model.sample_size", 64, "model.sd3.sample_size"),
        ("reward_options.pickscore_divisor", 26.0, "reward_options.pickscore.divisor"),
    ],
)
def test_a_moved_field_names_its_new_place(old, value, new):
    c = base_config()
    section, field = old.rsplit(".", 1)
    c[section][field] = value
    with pytest.raises(cfg.ConfigError, match=f"sets {old}, which moved to {new}"):
        cfg.validate(c)


def test_the_schema_takes_each_section_from_its_record(toys):
    """A registered family's and reward's sections join the schema at their records' defaults
    (a reward that reads a model also gets its folder field), and leave with them."""
    c = cfg.base_config()
    assert c.model.toy.to_dict() == {"weight_seed": 3}
    assert c.reward_options.brightness.to_dict() == {"scale": 1.0}
    assert c.reward_models.brightness == ""
    model_registry.unregister("toy")
    reward_registry.unregister("brightness")
    c = cfg.base_config()
    assert "toy" not in c.model and "brightness" not in c.reward_options
    assert "brightness" not in c.reward_models


def test_one_family_gives_the_default_run(toys):
    assert cfg.base_config().model.name in model_registry.family_of("tiny").model_names
    model_registry.register(dataclasses.replace(toys, default_run={"model.name": "toy_digits"}),
                            overwrite=True)  # fmt: skip
    with pytest.raises(ValueError, match="each give the default run; one may"):
        cfg.base_config()


def test_every_family_of_the_package_is_found():
    names = {f.name for f in model_registry.families()}
    assert {"tiny", "sd", "sd3"} <= names
    assert model_registry.family_of("random_tiny_flow").name == "tiny"
    exportable = {f.name for f in model_registry.families() if f.export is not None}
    assert exportable == {"sd", "sd3", "flux", "wan", "zimage", "qwenimage", "flux2"}


def test_a_family_that_fails_to_import_fails_every_lookup_alike(monkeypatch):
    """Finding the families is all or nothing: one family's import error is raised by every
    call (not "unknown model.name" for the families after it), and none is half registered."""
    import importlib
    import sys

    families = [f"tree_grpo_jax.models.{n}.family" for n in ("flux", "sd15", "tiny")]
    for name in families:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(model_registry, "_FAMILIES", {})
    monkeypatch.setattr(model_registry, "_discovered", False)
    real_import = importlib.import_module

    def failing(name, *args):
        if name == "tree_grpo_jax.models.sd15.family":
            raise ImportError("cannot import name 'x' from 'somewhere'")
        return real_import(name, *args)

    monkeypatch.setattr(model_registry.importlib, "import_module", failing)
    for _ in range(2):
        with pytest.raises(ImportError, match="cannot import name 'x'"):
            model_registry.family_of("random_tiny_flow")
        assert model_registry._FAMILIES == {}
    monkeypatch.setattr(model_registry.importlib, "import_module", real_import)
    assert model_registry.family_of("random_tiny_flow").name == "tiny"  # found once it imports
    assert {"flux", "sd", "tiny"} <= {f.name for f in model_registry.families()}


def test_load_options_hold_the_family_section_and_the_run_time_fields():
    from tree_grpo_jax.models.sd3 import load as sd3_load
    from tree_grpo_jax.models.wan import load as wan_load

    # WanPipeline's 480 x 832 px, and one video through the decoder at a time (model.wan's)
    wan = wan_load.load_options(num_frames=9, remat="block")
    assert (wan.resolution, wan.num_frames, wan.decode_batch_size) == ((480, 832), 9, 1)
    assert wan.module_options() == {"remat": "block", "scan_layers": True, "attention": "xla"}
    sd3 = sd3_load.load_options(attention="blockwise")
    assert (sd3.use_t5, sd3.t5_max_length, sd3.decode_batch_size) == (True, 256, 4)
    assert sd3.module_options()["attention"] == "blockwise"
    with pytest.raises(TypeError, match="unexpected load option"):
        sd3_load.load_options(resolution=512)  # another family's field
    with pytest.raises(AttributeError):
        _ = sd3.num_frames


def test_the_train_step_checkpoints_a_denoiser_only_where_its_blocks_do_not_recompute():
    from types import SimpleNamespace

    from tree_grpo_jax.models.base import training_denoise

    def denoise(params, x, t, cond):
        return x

    blocks = SimpleNamespace(denoise=denoise, remat="block")  # built with model.remat=block
    plain = SimpleNamespace(denoise=denoise, remat="none")
    assert training_denoise(blocks, "block") is denoise
    assert training_denoise(plain, "none") is denoise
    assert training_denoise(plain, True) is not denoise  # wrapped whole in jax.checkpoint
