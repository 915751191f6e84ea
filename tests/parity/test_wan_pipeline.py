"""Wan2.1 text-to-video end to end on a tiny random folder built with PyTorch
(tests/wan_fixtures.py): the schedule against the release's UniPC scheduler and the Euler
one, the prompts against `WanPipeline.encode_prompt`, the deterministic sampler against
`WanPipeline(latents=..., output_type="latent")`, the VAE decode against `vae.decode`, the
exported folder through `WanPipeline.from_pretrained`, a LoRA through `load_lora_weights`,
the plan's shapes and bad folders."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import ModelLoadError, Sampling

torch = pytest.importorskip("torch")
from wan_fixtures import (  # noqa: E402
    LATENT_CHANNELS,
    NUM_FRAMES,
    RESOLUTION,
    TEXT_WIDTH,
    euler_scheduler,
)

from tree_grpo_jax.models.wan.load import WanScheduleConfig, load_wan  # noqa: E402

LONG = " ".join(["a photo of a cat"] * 8)  # past the 12 tokens
PROMPTS = ["a photo of a cat", "  a   dog &amp; a cat ", LONG]
T5_TOKENS = 12
LATENTS = (3, RESOLUTION[0] // 4, RESOLUTION[1] // 4, LATENT_CHANNELS)  # channels last


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from wan_fixtures import make_tiny_wan_folder

    return make_tiny_wan_folder(tmp_path_factory.mktemp("tiny_wan"))


@pytest.fixture(scope="module")
def model(folder):
    return load_wan(
        str(folder), resolution=RESOLUTION, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS
    )


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import WanPipeline

    # The transformer's files are bfloat16; both sides read the same values in float32.
    return WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


_JITTED = {}


def _velocity(model, params, x, t, context):
    """Our denoiser (one compiled program per model) on numpy inputs."""
    denoise = _JITTED.setdefault(id(model.denoise), jax.jit(model.denoise))
    return np.asarray(denoise(params, jnp.asarray(x), jnp.asarray(t), jnp.asarray(context)))


def _channels_first(x):
    """Our latents [B, F, h, w, C] as diffusers holds them, [B, C, F, h, w]."""
    return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 4, 1, 2, 3)


def _channels_last(x):
    return x.permute(0, 2, 3, 4, 1).numpy()


def _torch_velocity(transformer, x, t, context):
    with torch.no_grad():
        return _channels_last(
            transformer(
                hidden_states=_channels_first(x),
                timestep=torch.from_numpy(t),
                encoder_hidden_states=torch.from_numpy(context),
            ).sample
        )


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *LATENTS)).astype("f4")
    context = rng.standard_normal((2, 5, TEXT_WIDTH)).astype("f4")
    return x, np.array([930.0, 210.0], "f4"), context


def test_the_loaded_model_is_a_video_model(model):
    assert model.media == "video" and model.sample_shape == LATENTS
    videos = np.asarray(model.decode(jnp.zeros((1, *LATENTS))))
    assert videos.shape == (1, NUM_FRAMES, *RESOLUTION, 3)


@pytest.mark.parametrize("num_steps", [4, 20])
@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_sigmas_equal_the_release_scheduler(num_steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
    )
    unipc.set_timesteps(num_steps)
    ours = WanScheduleConfig(flow_shift=shift).make_schedule(num_steps, Sampling())
    sigmas = np.asarray(ours.sigmas)
    # UniPC nudges its first sigma from 1 to 1 - 1e-6 to keep a log finite; ours is 1.
    np.testing.assert_allclose(sigmas, unipc.sigmas.numpy(), atol=2e-6)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    euler = FlowMatchEulerDiscreteScheduler(shift=shift)
    euler.set_timesteps(num_steps)
    grid = WanScheduleConfig(flow_shift=shift, grid="flow_match_euler").sigmas(num_steps)
    np.testing.assert_allclose(grid, euler.sigmas.numpy(), atol=1e-6)
    assert np.abs(grid - sigmas).max() > 1e-3  # the two grids differ: each is checked


def test_text_equals_encode_prompt(model, pipe):
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(
            PROMPTS, do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS
        )
    ours = model.text_encoders.encode(PROMPTS)
    assert ours.shape == (3, T5_TOKENS, TEXT_WIDTH)
    np.testing.assert_allclose(ours, expected.numpy(), atol=1e-5)
    assert (ours[0, 6:] == 0).all() and (ours[2] != 0).all()  # zeros past a prompt's tokens
    assert np.abs(ours[0] - ours[1]).max() > 1e-3


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_deterministic_sampler_equals_the_pipeline(model, pipe, guidance):
    """Unguided, and with the configs' guidance 5 against the empty negative prompt (the
    pipeline's default), which the run's unconditional prompt is."""
    noise = np.random.default_rng(0).standard_normal((3, *LATENTS)).astype("f4")
    schedule = model.make_schedule(4, Sampling())
    with euler_scheduler(pipe, np.asarray(schedule.sigmas, np.float64)), torch.no_grad():
        expected = pipe(
            PROMPTS,
            negative_prompt="",
            height=RESOLUTION[0],
            width=RESOLUTION[1],
            num_frames=NUM_FRAMES,
            num_inference_steps=4,
            guidance_scale=guidance,
            latents=_channels_first(noise),
            output_type="latent",
            max_sequence_length=T5_TOKENS,
        ).frames
    expected = _channels_last(expected)
    got = rollout.sample_deterministic(
        model.denoise,
        model.params,
        model.encode_prompts(PROMPTS),
        jnp.asarray(noise),
        schedule,
        uncond=model.encode_prompts([""])[0],  # as the run builds it
        guidance_scale=guidance,
    )
    diff = np.abs(np.asarray(got) - expected).max()
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    assert np.abs(expected - noise).max() > 0.1  # the steps moved the latents


def test_decode_equals_the_vae(model, pipe):
    latents = np.random.default_rng(1).standard_normal((2, *LATENTS)).astype("f4")
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():  # as WanPipeline decodes
        videos = vae.decode(_channels_first(latents) / inverse_std + mean).sample
    expected = (videos.clamp(-1, 1) / 2 + 0.5).permute(0, 2, 3, 4, 1).numpy()
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, NUM_FRAMES, *RESOLUTION, 3)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert np.abs(got[0] - got[1]).max() > 0.05


def _nudged(params, seed=5):
    """The params moved a little, as a training run moves them."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, moved)


