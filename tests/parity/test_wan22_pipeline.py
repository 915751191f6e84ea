"""Wan2.2 in the Wan family, on tiny random folders built with PyTorch (tests/wan_fixtures.py):
TI2V-5B's layout (Wan2.2's VAE, 16x -> here 8x with 2x2 pixel patches, and WanPipeline's
`expand_timesteps`) and T2V-A14B's (two experts switching at `boundary_ratio`). The
deterministic sampler against `WanPipeline(latents=..., output_type="latent")`, the decode
against `vae.decode`, the experts' per-row choice against each PyTorch expert, the export
through `WanPipeline.from_pretrained` (with `transformer_2`), and the built-in releases'
parameter counts against diffusers' classes built on the meta device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
from wan_fixtures import TEXT_WIDTH  # noqa: E402

from launch.tiny_architectures import WAN22, WAN22_LATENT_CHANNELS, WAN22_MOE  # noqa: E402
from tree_grpo_jax.models.wan.load import EXPERTS, load_wan  # noqa: E402

PROMPTS = ["a photo of a cat", "a dog and a cat"]
T5_TOKENS = 8
NUM_FRAMES = 9  # 3 latent frames
RESOLUTION_22 = (32, 32)  # 8 pixels per latent: 4 x 4 latents, 2 x 2 tokens a frame
RESOLUTION_MOE = (16, 32)  # Wan2.1's tiny VAE: 4 pixels per latent
LATENTS_22 = (3, 4, 4, WAN22_LATENT_CHANNELS)
LATENTS_MOE = (3, 4, 8, 4)


def _folder(tmp_path_factory, name, table):
    from wan_fixtures import make_tiny_wan_folder

    return make_tiny_wan_folder(tmp_path_factory.mktemp(name), table=table)


@pytest.fixture(scope="module")
def folder22(tmp_path_factory):
    return _folder(tmp_path_factory, "tiny_wan22", WAN22)


@pytest.fixture(scope="module")
def folder_moe(tmp_path_factory):
    return _folder(tmp_path_factory, "tiny_wan22_moe", WAN22_MOE)


def _pipe(folder):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


def _channels_first(x):
    return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 4, 1, 2, 3)


def _channels_last(x):
    return x.permute(0, 2, 3, 4, 1).numpy()


def _pipeline_latents(pipe, noise, resolution, sigmas, guidance):
    """The pipeline's sampler with the Euler scheduler on our sigmas (`euler_scheduler`)."""
    from wan_fixtures import euler_scheduler

    with euler_scheduler(pipe, sigmas), torch.no_grad():
        out = pipe(
            PROMPTS,
            negative_prompt="",
            height=resolution[0],
            width=resolution[1],
            num_frames=NUM_FRAMES,
            num_inference_steps=len(sigmas) - 1,
            guidance_scale=guidance,
            latents=_channels_first(noise),
            output_type="latent",
            max_sequence_length=T5_TOKENS,
        ).frames
    return _channels_last(out)


def _torch_expert(pipe, name, x, t, context):
    """The pipeline's expert `name` (transformer or transformer_2) on channels-last `x`."""
    with torch.no_grad():
        out = getattr(pipe, name)(
            hidden_states=_channels_first(x),
            timestep=torch.from_numpy(t),
            encoder_hidden_states=torch.from_numpy(context),
        ).sample
    return _channels_last(out)


def _each_row_equals_its_expert(got, pipe, x, t, context):
    """Row i of `got` is what expert EXPERTS[i] gives on row i (rows on both sides)."""
    for row, name in enumerate(EXPERTS):
        rows = slice(row, row + 1)
        expected = _torch_expert(pipe, name, x[rows], t[rows], context[rows])[0]
        scale = max(1.0, np.abs(expected).max())
        np.testing.assert_allclose(got[row], expected, atol=1e-5 * scale)


def _ours(model, noise, schedule, guidance):
    return np.asarray(
        rollout.sample_deterministic(
            model.denoise,
            model.params,
            model.encode_prompts(PROMPTS),
            jnp.asarray(noise),
            schedule,
            uncond=model.encode_prompts([""])[0],
            guidance_scale=guidance,
        )
    )


