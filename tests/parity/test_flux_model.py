"""FLUX.1 end to end on a tiny random folder built with PyTorch (tests/flux_fixtures.py):
the prompt encoding against FluxPipeline.encode_prompt, the schedule against its scheduler,
the deterministic sampler against FluxPipeline from the same noise, the VAE decode, a
BranchGRPO training iteration from configs/flux_branchgrpo.py, the export and a LoRA
loaded back by PyTorch, loading without torch and bad folders."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import ModelLoadError, Sampling

torch = pytest.importorskip("torch")
import family_checks  # noqa: E402
from flux_fixtures import RESOLUTION, SCHEDULER_CONFIG  # noqa: E402

from tree_grpo_jax.models import patches  # noqa: E402
from tree_grpo_jax.models.flux import transformer  # noqa: E402
from tree_grpo_jax.models.flux.load import FluxScheduleConfig, load_flux  # noqa: E402

LONG = " ".join(["a photo of a cat"] * 40)  # past CLIP's 77 tokens and T5's 64
PROMPTS = ["a photo of a cat", "", LONG]
T5_TOKENS = 64
LATENT = RESOLUTION // 2  # the tiny VAE's two levels: 2 pixels per latent


@pytest.fixture(scope="module")
def folder(flux_folder):
    return flux_folder


@pytest.fixture(scope="module")
def model(folder):
    return load_flux(str(folder), t5_max_length=T5_TOKENS, resolution=RESOLUTION)


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import FluxPipeline

    # The transformer's files are bfloat16; both sides read the same values in float32.
    return FluxPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


def test_text_equals_encode_prompt(model, pipe):
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(
            PROMPTS, prompt_2=None, max_sequence_length=T5_TOKENS
        )
    ours, our_pooled = model.text_encoders.encode(PROMPTS)
    assert ours.shape == (3, T5_TOKENS, 32) and our_pooled.shape == (3, 24)
    np.testing.assert_allclose(ours, embeds.numpy(), atol=1e-5)
    np.testing.assert_allclose(our_pooled, pooled.numpy(), atol=1e-5)
    np.testing.assert_array_equal(text_ids.numpy(), transformer.text_ids(T5_TOKENS))
    # The conditioning carries both: T5's tokens, then the pooled vector zero-padded.
    cond = np.asarray(model.encode_prompts(PROMPTS))
    np.testing.assert_array_equal(cond[:, :-1], ours)
    np.testing.assert_array_equal(cond[:, -1, :24], our_pooled)
    assert not cond[:, -1, 24:].any()


@pytest.mark.parametrize("num_steps", [4, 20])
@pytest.mark.parametrize("tokens", [16, 2025])
def test_dynamic_schedule_equals_the_pipeline_scheduler(folder, num_steps, tokens):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler"))
    config = scheduler.config
    mu = calculate_shift(
        tokens,
        config.base_image_seq_len,
        config.max_image_seq_len,
        config.base_shift,
        config.max_shift,
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ours = FluxScheduleConfig(image_seq_len=tokens).make_schedule(num_steps, Sampling())
    np.testing.assert_allclose(np.asarray(ours.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.timesteps), scheduler.timesteps.numpy(), atol=1e-3)


@pytest.mark.parametrize("shift, dynamic", [(3.0, True), (1.0, False)])
def test_static_shift_equals_the_scheduler_without_dynamic_shifting(shift, dynamic):
    """A static shift (the GRPO codes' 3, whatever the folder) and a folder that has no
    dynamic shifting (schnell: its own static shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = {**SCHEDULER_CONFIG, "use_dynamic_shifting": False, "shift": shift}
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 20, 20))
    if dynamic:
        ours = FluxScheduleConfig(image_seq_len=2025, static_shift=shift)
    else:
        ours = FluxScheduleConfig(image_seq_len=2025, use_dynamic_shifting=False, shift=shift)
    schedule = ours.make_schedule(20, Sampling(flow_sde="dancegrpo", noise_level=0.3))
    np.testing.assert_allclose(np.asarray(schedule.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    # The released GRPO codes' own form: shift applied to linspace(1, 0, N + 1).
    grid = np.linspace(1, 0, 21)
    np.testing.assert_allclose(
        np.asarray(schedule.sigmas), shift * grid / (1 + (shift - 1) * grid), atol=1e-6
    )
    assert schedule.sde == "dancegrpo"


def test_deterministic_sampler_equals_the_pipeline(model, pipe):
    noise = np.random.default_rng(0).standard_normal((3, *model.sample_shape)).astype("f4")
    assert model.sample_shape == (16, LATENT, LATENT)
    packed = patches.pack_latents(jnp.asarray(noise))
    with torch.no_grad():
        expected = pipe(
            PROMPTS,
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=4,
            guidance_scale=3.5,
            latents=torch.from_numpy(np.array(packed)),
            output_type="latent",
            max_sequence_length=T5_TOKENS,
        ).images.numpy()
    expected = np.asarray(patches.unpack_latents(jnp.asarray(expected), LATENT, LATENT))
    schedule = model.make_schedule(4, Sampling())
    got = rollout.sample_deterministic(
        model.denoise, model.params, model.encode_prompts(PROMPTS), jnp.asarray(noise), schedule
    )
    diff = np.abs(np.asarray(got) - expected).max()
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff


def test_decode_equals_the_vae(model, pipe):
    latents = np.random.default_rng(1).standard_normal((2, *model.sample_shape)).astype("f4")
    vae = pipe.vae
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)
    with torch.no_grad():
        z = torch.from_numpy(latents) / vae.config.scaling_factor + vae.config.shift_factor
        expected = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, RESOLUTION, RESOLUTION, 3)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _pytorch_velocity(pt_transformer, x, context, pooled, sigma, guidance):
    with torch.no_grad():
        return pt_transformer(
            hidden_states=torch.from_numpy(np.array(patches.pack_latents(jnp.asarray(x)))),
            encoder_hidden_states=torch.from_numpy(context),
            pooled_projections=torch.from_numpy(pooled),
            timestep=torch.from_numpy(sigma),
            img_ids=torch.from_numpy(transformer.image_ids(*x.shape[2:])),
            txt_ids=torch.from_numpy(transformer.text_ids(context.shape[1])),
            guidance=torch.full((x.shape[0],), guidance),
        ).sample.numpy()


