"""FLUX.2 end to end on tiny random folders built with PyTorch (tests/flux2_fixtures.py): dev
(`Flux2Pipeline`, a Mistral 3 text encoder, the embedded guidance 4) and klein
(`Flux2KleinPipeline`, Qwen3, step-distilled so the pipeline applies no classifier-free
guidance). Each folder is a pipeline diffusers loads and samples from; the package's loader,
schedule, sampler, text and decode are compared with the pipelines' in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.base import Sampling

torch = pytest.importorskip("torch")
import family_checks  # noqa: E402
from flux2_fixtures import RESOLUTION, TEXT_WIDTH  # noqa: E402

from tree_grpo_jax.models.flux2 import transformer  # noqa: E402
from tree_grpo_jax.models.flux2.load import (  # noqa: E402
    compute_empirical_mu,
    latent_tokens,
    load_flux2,
    schedule_config,
)

# The byte tokenizer spends a token a byte: dev's system turn is ~170 tokens, so LONG is cut
# at 224; klein's template is ~35 tokens around the prompt, so LONG is cut at 64.
TEXT_TOKENS = {"dev": 224, "klein": 64}
LONG = " ".join(["a photo of a cat"] * 4)
PROMPTS = ["a photo of a cat", "two dogs", LONG]
SIDE = RESOLUTION // 4  # the tiny VAE halves a side, the patches halve it again
GUIDANCE = {"dev": 4.0, "klein": 1.0}  # dev's embedded default; klein without CFG
PIPELINES = {"dev": "Flux2Pipeline", "klein": "Flux2KleinPipeline"}


def _folder(request, variant):
    return request.getfixturevalue(f"flux2_{variant}_folder")


@pytest.fixture(scope="module")
def pipes(request):
    import diffusers

    def make(variant):
        cls = getattr(diffusers, PIPELINES[variant])
        return cls.from_pretrained(str(_folder(request, variant)), torch_dtype=torch.float32)

    return _per_variant(make)


@pytest.fixture(scope="module")
def models(request):
    def make(variant):
        return load_flux2(
            str(_folder(request, variant)),
            text_max_length=TEXT_TOKENS[variant],
            resolution=RESOLUTION,
        )

    return _per_variant(make)


def _per_variant(make):
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = make(variant)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_text_equals_encode_prompt(variant, models, pipes):
    model, pipe = models(variant), pipes(variant)
    assert model.variant == variant
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(list(PROMPTS), max_sequence_length=TEXT_TOKENS[variant])
    theirs = theirs.numpy()
    cond = np.asarray(model.encode_prompts(PROMPTS))
    assert cond.shape == theirs.shape == (3, TEXT_TOKENS[variant], TEXT_WIDTH)
    error = np.abs(cond - theirs).max() / np.abs(theirs).max()
    print(f"{variant} prompt embeddings max error relative to max |embedding|: {error:.2e}")
    np.testing.assert_allclose(cond, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    assert np.abs(theirs[0] - theirs[1]).max() > 1e-2  # the prompts differ


@pytest.mark.parametrize("tokens, steps", [(64, 4), (1024, 28), (4096, 50), (6000, 8)])
def test_schedule_equals_the_pipeline_scheduler(tokens, steps, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu as theirs_mu
    from flux2_fixtures import FLUX2

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2["scheduler"])
    mu = theirs_mu(tokens, steps)
    assert compute_empirical_mu(tokens, steps) == pytest.approx(mu, rel=1e-12)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = schedule_config(dict(scheduler.config), tmp_path, tokens)
    schedule = ours.make_schedule(steps, Sampling())
    np.testing.assert_allclose(np.asarray(schedule.sigmas), scheduler.sigmas.numpy(), atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(schedule.timesteps), scheduler.timesteps.numpy(), atol=1e-3
    )
    # a static shift replaces the empirical mu, as for the other families
    static = schedule_config(dict(scheduler.config), tmp_path, tokens, static_shift=3.0)
    assert np.abs(static.sigmas(steps) - ours.sigmas(steps)).max() > 1e-3


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_deterministic_sampler_equals_the_pipeline(variant, models, pipes):
    model, pipe = models(variant), pipes(variant)
    assert model.sample_shape == (pipe.transformer.config.in_channels, SIDE, SIDE)
    noise = np.random.default_rng(0).standard_normal((3, *model.sample_shape)).astype("f4")
    with torch.no_grad():
        expected = pipe(
            prompt=list(PROMPTS),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=4,
            guidance_scale=GUIDANCE[variant],
            latents=torch.from_numpy(noise),
            output_type="latent",
            max_sequence_length=TEXT_TOKENS[variant],
        ).images.numpy()
    schedule = model.make_schedule(4, Sampling())
    got = rollout.sample_deterministic(
        model.denoise, model.params, model.encode_prompts(PROMPTS), jnp.asarray(noise), schedule
    )
    if variant == "klein":
        # klein's pipeline returns its latents denormalised and unpatched: ours the same way
        expected_noise = _denormalised(pipe, noise)
        got = _denormalised(pipe, np.asarray(got))
    else:  # dev's returns the packed tokens
        expected_noise = np.asarray(latent_tokens(jnp.asarray(noise)))
        got = np.asarray(latent_tokens(got))
    scale = np.abs(expected).max()
    diff = np.abs(got - expected).max()
    print(f"{variant} sampler max abs difference {diff:.2e}, latents up to {scale:.2f}")
    assert diff <= 1e-5 * max(1.0, scale), diff
    assert np.abs(expected - expected_noise).max() > 0.1  # the steps moved them


EDIT_SIDE = 64  # the pipelines take references of at least 64 pixels a side


@pytest.fixture(scope="module")
def editing_models(request):
    def make(variant):
        return load_flux2(
            str(_folder(request, variant)),
            text_max_length=TEXT_TOKENS[variant],
            resolution=RESOLUTION,
            reference_images=1,
            reference_resolution=EDIT_SIDE,
        )

    return _per_variant(make)


@pytest.mark.parametrize("variant, cfg", [("dev", 1.0), ("klein", 1.0), ("klein", 4.0)])
def test_editing_sampler_equals_the_pipeline(variant, cfg, editing_models, models, pipes):
    """One reference image (the pipelines' `image=`): our deterministic sampler over the
    editing conditioning (text, then the reference rows) against the pipeline's latents.
    With classifier-free guidance (`cfg`, klein base's: the folder is marked undistilled
    for it) the empty prompt's pass keeps the prompt's reference, as the pipeline's does."""
    from PIL import Image

    model, pipe = editing_models(variant), pipes(variant)
    assert model.takes_input_images and model.input_image_size == (EDIT_SIDE, EDIT_SIDE)
    assert model.unconditional_rows == TEXT_TOKENS[variant]
    picture = np.random.default_rng(5).integers(0, 256, (EDIT_SIDE, EDIT_SIDE, 3), np.uint8)
    noise = np.random.default_rng(0).standard_normal((3, *model.sample_shape)).astype("f4")
    distilled = pipe.config.get("is_distilled")
    if cfg != 1.0:
        pipe.register_to_config(is_distilled=False)
    try:
        with torch.no_grad():
            expected = pipe(
                prompt=list(PROMPTS),
                image=Image.fromarray(picture),
                height=RESOLUTION,
                width=RESOLUTION,
                num_inference_steps=4,
                guidance_scale=GUIDANCE[variant] if cfg == 1.0 else cfg,
                latents=torch.from_numpy(noise),
                output_type="latent",
                max_sequence_length=TEXT_TOKENS[variant],
            ).images.numpy()
    finally:
        if cfg != 1.0:
            pipe.register_to_config(is_distilled=distilled)
    schedule = model.make_schedule(4, Sampling())
    cond = model.encode_prompts(PROMPTS, input_images=[[picture]] * len(PROMPTS))
    assert cond.shape == (3, TEXT_TOKENS[variant] + (EDIT_SIDE // 4) ** 2, TEXT_WIDTH)
    uncond = model.encode_prompts([""])[0][: model.unconditional_rows] if cfg != 1.0 else None
    got = rollout.sample_deterministic(
        model.denoise, model.params, cond, jnp.asarray(noise), schedule, uncond=uncond,
        guidance_scale=cfg,
    )  # fmt: skip
    plain = rollout.sample_deterministic(
        model.denoise, model.params, models(variant).encode_prompts(PROMPTS), jnp.asarray(noise),
        schedule,
    )  # fmt: skip
    if variant == "klein":
        got, plain = _denormalised(pipe, np.asarray(got)), _denormalised(pipe, np.asarray(plain))
    else:
        got, plain = np.asarray(latent_tokens(got)), np.asarray(latent_tokens(plain))
    scale = np.abs(expected).max()
    diff = np.abs(got - expected).max()
    print(f"{variant} editing sampler max abs difference {diff:.2e}, latents up to {scale:.2f}")
    assert diff <= 1e-5 * max(1.0, scale), diff
    assert np.abs(plain - expected).max() > 1e-2  # the reference image changed the result


def _denormalised(pipe, latents):
    """[B, 4C, h, w] -> [B, C, 2h, 2w]: the batch-norm statistics undone and the patches
    unpacked by the pipeline's own code."""
    z = torch.from_numpy(np.array(latents))
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return pipe._unpatchify_latents(z * std + mean).numpy()


def test_decode_equals_the_pipeline(models, pipes):
    """The pipeline's last steps (tokens scattered by their ids, the batch-norm statistics
    undone, the patches unpacked, the VAE, the image processor) against `model.decode`."""
    model, pipe = models("klein"), pipes("klein")
    latents = np.random.default_rng(1).standard_normal((2, *model.sample_shape)).astype("f4")
    with torch.no_grad():
        tokens = latent_tokens(jnp.asarray(latents))
        ids = torch.from_numpy(transformer.image_ids(SIDE, SIDE)).long()[None].expand(2, -1, -1)
        z = pipe._unpack_latents_with_ids(torch.from_numpy(np.array(tokens)), ids)
        z = torch.from_numpy(_denormalised(pipe, z.numpy()))
        image = pipe.vae.decode(z, return_dict=False)[0]
        expected = pipe.image_processor.postprocess(image, output_type="np")
    got = np.asarray(model.decode(jnp.asarray(latents)))
    assert got.shape == expected.shape == (2, RESOLUTION, RESOLUTION, 3)
    print(f"decode max abs difference {np.abs(got - expected).max():.2e}")
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert np.abs(got[0] - got[1]).max() > 1e-2


def _pytorch_velocity(pt_transformer, x, cond, sigma, guidance):
    """diffusers' transformer as the pipelines call it, on our latent grid; tokens back."""
    batch, _, rows, columns = x.shape
    ids = torch.from_numpy(transformer.image_ids(rows, columns))[None].expand(batch, -1, -1)
    txt = torch.from_numpy(transformer.text_ids(cond.shape[1]))[None].expand(batch, -1, -1)
    with torch.no_grad():
        out = pt_transformer(
            hidden_states=torch.from_numpy(np.array(latent_tokens(jnp.asarray(x)))),
            encoder_hidden_states=torch.from_numpy(cond),
            timestep=torch.from_numpy(sigma),
            img_ids=ids,
            txt_ids=txt,
            guidance=None if guidance is None else torch.full((batch,), guidance),
            return_dict=False,
        )[0]
    return out.numpy()


def _our_velocity(model, params, x, cond, sigma):
    out = jax.jit(model.denoise)(
        params, jnp.asarray(x), jnp.asarray(sigma) * 1000.0, jnp.asarray(cond)
    )
    return np.asarray(latent_tokens(out))


def _velocity_inputs(seed, model, variant):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *model.sample_shape)).astype("f4")
    cond = rng.standard_normal((2, TEXT_TOKENS[variant], TEXT_WIDTH)).astype("f4")
    return x, cond, np.array([0.9, 0.25], "f4")


def _train_and_export(variant, folder, model, tmp_path):
    """The family's end-to-end run: TreeGRPO trains one iteration on the tiny folder without
    torch, the export loads in PyTorch and computes what the trained params compute."""
    from diffusers import Flux2Transformer2DModel

    from tree_grpo_jax.models import registry

    assert registry.family_of_folder(str(folder)).name == "flux2"
    workdir, out = tmp_path / "run", tmp_path / "exported"
    overrides = [
        "--config.model.name=flux2",
        f"--config.model.path={folder}",
        f"--config.model.flux2.resolution={RESOLUTION}",
        f"--config.model.flux2.text_max_length={TEXT_TOKENS[variant]}",
        "--config.eval.num_steps=0",  # the training steps, not the release's evaluation steps
        "--config.tree.window=1",
        "--config.train.rows_per_minibatch=2",
    ]
    config = (
        "configs/flux2_klein_treegrpo.py" if variant == "klein" else "configs/flux2_treegrpo.py"
    )
    family_checks.train_one_iteration_without_torch(
        config, workdir, overrides, released="prompts encoded ahead; text encoder released"
    )
    trained = family_checks.export_the_trained_params(workdir, out, model.params)
    pt = Flux2Transformer2DModel.from_pretrained(str(out / "transformer")).eval()
    x, cond, sigma = _velocity_inputs(3, model, variant)
    expected = _pytorch_velocity(pt, x, cond, sigma, model.guidance)
    got = _our_velocity(model, trained, x, cond, sigma)
    diff = np.abs(got - expected).max()
    moved = np.abs(got - _our_velocity(model, model.params, x, cond, sigma)).max()
    print(f"{variant} exported velocity max abs difference {diff:.2e} (up to "
          f"{np.abs(expected).max():.2f}; the iteration moved it by {moved:.2e})")  # fmt: skip
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max()) and moved > 100 * diff
    assert (out / "text_encoder").is_dir() and (out / "model_index.json").is_file()