@pytest.mark.slow
def test_ti2v_sampler_and_decode_equal_the_pipeline(folder22):
    """Text to video on TI2V-5B's layout: the pipeline's `expand_timesteps` gives every token
    the step's timestep (no first frame to hold clean), which is our one timestep a row."""
    model = load_wan(
        str(folder22), resolution=RESOLUTION_22, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS
    )
    assert model.sample_shape == LATENTS_22
    pipe = _pipe(folder22)
    assert pipe.config.expand_timesteps and pipe.vae.config.is_residual
    noise = np.random.default_rng(0).standard_normal((2, *LATENTS_22)).astype("f4")
    schedule = model.make_schedule(4, Sampling())
    sigmas = np.asarray(schedule.sigmas, np.float64)
    expected = _pipeline_latents(pipe, noise, RESOLUTION_22, sigmas, 5.0)
    got = _ours(model, noise, schedule, 5.0)
    diff = np.abs(got - expected).max()
    print(
        f"TI2V sampler: max abs difference {diff:.2e} (latents up to {np.abs(expected).max():.2f})"
    )
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    assert np.abs(expected - noise).max() > 0.1

    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():  # as WanPipeline decodes
        videos = vae.decode(_channels_first(expected) / inverse_std + mean).sample
    reference = (videos.clamp(-1, 1) / 2 + 0.5).permute(0, 2, 3, 4, 1).numpy()
    decoded = np.asarray(model.decode(jnp.asarray(expected)))
    assert decoded.shape == reference.shape == (2, NUM_FRAMES, *RESOLUTION_22, 3)
    diff = np.abs(decoded - reference).max()
    print(f"TI2V decode: max abs difference {diff:.2e}")
    assert diff <= 1e-5 * np.abs(reference).max(), diff
    assert np.abs(reference[0] - reference[1]).max() > 0.05


@pytest.fixture(scope="module")
def moe(folder_moe):
    model = load_wan(
        str(folder_moe), resolution=RESOLUTION_MOE, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS
    )
    return model, _pipe(folder_moe)


@pytest.mark.slow
def test_two_expert_sampler_equals_the_pipeline(moe):
    """The boundary (875) falls inside the 4 steps (1000, 900 | 750, 500): both experts run,
    and they differ."""
    model, pipe = moe
    assert set(model.params) == set(EXPERTS) and pipe.config.boundary_ratio == 0.875
    noise = np.random.default_rng(1).standard_normal((2, *LATENTS_MOE)).astype("f4")
    schedule = model.make_schedule(4, Sampling())
    sigmas = np.asarray(schedule.sigmas, np.float64)
    assert (1000 * sigmas[:-1] >= 875).sum() == 2
    expected = _pipeline_latents(pipe, noise, RESOLUTION_MOE, sigmas, 5.0)
    got = _ours(model, noise, schedule, 5.0)
    diff = np.abs(got - expected).max()
    print(
        f"two experts: max abs difference {diff:.2e} (latents up to {np.abs(expected).max():.2f})"
    )
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    # One expert throughout gives other latents: the switch is checked.
    single = {name: model.params[EXPERTS[0]] for name in EXPERTS}
    alone = np.asarray(
        rollout.sample_deterministic(
            model.denoise,
            single,
            model.encode_prompts(PROMPTS),
            jnp.asarray(noise),
            schedule,
            uncond=model.encode_prompts([""])[0],
            guidance_scale=5.0,
        )
    )
    assert np.abs(alone - expected).max() > 1e-2