def _random_inputs(seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 16, LATENT, LATENT)).astype("f4")
    context = rng.standard_normal((2, 5, 32)).astype("f4")
    pooled = rng.standard_normal((2, 24)).astype("f4")
    return x, context, pooled, np.array([0.9, 0.25], "f4")


_JITTED = {}


def _jitted_denoise(model):
    """One compiled denoiser for every params tree of the same shapes."""
    return _JITTED.setdefault(id(model.denoise), jax.jit(model.denoise))


def _our_velocity(model, params, x, context, pooled, sigma):
    from tree_grpo_jax.models.text_encoders import pack_conditioning

    cond = pack_conditioning(jnp.asarray(context), jnp.asarray(pooled))
    out = _jitted_denoise(model)(params, jnp.asarray(x), jnp.asarray(sigma) * 1000.0, cond)
    return np.asarray(patches.pack_latents(out))


def test_a_training_iteration_and_the_export_pytorch_loads(folder, model, tmp_path):
    from diffusers import FluxTransformer2DModel

    workdir, out = tmp_path / "run", tmp_path / "exported"
    overrides = [
        f"--config.model.path={folder}",
        f"--config.model.flux.resolution={RESOLUTION}",
        "--config.model.flux.t5_max_length=8",
        "--config.tree.split_steps=(0,1)",
        "--config.train.rows_per_minibatch=4",
    ]
    family_checks.train_one_iteration_without_torch(
        "configs/flux_branchgrpo.py",
        workdir,
        overrides,
        released="prompts encoded ahead; T5 released",
    )
    trained = family_checks.export_the_trained_params(workdir, out, model.params)

    pt = FluxTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    inputs = _random_inputs()
    expected = _pytorch_velocity(pt, *inputs, guidance=3.5)
    got = _our_velocity(model, trained, *inputs)
    np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, np.abs(expected).max()))
    assert (out / "text_encoder_2").is_dir() and (out / "model_index.json").is_file()