def test_the_exported_folder_loads_in_the_pipeline(folder, model, tmp_path):
    from diffusers import WanPipeline

    from tree_grpo_jax.models import export, registry

    family = registry.family_of_folder(str(folder))
    assert family.name == "wan"
    base, denoiser = family.export.base_denoiser(str(folder))
    params = _nudged(model.params)
    out = export.export_pipeline(params, base, denoiser, tmp_path / "exported")
    loaded = WanPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    inputs = _inputs(3)
    expected = _torch_velocity(loaded.transformer.eval(), *inputs)
    got = _velocity(model, params, *inputs)
    np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, np.abs(expected).max()))
    assert np.abs(got - _velocity(model, model.params, *inputs)).max() > 1e-3
    for component in ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"):
        assert (out / component).exists()


def test_lora_export_loads_into_the_pipeline(model, pipe, tmp_path):
    from tree_grpo_jax import lora
    from tree_grpo_jax.models import registry

    family = registry.family_of("wan")
    paths = lora.target_paths(model.params, family.lora_targets)
    modules = {"/".join(str(p) for p in path[:-1]) for path in paths}
    assert any("attn1/to_q" in m for m in modules) and any("attn2/to_out_0" in m for m in modules)
    assert not any("ffn" in m or "condition_embedder" in m for m in modules)
    factors = lora.init_lora(jax.random.PRNGKey(0), model.params, paths, rank=2)
    # B starts at zero (PEFT's init); give it values so the adapter changes the output.
    factors = jax.tree_util.tree_map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(1), x.shape), factors
    )
    out = lora.export_lora(factors, family.export.component, 2, 4.0, tmp_path / "lora")
    pipe.load_lora_weights(str(out))
    try:
        inputs = _inputs(4)
        expected = _torch_velocity(pipe.transformer, *inputs)
    finally:
        pipe.unload_lora_weights()
    merged = lora.merge(model.params, factors, 4.0, 2)
    got = _velocity(model, merged, *inputs)
    base = _velocity(model, model.params, *inputs)
    assert np.abs(expected - base).max() > 1e-3  # the adapter is not a no-op
    np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, np.abs(expected).max()))