@pytest.mark.slow
def test_a_mixed_batch_takes_each_rows_expert(moe):
    """Rows on both sides of the boundary in one call (a train step's minibatch): each row
    gets its own expert's velocity, as the PyTorch expert of its side gives it."""
    model, pipe = moe
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, *LATENTS_MOE)).astype("f4")
    t = np.array([930.0, 210.0, 875.0], "f4")  # high, low, high (the boundary is inclusive)
    context = rng.standard_normal((3, 5, TEXT_WIDTH)).astype("f4")
    got = np.asarray(jax.jit(model.denoise)(model.params, x, t, context))
    high, low = (_torch_expert(pipe, name, x, t, context) for name in EXPERTS)
    expected = np.stack([high[0], low[1], high[2]])
    scale = max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(got, expected, atol=1e-5 * scale)
    assert np.abs(high - low).max() > 1e-2  # the experts differ
    # Gradients reach each expert only through its own rows.
    grads = jax.grad(lambda p: jnp.sum(model.denoise(p, x[1:2], t[1:2], context[1:2]) ** 2))(
        model.params
    )
    norms = {
        k: sum(float(jnp.abs(g).sum()) for g in jax.tree_util.tree_leaves(v))
        for k, v in grads.items()
    }
    assert norms["transformer"] == 0.0 and norms["transformer_2"] > 0.0


@pytest.mark.slow
def test_the_two_expert_export_loads_in_the_pipeline(folder_moe, moe, tmp_path):
    from diffusers import WanPipeline

    from tree_grpo_jax.models import export, registry

    model, _ = moe
    family = registry.family_of_folder(str(folder_moe))
    base, denoiser = family.export.base_denoiser(str(folder_moe))
    leaves, tree = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    moved = [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    params = jax.tree_util.tree_unflatten(tree, moved)
    out = export.export_pipeline(params, base, denoiser, tmp_path / "exported")
    loaded = WanPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    assert loaded.transformer_2 is not None and loaded.config.boundary_ratio == 0.875
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, *LATENTS_MOE)).astype("f4")
    t = np.array([930.0, 210.0], "f4")
    context = rng.standard_normal((2, 5, TEXT_WIDTH)).astype("f4")
    got = np.asarray(jax.jit(model.denoise)(params, x, t, context))
    _each_row_equals_its_expert(got, loaded, x, t, context)


@pytest.mark.parametrize("name, billions", [("wan2.2-ti2v-5b", 5.0), ("wan2.2-t2v-a14b", 28.6)])
def test_the_builtin_releases_hold_diffusers_parameters(name, billions):
    """The plan's params (both experts for A14B) and decoder params equal diffusers'
    `WanTransformer3DModel` and `AutoencoderKLWan` decoder built from the same configs."""
    import diffusers
    import ml_collections

    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.wan.builtin import RELEASES

    section = ml_collections.ConfigDict(
        {"name": "wan", "path": f"builtin:{name}", "compute_dtype": "bfloat16"}
    )
    section.wan = registry.family_of("wan").options()
    planned = registry.abstract_model(section)
    configs = RELEASES[name].configs
    experts = [f for f in ("transformer", "transformer_2") if f"{f}/config.json" in configs]
    with torch.device("meta"):
        theirs = sum(
            sum(
                p.numel()
                for p in diffusers.WanTransformer3DModel.from_config(
                    dict(configs[f"{f}/config.json"])
                ).parameters()
            )
            for f in experts
        )
        vae = diffusers.AutoencoderKLWan.from_config(dict(configs["vae/config.json"]))
    ours = sum(x.size for x in jax.tree_util.tree_leaves(planned.params))
    assert ours == theirs and round(theirs / 1e8) / 10 == billions, (ours, theirs)
    decoder = sum(
        p.numel() for n, p in vae.named_parameters() if n.startswith(("decoder.", "post_quant"))
    )
    assert sum(x.size for x in jax.tree_util.tree_leaves(planned.decode_params)) == decoder
    if name == "wan2.2-ti2v-5b":
        assert planned.sample_shape == (21, 30, 52, 48)  # 81 frames at 480 x 832, 16x
    else:
        assert set(planned.params) == set(EXPERTS) and planned.sample_shape == (21, 60, 104, 16)