def test_lora_export_loads_into_the_pipeline(model, pipe, tmp_path):
    from tree_grpo_jax import lora
    from tree_grpo_jax.models import registry

    family = registry.family_of("flux")
    paths = lora.target_paths(model.params, family.lora_targets)
    modules = {"/".join(p[:-1]) for p in paths}
    assert "single_transformer_blocks_0/attn/to_q" in modules
    assert "transformer_blocks_0/attn/to_out_0" in modules
    assert not any("add_" in m or "proj_out" in m for m in modules)
    factors = family_checks.random_lora(model.params, paths)
    out = family_checks.export_lora(factors, family, tmp_path / "lora")
    inputs = _random_inputs(seed=4)
    expected = family_checks.with_lora_loaded(
        pipe, out, lambda pt: _pytorch_velocity(pt, *inputs, guidance=3.5)
    )
    got = _our_velocity(model, family_checks.merged(model.params, factors), *inputs)
    base = _our_velocity(model, model.params, *inputs)
    assert np.abs(expected - base).max() > 1e-3  # the adapter is not a no-op
    np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, np.abs(expected).max()))


def test_the_family_recognizes_flux_folders_and_plans_the_releases(folder, model):
    import ml_collections

    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.flux import load
    from tree_grpo_jax.models.flux.abstract import abstract_flux
    from tree_grpo_jax.models.flux.builtin import RELEASES

    assert registry.family_of_folder(str(folder)).name == "flux"
    assert not registry.family_of("sd3").recognizes(folder)
    # The plan's shapes of the tiny folder, from its JSON files, are the loaded model's.
    tiny = abstract_flux(str(folder), t5_max_length=T5_TOKENS, resolution=RESOLUTION)
    assert tiny.sample_shape == model.sample_shape
    assert tiny.cond_shape == model.encode_prompts(["a cat"]).shape[1:]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tiny.params)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), model.params)
    assert tiny.schedule_config == model.schedule_config
    section = ml_collections.ConfigDict(
        {"name": "flux", "path": "builtin:flux-dev", "compute_dtype": "bfloat16"}
    )
    section.flux = registry.family_of("flux").options()
    section.flux.resolution = 720
    dev = registry.abstract_model(section)
    assert dev.sample_shape == (16, 90, 90) and dev.cond_shape == (513, 4096)
    count = sum(leaf.size for leaf in jax.tree_util.tree_leaves(dev.params))
    assert 11.8e9 < count < 12.0e9  # FLUX.1-dev's 11.9B transformer
    schnell = RELEASES["flux-schnell"].configs
    assert load.default_t5_max_length(schnell["transformer/config.json"]) == 256
    config = schnell["scheduler/scheduler_config.json"]
    sigmas = load.schedule_config(config, "schnell", 2025).sigmas(4)
    np.testing.assert_allclose(sigmas, [1, 0.75, 0.5, 0.25, 0])


def test_prepared_prompts_release_t5(model):
    import dataclasses

    encoders = dataclasses.replace(model.text_encoders, cache={})  # the fixture keeps its T5
    before, pooled = encoders.encode(PROMPTS)
    encoders.precompute(["a dog", *PROMPTS])
    encoders.drop_t5()
    after, after_pooled = encoders.encode(PROMPTS[::-1])
    np.testing.assert_array_equal(after, before[::-1])
    np.testing.assert_array_equal(after_pooled, pooled[::-1])
    with pytest.raises(ValueError, match="'a new prompt' is not cached and T5 was dropped"):
        encoders.encode(["a new prompt"])
    assert model.text_encoders.t5 is not None


def test_clip_files_of_either_transformers_release_encode_the_same(folder, model, tmp_path):
    """The CLIP tokenizer and text tower as the other transformers release would have saved
    them (tokenizer.json alone or vocab.json and merges.txt; tensor names without or with
    `text_model.`) load to the same prompt embeddings."""
    from clip_fixtures import swap_text_naming, swap_tokenizer_layout

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    swap_tokenizer_layout(other / "tokenizer")
    swap_text_naming(other / "text_encoder" / "model.safetensors")
    loaded = load_flux(str(other), t5_max_length=T5_TOKENS, resolution=RESOLUTION)
    for ours, theirs in zip(
        loaded.text_encoders.encode(PROMPTS), model.text_encoders.encode(PROMPTS)
    ):
        np.testing.assert_array_equal(ours, theirs)