def test_a_klein_treegrpo_iteration_and_the_export_pytorch_loads(
    flux2_klein_folder, models, tmp_path
):
    _train_and_export("klein", flux2_klein_folder, models("klein"), tmp_path)


@pytest.mark.slow  # a second training process, about as long as klein's
def test_a_dev_treegrpo_iteration_and_the_export_pytorch_loads(flux2_dev_folder, models, tmp_path):
    _train_and_export("dev", flux2_dev_folder, models("dev"), tmp_path)


def test_lora_export_loads_into_the_pipeline(models, pipes, tmp_path):
    from tree_grpo_jax import lora
    from tree_grpo_jax.models import registry

    model, pipe = models("klein"), pipes("klein")
    family = registry.family_of("flux2")
    paths = lora.target_paths(model.params, family.lora_targets)
    names = ["/".join(map(str, p)) for p in paths]
    assert any("single_transformer_blocks" in n and "to_qkv_mlp_proj" in n for n in names)
    assert any("single_transformer_blocks" in n and n.endswith("attn/to_out/kernel") for n in names)
    assert not any("add_" in n or "ff" in n.split("/") for n in names)
    factors = family_checks.random_lora(model.params, paths)
    assert family.export.list_names == transformer.MODULE_LISTS
    out = family_checks.export_lora(
        factors, family, tmp_path / "lora", list_names=transformer.MODULE_LISTS
    )
    x, cond, sigma = _velocity_inputs(4, model, "klein")
    expected = family_checks.with_lora_loaded(
        pipe, out, lambda pt: _pytorch_velocity(pt, x, cond, sigma, None)
    )
    got = _our_velocity(model, family_checks.merged(model.params, factors), x, cond, sigma)
    base = _our_velocity(model, model.params, x, cond, sigma)
    diff = np.abs(got - expected).max()
    print(f"LoRA velocity max abs difference {diff:.2e}, moved {np.abs(expected - base).max():.2e}")
    assert np.abs(expected - base).max() > 1e-2  # the adapter is not a no-op
    assert diff <= 3e-5 * max(1.0, np.abs(expected).max())


