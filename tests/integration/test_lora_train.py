"""LoRA in the trainer: only the factors train and are checkpointed, step 0 is the base model,
the KL reference is the base itself, resumes against other base weights (or into a full run)
are refused in one sentence, and a LoRA run exports a file diffusers loads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from small_configs import small_config

from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.checkpoint import Checkpointer, CheckpointError


def lora_config(method="treegrpo"):
    c = small_config(method)
    c.lora.rank = 2
    c.lora.alpha = 4.0
    c.train.iterations = 1
    c.eval.every = 0
    c.checkpoint.every = 1
    return c


def test_only_factors_train_and_step_zero_is_the_base(tmp_path):
    c = lora_config()
    trainer, state = train.setup(c, str(tmp_path / "unused"))
    base = jax.device_get(trainer.model.params)
    merged = jax.device_get(trainer.model_params(state.params))
    jax.tree_util.tree_map(np.testing.assert_array_equal, merged, base)  # B = 0: bit for bit
    leaves = flatten_dict(jax.device_get(state.params))
    assert leaves and all(k[-1] in ("a", "b") for k in leaves)
    assert all(not np.any(v) for k, v in leaves.items() if k[-1] == "b")

    train.train(c, str(tmp_path / "run"))
    saved = Checkpointer(str(tmp_path / "run" / "checkpoints"), read_only=True).restore_params()
    saved = flatten_dict(jax.device_get(saved))
    assert set(saved) == set(leaves)  # the checkpoint holds the factors, nothing else
    assert any(np.any(v) for k, v in saved.items() if k[-1] == "b")  # B moved off zero
    jax.tree_util.tree_map(  # the frozen base is untouched
        np.testing.assert_array_equal, jax.device_get(trainer.adapter.base), base
    )


@pytest.mark.slow
def test_a_bfloat16_run_holds_its_frozen_base_in_bfloat16(tmp_path):
    """With bfloat16 compute the frozen base is the model's weights rounded to bfloat16 (no
    float32 copy), the factors alone keep float32 masters, and the merged weights stay
    bfloat16 through an iteration that moves the factors and leaves the base as it was."""
    c = lora_config()
    c.model.compute_dtype = "bfloat16"
    trainer, state = train.setup(c, str(tmp_path))
    weights = flatten_dict(jax.device_get(trainer.model.params))
    base = flatten_dict(jax.device_get(trainer.adapter.base))
    assert set(base) == set(weights)
    for path, value in base.items():
        assert value.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(
            value, np.asarray(weights[path], np.float32).astype(value.dtype)
        )
    factors = flatten_dict(jax.device_get(state.params))
    assert factors and all(v.dtype == np.float32 for v in factors.values())
    merged = jax.eval_shape(trainer.model_params, state.params)
    assert {x.dtype for x in jax.tree_util.tree_leaves(merged)} == {jnp.dtype(jnp.bfloat16)}

    state, metrics = trainer.iteration(state, 0)
    assert np.isfinite(metrics["loss"])
    after = flatten_dict(jax.device_get(state.params))
    assert all(v.dtype == np.float32 for v in after.values())
    assert any(np.any(after[k] != factors[k]) for k in factors)  # the factors trained
    for path, value in flatten_dict(jax.device_get(trainer.adapter.base)).items():
        np.testing.assert_array_equal(value, base[path])


def test_kl_reference_is_the_base_without_a_copy(tmp_path):
    c = lora_config()
    c.train.kl_beta = 0.1
    trainer, _ = train.setup(c, str(tmp_path))
    assert trainer.ref_params is trainer.adapter.base


def test_resume_on_other_base_weights_is_refused(tmp_path, monkeypatch):
    c = lora_config()
    train.train(c, str(tmp_path))
    original = model_registry.load_model

    def other_weights(model_config, seed=0):
        import dataclasses

        model = original(model_config, seed=seed)
        params = jax.tree_util.tree_map(lambda x: x + 0.01, model.params)
        return dataclasses.replace(model, params=params)

    monkeypatch.setattr(model_registry, "load_model", other_weights)
    c.train.iterations = 2
    with pytest.raises(CheckpointError, match="trained on other base weights") as info:
        train.train(c, str(tmp_path))
    assert "\n" not in str(info.value)


def test_lora_checkpoint_into_a_full_run_is_refused(tmp_path):
    train.train(lora_config(), str(tmp_path))
    full = lora_config()
    full.lora.rank = 0
    full.train.iterations = 2
    with pytest.raises(CheckpointError, match="lora.rank"):
        train.train(full, str(tmp_path))


@pytest.mark.slow
def test_sd_lora_run_exports_peft_weights_and_merged_weights(tmp_path, sd_folder):
    """A LoRA run on the tiny SD folder exports a PEFT file diffusers loads, whose UNet then
    computes what our merged UNet computes; `--merge` writes the merged UNet itself."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from tree_grpo_jax.cli import export
    from tree_grpo_jax.models.sd15.load import load_sd

    c = lora_config("grpo")
    c.model.name = "sd"
    c.model.path = str(sd_folder)
    c.tree.group_size = 2
    c.sampling.guidance_scale = 1.0
    c.prompts.eval_count = 1
    c.lora.rank = 4
    c.lora.alpha = 8.0
    c.train.learning_rate = 1e-2
    run = tmp_path / "run"
    train.train(c, str(run))
    config = json.loads((run / "config.json").read_text())
    assert config["lora"]["rank"] == 4

    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'peft'}"]) == 0
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'merged'}", "--merge"]) == 0

    model = load_sd(str(sd_folder))
    factors = Checkpointer(str(run / "checkpoints"), read_only=True).restore_params()
    trainer, _ = train.setup(c, str(tmp_path / "unused"))
    merged = trainer.model_params(factors)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, *model.sample_shape)).astype("f4")
    cond = np.array(model.encode_prompts(["a cat", "a dog"]))
    t = np.array([500.0, 20.0], "f4")
    ours = np.asarray(model.denoise(merged, x, t, cond))
    assert np.abs(ours - np.asarray(model.denoise(model.params, x, t, cond))).max() > 1e-6

    pipe = StableDiffusionPipeline.from_pretrained(str(sd_folder), safety_checker=None)
    pipe.load_lora_weights(str(tmp_path / "peft"))
    merged_unet = UNet2DConditionModel.from_pretrained(str(tmp_path / "merged" / "unet"))
    with torch.no_grad():
        args = (torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(cond))
        for unet in (pipe.unet, merged_unet):
            theirs = unet(*args).sample.numpy()
            np.testing.assert_allclose(ours, theirs, atol=1e-4 * max(1.0, np.abs(theirs).max()))