def _broken(folder, tmp_path, change):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    change(broken)
    with pytest.raises(ModelLoadError) as info:
        load_flux(str(broken), t5_max_length=8, resolution=RESOLUTION)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    return message


@pytest.mark.parametrize(
    "remove",
    ["transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer_2"],
)
def test_missing_component_is_one_sentence(folder, tmp_path, remove):
    message = _broken(folder, tmp_path, lambda root: shutil.rmtree(root / remove))
    assert f"has no {remove}/" in message


def _rewrite_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda r: _rewrite_json(r / "transformer" / "config.json", _class_name="Other"),
            "not a FluxTransformer2DModel",
        ),
        (
            lambda r: _rewrite_json(r / "transformer" / "config.json", patch_size=2),
            "patch_size 2 is not supported",
        ),
        (
            lambda r: _rewrite_json(r / "vae" / "config.json", latent_channels=4),
            "not its VAE's 4 latent channels",
        ),
        (
            lambda r: _rewrite_json(r / "scheduler" / "scheduler_config.json", invert_sigmas=True),
            "invert_sigmas=True",
        ),
        (
            lambda r: (
                r / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
            ).unlink(),
            "no diffusion_pytorch_model.safetensors",
        ),
        (
            lambda r: [
                p.write_bytes(p.read_bytes()[:-100])
                for p in sorted((r / "transformer").glob("*-00002-*.safetensors"))
            ],
            "damaged or truncated",
        ),
        (  # transformers 4 saves vocab.json, 5 tokenizer.json: either is a tokenizer
            lambda r: [
                (r / "tokenizer" / name).unlink(missing_ok=True)
                for name in ("vocab.json", "tokenizer.json")
            ],
            "has no tokenizer/vocab.json (nor tokenizer/tokenizer.json",
        ),
    ],
)
def test_bad_folder_is_one_sentence(folder, tmp_path, change, words):
    assert words in _broken(folder, tmp_path, change)


def test_bad_options_are_one_sentence():
    from tree_grpo_jax import config as cfg
    from tree_grpo_jax.config import shape

    for field, value in (("t5_max_length", 513), ("resolution", -1), ("shift", -1.0)):
        config = cfg.base_config()
        config.model.flux[field] = value
        with pytest.raises(cfg.ConfigError) as e:
            shape.check_ranges(config)
        sentence = str(e.value)
        assert sentence.startswith(f"model.flux.{field} must be") and "\n" not in sentence


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("flux_branchgrpo_mix", {"tree.window": 2, "tree.split_steps": (0, 1)}),
        ("flux_dancegrpo", {"tree.group_size": 2}),
        ("flux_mixgrpo", {"tree.group_size": 2, "tree.window": 2}),
        ("flux_treegrpo", {"tree.window": 2, "tree.split_steps": (0, 1)}),
    ],
)
def test_every_flux_config_trains_an_iteration_on_the_tiny_folder(
    folder, tmp_path, name, overrides
):
    """The other FLUX configs (BranchGRPO-Mix, DanceGRPO, MixGRPO, TreeGRPO) with their own
    method, SDE and training settings, at the tiny folder's size: one iteration each."""
    import importlib

    from tree_grpo_jax.run import loop as train

    config = importlib.import_module(f"configs.{name}").get_config()
    config.model.path = str(folder)
    config.model.compute_dtype = "float32"
    config.model.remat = False
    config.model.flux.resolution = RESOLUTION
    config.model.flux.t5_max_length = 8
    config.rewards = "jpeg_compressibility"
    config.reward_models.hpsv2 = ""
    config.prompts.batch_size = 1
    config.prompts.eval_count = 1
    config.sampling.num_steps = 3
    config.train.iterations = 1
    config.train.rows_per_minibatch = 4
    config.train.grad_accumulation = 1
    config.eval.every = 0
    config.checkpoint.every = 0
    config.log.tensorboard = False
    for field, value in overrides.items():
        section, key = field.split(".")
        config[section][key] = value
    summary = train.train(config, str(tmp_path / name))
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r and np.isfinite(r["train/loss"]) for r in rows), summary