def test_the_plan_shapes_are_the_loaded_models(flux2_klein_folder, models):
    from tree_grpo_jax.models import registry
    from tree_grpo_jax.models.flux2.abstract import abstract_flux2

    model = models("klein")
    assert registry.family_of_folder(str(flux2_klein_folder)).name == "flux2"
    assert not registry.family_of("flux").recognizes(flux2_klein_folder)
    planned = abstract_flux2(
        str(flux2_klein_folder), text_max_length=TEXT_TOKENS["klein"], resolution=RESOLUTION
    )
    assert planned.sample_shape == model.sample_shape
    assert planned.cond_shape == model.encode_prompts(["a cat"]).shape[1:]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), planned.params)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), model.params)
    assert planned.schedule_config == model.schedule_config
    latents = jnp.zeros((1, *model.sample_shape))
    assert jax.eval_shape(planned.decode, planned.decode_params, latents).shape == (
        1, RESOLUTION, RESOLUTION, 3,
    )  # fmt: skip


@pytest.mark.parametrize(
    "variant, kind",
    [pytest.param("dev", "flux2", marks=pytest.mark.slow), ("klein", "flux2-klein")],
)
def test_the_torch_free_tiny_folders_are_the_fixtures_architecture(variant, kind, models, tmp_path):
    """launch/tiny_folders.py's folders (written without torch) hold the fixtures'
    architecture: the transformer and the whole VAE load in diffusers' classes with every
    key, the text encoder and VAE decoder in our loader with the fixture's shapes, and the
    text path is the variant's."""
    import json

    from diffusers import Flux2Transformer2DModel

    from launch import tiny_folders

    folder = tiny_folders.main([f"--out={tmp_path}", f"--kinds={kind}"])[kind]
    _, info = Flux2Transformer2DModel.from_pretrained(
        str(folder / "transformer"), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    written = load_flux2(str(folder), text_max_length=TEXT_TOKENS[variant], resolution=RESOLUTION)
    fixture = models(variant)
    assert written.variant == variant
    fields = {k: v for k, v in written.transformer_config.items() if not k.startswith("_")}
    assert fields == {k: fixture.transformer_config[k] for k in fields}

    def shapes(tree):
        return jax.tree_util.tree_map(lambda x: x.shape, tree)

    assert shapes(written.params) == shapes(fixture.params)
    assert shapes(written.decode.params) == shapes(fixture.decode.params)
    assert shapes(written.text_encoders.params) == shapes(fixture.text_encoders.params)
    assert written.encode_prompts(["a cat"]).shape == fixture.encode_prompts(["a cat"]).shape
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[variant]
    # the whole VAE, encoder included: diffusers' class reads every key
    from diffusers import AutoencoderKLFlux2

    _, info = AutoencoderKLFlux2.from_pretrained(str(folder / "vae"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