def test_a_lora_of_two_experts_is_refused_as_one_peft_file(tmp_path):
    from tree_grpo_jax import lora

    factor = {
        "blocks_0": {"attn1": {"to_q": {"lora_a": np.zeros((4, 2)), "lora_b": np.zeros((2, 4))}}}
    }
    with pytest.raises(ValueError, match=r"transformer, transformer_2, one adapter per component"):
        lora.export_lora({name: factor for name in EXPERTS}, "transformer", 2, 2.0, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_lora_on_both_experts_merges_and_exports(folder_moe, moe, tmp_path):
    """LoRA's default targets choose both experts' attention; merged up front, attached
    block by block, and merged onto the base read from the folder (export --merge) they give
    one model, which WanPipeline loads with both experts."""
    from diffusers import WanPipeline

    from tree_grpo_jax import lora
    from tree_grpo_jax.models import export, registry

    model, _ = moe
    family = registry.family_of("wan")
    paths = lora.target_paths(model.params, family.lora_targets)
    assert {p[0] for p in paths} == set(EXPERTS)
    factors = lora.init_lora(jax.random.PRNGKey(0), model.params, paths, rank=2)
    factors = jax.tree_util.tree_map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(1), x.shape), factors
    )
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, *LATENTS_MOE)).astype("f4")
    t = np.array([930.0, 210.0], "f4")
    context = rng.standard_normal((2, 5, TEXT_WIDTH)).astype("f4")
    denoise = jax.jit(model.denoise)
    merged = np.asarray(denoise(lora.merge(model.params, factors, 4.0, 2), x, t, context))
    attached = np.asarray(denoise(lora.attach(model.params, factors, 4.0, 2), x, t, context))
    base = np.asarray(denoise(model.params, x, t, context))
    np.testing.assert_allclose(attached, merged, atol=1e-5 * max(1.0, np.abs(merged).max()))
    assert np.abs(merged[0] - base[0]).max() > 1e-3 and np.abs(merged[1] - base[1]).max() > 1e-3
    base_folder, denoiser = family.export.base_denoiser(str(folder_moe))
    on_folder = lora.merge(family.export.base_params(str(folder_moe)), factors, 4.0, 2)
    out = export.export_pipeline(on_folder, base_folder, denoiser, tmp_path / "merged")
    loaded = WanPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    _each_row_equals_its_expert(merged, loaded, x, t, context)


@pytest.fixture(scope="module")
def written_moe(tmp_path_factory):
    """launch/tiny_folders.py's two-expert folder (written without torch)."""
    from launch import tiny_folders

    out = tmp_path_factory.mktemp("written")
    return tiny_folders.main([f"--out={out}", "--kinds=wan22-moe"])["wan22-moe"]


def _rewrite(path, **changes):
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda r: __import__("shutil").rmtree(r / "transformer_2"), "has no transformer_2/"),
        (
            lambda r: _rewrite(r / "transformer_2" / "config.json", num_layers=3),
            "transformer/ and transformer_2/ configs differ in num_layers",
        ),
        (lambda r: _rewrite(r / "model_index.json", boundary_ratio=1.5), "must be a number in"),
    ],
)
def test_bad_two_expert_folders_are_one_sentence(written_moe, tmp_path, change, words):
    import shutil

    from tree_grpo_jax.models.base import ModelLoadError
    from tree_grpo_jax.models.wan.abstract import abstract_wan

    broken = tmp_path / "broken"
    shutil.copytree(written_moe, broken)
    change(broken)
    options = dict(resolution=RESOLUTION_MOE, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS)
    for loader in (load_wan, abstract_wan):
        with pytest.raises(ModelLoadError, match=words) as info:
            loader(str(broken), **options)
        assert "\n" not in str(info.value) and str(info.value).endswith(".")


# ---------------------------------------------------------------------------------------------
# Image to video on TI2V-5B's layout: `WanImageToVideoPipeline` with `expand_timesteps` (the
# path diffusers takes for TI2V-5B given an image).


