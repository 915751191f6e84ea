"""Stable Diffusion 3.5 end to end on a tiny random folder built with PyTorch: the schedule,
the deterministic sampler against diffusers' StableDiffusion3Pipeline from the same noise,
the VAE decode, a training iteration from the command line's config, and the export loaded
back by PyTorch."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import ModelLoadError, Sampling

torch = pytest.importorskip("torch")

from tree_grpo_jax.models.sd3.load import FlowMatchScheduleConfig, load_sd3  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["a photo of a cat", "a dog"]


@pytest.fixture(scope="module")
def folder(sd3_folder):
    return sd3_folder


@pytest.fixture(scope="module")
def model(folder):
    return load_sd3(str(folder))


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(str(folder)).to(torch.float32)


@pytest.mark.parametrize("num_steps", [4, 10, 28])
def test_schedule_equals_the_pipeline_scheduler(folder, num_steps):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler"))
    scheduler.set_timesteps(num_steps)
    ours = FlowMatchScheduleConfig(shift=3.0).make_schedule(num_steps, Sampling())
    np.testing.assert_allclose(np.asarray(ours.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.timesteps), scheduler.timesteps.numpy(), atol=1e-3)


def test_deterministic_sampler_equals_the_pipeline(model, pipe):
    noise = np.random.default_rng(0).standard_normal((2, *model.sample_shape)).astype(np.float32)
    steps, guidance = 4, 4.5
    with torch.no_grad():
        expected = pipe(
            PROMPTS,
            num_inference_steps=steps,
            guidance_scale=guidance,
            latents=torch.from_numpy(noise),
            output_type="latent",
            max_sequence_length=256,
        ).images.numpy()
    schedule = model.schedule_config.make_schedule(steps, Sampling(noise_level=0.7))
    got = rollout.sample_deterministic(
        model.denoise,
        model.params,
        model.encode_prompts(PROMPTS),
        jnp.asarray(noise),
        schedule,
        uncond=model.encode_prompts([""])[0],
        guidance_scale=guidance,
    )
    diff = np.abs(np.asarray(got) - expected).max()
    assert diff <= 1e-4 * max(1.0, np.abs(expected).max()), diff


def test_decode_equals_the_vae(model, pipe):
    latents = np.random.default_rng(1).standard_normal((2, *model.sample_shape)).astype("f4")
    vae = pipe.vae
    with torch.no_grad():
        z = torch.from_numpy(latents) / vae.config.scaling_factor + vae.config.shift_factor
        expected = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, 16, 16, 3)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_sde_step_log_prob_is_the_gaussian_density(model):
    """One SDE step of the SD3 schedule: the log-prob is scipy's normal density."""
    from tree_grpo_jax.core import sampling

    schedule = model.schedule_config.make_schedule(10, Sampling(noise_level=0.7))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 16, 4, 4)).astype("f4")
    v = rng.standard_normal((1, 16, 4, 4)).astype("f4")
    for i in (0, 4, 9):
        mean, std = schedule.transition(i, jnp.asarray(x), jnp.asarray(v))
        sample = np.asarray(mean) + np.asarray(std) * rng.standard_normal(x.shape).astype("f4")
        ours = sampling.gaussian_log_prob(
            jnp.asarray(sample), mean, std, event_ndim=3, reduce="sum"
        )
        sigma, nxt = float(schedule.sigmas[i]), float(schedule.sigmas[i + 1])
        dt = nxt - sigma
        unit = np.sqrt(sigma / (1 - (nxt if sigma >= 1 else sigma)))
        sig = 0.7 * unit
        x_coef = 1 + sig**2 * dt / (2 * sigma)
        v_coef = (1 + sig**2 * (1 - sigma) / (2 * sigma)) * dt
        ref_mean = x * x_coef + v * v_coef
        ref = scipy.stats.norm.logpdf(sample, ref_mean, sig * np.sqrt(-dt)).sum()
        np.testing.assert_allclose(float(ours[0]), ref, rtol=1e-4)