def test_the_family_plans_the_folder_and_the_releases(folder, model):
    import ml_collections

    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.wan import transformer
    from tree_grpo_jax.models.wan.abstract import abstract_wan
    from tree_grpo_jax.models.wan.builtin import RELEASES

    assert not registry.family_of("flux").recognizes(folder)
    tiny = abstract_wan(
        str(folder), resolution=RESOLUTION, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS
    )
    assert tiny.sample_shape == model.sample_shape and tiny.media == "video"
    assert tiny.cond_shape == model.encode_prompts(["a cat"]).shape[1:]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tiny.params)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), model.params)
    assert tiny.schedule_config == model.schedule_config
    for size, name in (("1.3b", "wan-1.3b"), ("14b", "wan-14b")):
        config = RELEASES[name].configs["transformer/config.json"]
        assert config == transformer.builtin_config(size)  # the same release, twice
    counts = {}
    for name in ("wan-1.3b", "wan-14b"):  # Wan2.2's: tests/parity/test_wan22_pipeline.py
        section = ml_collections.ConfigDict(
            {"name": "wan", "path": f"builtin:{name}", "compute_dtype": "bfloat16"}
        )
        section.wan = registry.family_of("wan").options()
        planned = registry.abstract_model(section)
        assert planned.sample_shape == (21, 60, 104, 16) and planned.cond_shape == (512, 4096)
        counts[name] = sum(leaf.size for leaf in jax.tree_util.tree_leaves(planned.params))
    assert 1.40e9 < counts["wan-1.3b"] < 1.45e9  # Wan2.1-T2V-1.3B's 1.42B transformer
    assert 14.0e9 < counts["wan-14b"] < 14.5e9


def _broken(folder, tmp_path, change):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    change(broken)
    with pytest.raises(ModelLoadError) as info:
        load_wan(str(broken), resolution=RESOLUTION, num_frames=NUM_FRAMES, t5_max_length=8)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    return message


@pytest.mark.parametrize("remove", ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"])
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
            "not a WanTransformer3DModel",
        ),
        (
            lambda r: _rewrite_json(r / "transformer" / "config.json", image_dim=8),
            "image_dim",
        ),
        (
            lambda r: _rewrite_json(r / "vae" / "config.json", z_dim=8),
            "not its VAE's 8 latent channels",
        ),
        (
            lambda r: _rewrite_json(
                r / "scheduler" / "scheduler_config.json", _class_name="DDIMScheduler"
            ),
            "describes a DDIMScheduler",
        ),
        (
            lambda r: _rewrite_json(
                r / "scheduler" / "scheduler_config.json", use_flow_sigmas=False
            ),
            "does not set use_flow_sigmas=true",
        ),
        (
            lambda r: _rewrite_json(r / "scheduler" / "scheduler_config.json", flow_shift=0),
            "it must be a number > 0",
        ),
        (
            lambda r: [
                p.write_bytes(p.read_bytes()[:-100])
                for p in sorted((r / "transformer").glob("*-00002-*.safetensors"))
            ],
            "damaged or truncated",
        ),
        (
            lambda r: _rewrite_json(r / "text_encoder" / "config.json", d_model=24),
            "has d_model 24, but the transformer's text_dim is 16",
        ),
    ],
)
def test_bad_folder_is_one_sentence(folder, tmp_path, change, words):
    assert words in _broken(folder, tmp_path, change)


def test_video_sizes_the_folder_cannot_make_are_one_sentence(folder):
    for options, words in (
        ({"resolution": (16, 20)}, "multiples of 8"),
        ({"num_frames": 8}, r"must be 4k \+ 1"),
    ):
        with pytest.raises(ModelLoadError, match=words):
            load_wan(str(folder), **{"resolution": RESOLUTION, "num_frames": 9, **options})


def test_the_torch_free_tiny_folder_is_what_diffusers_saves(folder, tmp_path):
    """launch/tiny_folders.py's Wan folder (written without torch) against this torch-built
    one of the same architecture: the transformer and umT5 load in their PyTorch classes with
    no missing or unexpected key, every component's keys and shapes are the same, and the VAE
    holds the decoder's half of them."""
    import importlib.util
    from pathlib import Path

    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from tree_grpo_jax.weights import files

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tiny_folders", root / "launch/tiny_folders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.main([f"--out={tmp_path}", "--kinds=wan"])["wan"]
    for name, klass in (("transformer", WanTransformer3DModel), ("text_encoder", UMT5EncoderModel)):
        _, info = klass.from_pretrained(written / name, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))

    def shapes(path, stem):
        return {k: v.shape for k, v in files.read_weights(path, stem, "").items()}

    for name, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        assert shapes(written / name, stem) == shapes(folder / name, stem), name
    ours = shapes(written / "vae", "diffusion_pytorch_model")
    theirs = shapes(folder / "vae", "diffusion_pytorch_model")
    assert ours == {k: v for k, v in theirs.items() if k.startswith(("decoder.", "post_quant"))}
    index = json.loads((written / "model_index.json").read_text())
    assert index == {
        **json.loads((folder / "model_index.json").read_text()),
        "_diffusers_version": index["_diffusers_version"],
    }