def _i2v_pipeline_latents(pipe, image, noise, sigmas, guidance):
    from diffusers import WanImageToVideoPipeline
    from wan_fixtures import image_to_video_latents

    i2v = WanImageToVideoPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        transformer=pipe.transformer,
        expand_timesteps=True,
    )
    return image_to_video_latents(
        i2v, image, noise, sigmas, prompts=PROMPTS, resolution=RESOLUTION_22,
        num_frames=NUM_FRAMES, tokens=T5_TOKENS, guidance=guidance,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ti2v(folder22):
    model = load_wan(
        str(folder22), resolution=RESOLUTION_22, num_frames=NUM_FRAMES, t5_max_length=T5_TOKENS
    )
    return model, _pipe(folder22)


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_image_to_video_sampler_equals_the_pipeline(ti2v, guidance):
    """The first frame given (an image of another size, resized as the pipeline does): its
    latents held as the first latent frame, its tokens at timestep 0, the guidance's
    unconditional pass sharing it; the deterministic sampler ends on the pipeline's latents,
    the first frame included."""
    model, pipe = ti2v
    assert model.takes_input_images and model.unconditional_rows == T5_TOKENS
    image = np.random.default_rng(5).integers(0, 256, (40, 24, 3), dtype=np.uint8)
    noise = np.random.default_rng(0).standard_normal((2, *LATENTS_22)).astype("f4")
    schedule = model.make_schedule(4, Sampling())
    sigmas = np.asarray(schedule.sigmas, np.float64)
    expected = _i2v_pipeline_latents(pipe, image, noise, sigmas, guidance)
    cond = model.encode_prompts(PROMPTS, input_images=[[image], [image]])
    assert cond.shape[1] > T5_TOKENS  # the first frame's rows follow the text's
    uncond = model.encode_prompts([""])[0][: model.unconditional_rows]
    got = np.asarray(
        rollout.sample_deterministic(
            model.denoise,
            model.params,
            cond,
            jnp.asarray(noise),
            schedule,
            uncond=uncond if guidance != 1.0 else None,
            guidance_scale=guidance,
        )
    )
    diff = np.abs(got - expected).max()
    scale = np.abs(expected).max()
    print(f"I2V sampler, guidance {guidance}: max abs difference {diff:.2e} (up to {scale:.2f})")
    assert diff <= 1e-5 * max(1.0, scale), diff
    # The image shaped every frame: text-to-video from the same noise differs.
    text_only = _ours(model, noise, schedule, 5.0) if guidance != 1.0 else None
    if text_only is None:
        text_only = np.asarray(
            rollout.sample_deterministic(
                model.denoise, model.params, model.encode_prompts(PROMPTS), jnp.asarray(noise),
                schedule,
            )
        )  # fmt: skip
    assert np.abs(expected[:, 1:] - text_only[:, 1:]).max() > 0.05
    assert np.abs(expected[:, 0] - expected[:, 1]).max() > 0.05


def test_first_frame_rows_pack_and_unpack():
    from tree_grpo_jax.models.wan.load import (
        first_frame_rows,
        pack_first_frames,
        unpack_first_frames,
    )

    rng = np.random.default_rng(0)
    text = rng.standard_normal((2, 3, 10)).astype("f4")
    first = rng.standard_normal((2, 2, 2, 3)).astype("f4")
    cond = pack_first_frames(text, first, [1.0, 0.0])
    assert first_frame_rows((2, 2, 3), 10) == 2 and cond.shape == (2, 5, 10)
    got_text, got_first, given = unpack_first_frames(jnp.asarray(cond), 3, (2, 2, 3))
    np.testing.assert_array_equal(np.asarray(got_text), text)
    np.testing.assert_array_equal(np.asarray(got_first), first)
    assert np.asarray(given).tolist() == [True, False]


def test_the_torch_free_ti2v_vae_holds_the_encoder(folder22, tmp_path):
    """launch/tiny_folders.py's wan22 VAE (written without torch) holds the keys and shapes
    of diffusers' `AutoencoderKLWan`, the encoder's included, but the temporal time convs
    that a lone first frame never reaches."""
    import importlib.util
    from pathlib import Path

    from tree_grpo_jax.weights import files

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tiny_folders", root / "launch/tiny_folders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.main([f"--out={tmp_path}", "--kinds=wan22"])["wan22"]

    def shapes(path):
        return {
            k: v.shape for k, v in files.read_weights(path, "diffusion_pytorch_model", "").items()
        }

    theirs = shapes(folder22 / "vae")
    expected = {
        k: v for k, v in theirs.items() if not (k.startswith("encoder.") and ".time_conv." in k)
    }
    assert any(k.startswith("encoder.") for k in expected)
    assert shapes(written / "vae") == expected