def test_a_training_iteration_and_the_export_pytorch_loads(folder, tmp_path):
    from diffusers import SD3Transformer2DModel

    from tree_grpo_jax.run.checkpoint import Checkpointer

    workdir = tmp_path / "run"
    out = tmp_path / "exported"
    overrides = [
        f"--config.model.path={folder}",
        f"--workdir={workdir}",
        "--config.model.compute_dtype=float32",
        "--config.model.sd3.sample_size=0",
        "--config.rewards=jpeg_compressibility",  # the config's HPS-v2.1 needs its weights
        "--config.prompts.batch_size=1",
        "--config.prompts.eval_count=2",
        "--config.sampling.num_steps=4",
        "--config.tree.window=2",
        "--config.train.iterations=1",
        "--config.train.rows_per_minibatch=2",
        "--config.train.grad_accumulation=1",
        "--config.eval.every=0",
        "--config.checkpoint.every=1",
        "--config.log.tensorboard=False",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "tree_grpo_jax.main", "--config=configs/sd35m.py", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m and np.isfinite(m["train/loss"]) for m in metrics)

    export = subprocess.run(
        [sys.executable, "-m", "tree_grpo_jax.export", f"--workdir={workdir}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    trained = Checkpointer(str(workdir / "checkpoints"), read_only=True).restore_params()
    base = load_sd3(str(folder))
    changed = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), trained, base.params)
    assert max(jax.tree_util.tree_leaves(changed)) > 0  # the iteration moved the weights

    pt = SD3Transformer2DModel.from_pretrained(str(out / "transformer")).eval()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16, 8, 8)).astype("f4")
    context = rng.standard_normal((2, 5, pt.config.joint_attention_dim)).astype("f4")
    pooled = rng.standard_normal((2, pt.config.pooled_projection_dim)).astype("f4")
    t = np.array([999.0, 250.0], "f4")
    with torch.no_grad():
        expected = pt(
            hidden_states=torch.from_numpy(x),
            encoder_hidden_states=torch.from_numpy(context),
            pooled_projections=torch.from_numpy(pooled),
            timestep=torch.from_numpy(t),
        ).sample.numpy()
    got = base.transformer.apply({"params": trained}, x, context, pooled, t)
    scale = max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4 * scale)


@pytest.mark.parametrize("remove", ["transformer", "vae", "scheduler", "text_encoder_3"])
def test_missing_component_is_one_sentence(folder, tmp_path, remove):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / remove)
    with pytest.raises(ModelLoadError, match=remove) as info:
        load_sd3(str(broken))
    assert "\n" not in str(info.value)
    if remove == "text_encoder_3":
        load_sd3(str(broken), use_t5=False)  # the pipeline runs without T5, so do we


def test_wrong_family_is_one_sentence(folder, tmp_path):
    broken = tmp_path / "unet_instead"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "transformer" / "config.json").read_text())
    config["_class_name"] = "UNet2DConditionModel"
    (broken / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not an SD3Transformer2DModel"):
        load_sd3(str(broken))


def test_truncated_transformer_weights(folder, tmp_path):
    broken = tmp_path / "cut"
    shutil.copytree(folder, broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="damaged or truncated"):
        load_sd3(str(broken))


@pytest.mark.slow
def test_loading_and_sampling_run_without_torch(folder):
    """torch is a test-only dependency: the whole SD3 load never imports it."""
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None
        import jax.numpy as jnp
        from tree_grpo_jax.models.sd3.load import load_sd3
        model = load_sd3({str(folder)!r})
        cond = model.encode_prompts(["a cat"])
        x = jnp.zeros((1, *model.sample_shape))
        v = model.denoise(model.params, x, 500.0, cond)
        image = model.decode(x)
        assert v.shape == x.shape and image.shape == (1, 16, 16, 3)
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_prepared_prompts_release_t5(folder):
    model = load_sd3(str(folder))
    before = np.asarray(model.encode_prompts(PROMPTS))
    assert (
        model.prepare_prompts([*PROMPTS, "", PROMPTS[0]]) == "3 prompts encoded ahead; T5 released"
    )
    np.testing.assert_array_equal(np.asarray(model.encode_prompts(PROMPTS[::-1])), before[::-1])
    with pytest.raises(ValueError, match="not cached and T5 was dropped"):
        model.encode_prompts(["a new prompt"])
