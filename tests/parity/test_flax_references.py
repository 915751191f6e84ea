"""The package's UNet (with `unet.FLAX_NUMERICS`), VAE and CLIP against what diffusers' and
transformers' former Flax classes computed, as tests/fixtures/flax_references.npz recorded it
(tests/flax_references.py says how; tests/fixtures/make_flax_references.py made it): the
same parameter trees, the same initial values from the same key, and the same outputs for
the same params and inputs, in float32 and bfloat16, in train mode with the same dropout
masks. No Flax class of diffusers or transformers is needed: this runs on any stack.

Under the recording's jax, platform and XLA setting (`exact()`: jax 0.10.2 on the CPU with
the tests' JAX_DISABLE_MOST_OPTIMIZATIONS) every output and initial value is reproduced bit
for bit. Elsewhere XLA may round otherwise, so the outputs must lie within TOLERANCE of the
recorded ones, relative to the largest recorded value."""

from __future__ import annotations

import functools
import os
import platform
from importlib import metadata

import flax_references as refs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers  # CLIP's config classes
from flax.traverse_util import flatten_dict, unflatten_dict

from launch.tiny_architectures import SD15
from tree_grpo_jax.models import autoencoder_kl, clip, unet
from tree_grpo_jax.models.tiny.networks import UNET_CONFIG

MANIFEST, ARRAYS = refs.load()
# Relative to the largest recorded value, where the bits may differ. The same jax with XLA's
# optimizations on moved float32 outputs by up to 1.4e-6 and one bfloat16 output (the SD1.5
# UNet's, rounded through every layer) by 0.0126: these bounds are about twice that.
TOLERANCE = {"float32": 3e-6, "bfloat16": 0.025}


def exact() -> bool:
    """Whether this jax, platform and XLA setting are the recording's, under which every
    comparison here held bit for bit when the fixture was made."""
    recorded = MANIFEST["versions"]
    return (
        recorded["jax"] == metadata.version("jax")
        and recorded["jaxlib"] == metadata.version("jaxlib")
        and MANIFEST["jax_backend"] == jax.default_backend()
        and MANIFEST["machine"] == platform.machine()
        and MANIFEST["xla_settings"]["JAX_DISABLE_MOST_OPTIMIZATIONS"]
        == os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "")
    )


def _flat(tree) -> dict:
    return {"/".join(k): v for k, v in flatten_dict(dict(tree)).items()}


def _shapes(init, key) -> dict:
    return {name: list(s.shape) for name, s in _flat(jax.eval_shape(init, key)).items()}


def _params(case: str, tree: str, dtype=jnp.float32, leave_out=()) -> dict:
    """The case's params, drawn again over the recorded upstream tree, as a nested dict
    (without the top-level modules `leave_out`)."""
    shapes = MANIFEST["cases"][case]["trees"][tree]
    flat = refs.draw_params(shapes, refs.param_seed(case))
    kept = {tuple(k.split("/")): v for k, v in flat.items() if k.split("/")[0] not in leave_out}
    return _cast(unflatten_dict(kept), dtype)


def _cast(tree, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)


def _dtype(run: str):
    return jnp.bfloat16 if run == "bfloat16" else jnp.float32


def assert_recorded(got, case: str, run: str, name: str) -> None:
    """`got` is the recorded output: bit for bit where `exact()`, else within TOLERANCE."""
    want = ARRAYS[refs.output_key(case, run, name)]
    got = np.asarray(got, np.float32)
    where = f"{case}, {run}, {name}"
    assert got.shape == want.shape, (where, got.shape, want.shape)
    if exact():
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        atol = TOLERANCE["bfloat16" if run == "bfloat16" else "float32"] * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=where)


def assert_tree(ours: dict, case: str, tree: str) -> None:
    """Our parameter tree has the recorded names and shapes."""
    recorded = MANIFEST["cases"][case]["trees"][tree]
    missing, extra = sorted(set(recorded) - set(ours)), sorted(set(ours) - set(recorded))
    assert not missing and not extra, f"{case} {tree}: missing {missing[:5]}, extra {extra[:5]}"
    wrong = {k: (ours[k], recorded[k]) for k in recorded if list(ours[k]) != recorded[k]}
    assert not wrong, f"{case} {tree}: (ours, recorded) shapes differ: {wrong}"


def assert_initial_values(params: dict, case: str, tree: str) -> None:
    """The first values of each param our init drew are those the Flax class drew. Both
    drew them op by op, not jitted: a jitted init rounds the normal initializers' transforms
    otherwise (by about an ulp), which is no difference in the draw."""
    got = refs.init_sample(_flat(params))
    want = ARRAYS[refs.init_key(case, tree)]
    names = sorted(MANIFEST["cases"][case]["trees"][tree])
    if exact():
        differ = ~((got == want) | (np.isnan(got) & np.isnan(want))).all(axis=1)
    else:
        differ = ~np.isclose(got, want, rtol=1e-5, atol=1e-7, equal_nan=True).all(axis=1)
    assert not differ.any(), f"{case}: initial values differ in {np.asarray(names)[differ][:5]}"


def _case_runs(cases) -> list[tuple[str, str]]:
    return [(case, run) for case in cases for run in refs.runs(case)]


def _ids(cases) -> list[str]:
    return [f"{case}-{run}" for case, run in _case_runs(cases)]


def test_the_fixture_records_these_cases():
    """The fixture was made from this file's cases: the same configs, seeds and runs."""
    cases = MANIFEST["cases"]
    assert list(cases) == [*refs.UNET_CASES, *refs.VAE_CASES, *refs.CLIP_CASES]
    for case, recorded in cases.items():
        config = (
            refs.UNET_CASES[case][0]
            if case in refs.UNET_CASES
            else refs.VAE_CASES.get(case) or refs.clip_kwargs(*refs.CLIP_CASES[case])
        )
        assert recorded["config"] == config, case
        assert recorded["param_seed"] == refs.param_seed(case)
        assert recorded["input_seed"] == refs.input_seed(case)
        assert recorded["runs"] == list(refs.runs(case))
        for run in recorded["runs"]:
            assert any(k.startswith(f"{case}.{run}.") for k in ARRAYS), (case, run)


def test_the_unet_cases_are_the_package_configs():
    """The tiny demo's UNet and the tiny SD1.5 folder's, as the package builds them."""
    as_lists = lambda config: {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    assert as_lists(UNET_CONFIG) == refs.UNET_TINY
    sd15 = as_lists(SD15["unet"])
    assert sd15.pop("norm_num_groups") == 32  # the Flax class's only
    assert sd15 == refs.UNET_SD15


# ---------------------------------------------------------------------------------------------
# The UNet: diffusers' FlaxUNet2DConditionModel.


def _unet(case: str, dtype=jnp.float32, **options) -> unet.UNet2DConditionModel:
    return unet.unet_module(refs.UNET_CASES[case][0], dtype, **unet.FLAX_NUMERICS, **options)


@pytest.mark.parametrize("case", refs.UNET_CASES)
def test_unet_tree_and_initial_values(case):
    module = _unet(case)
    key = jax.random.PRNGKey(refs.INIT_SEED)
    assert_tree(_shapes(module.init_weights, key), case, "unet")
    assert_initial_values(module.init_weights(key), case, "unet")


@pytest.mark.parametrize("case, run", _case_runs(refs.UNET_CASES), ids=_ids(refs.UNET_CASES))
def test_unet_outputs(case, run):
    dtype = _dtype(run)
    options = {}
    if run == "memory_efficient":
        options = dict(use_memory_efficient_attention=True, split_head_dim=False)
    module = _unet(case, dtype, **options)
    train = run == "train"
    sample, timesteps, text = refs.unet_inputs(case)

    @jax.jit
    def apply(params, sample, text):
        rngs = {"dropout": jax.random.PRNGKey(refs.DROPOUT_SEED)} if train else None
        return module.apply({"params": params}, sample, timesteps, text, train, rngs=rngs).sample

    params = _params(case, "unet", dtype)
    out = apply(params, _cast(sample, dtype), _cast(text, dtype))
    assert out.dtype == dtype
    assert_recorded(out, case, run, "sample")


# ---------------------------------------------------------------------------------------------
# The VAE: diffusers' FlaxAutoencoderKL (always with quant convs; with identity ones it is
# the flow families' VAE, which has none).


def _vae(case: str, dtype=jnp.float32, quant: bool = True) -> autoencoder_kl.AutoencoderKL:
    config = dict(refs.VAE_CASES[case], use_quant_conv=quant, use_post_quant_conv=quant)
    return autoencoder_kl.module_from_config(config, "the test's VAE config", dtype, fixed={})


QUANT_CONVS = ("quant_conv", "post_quant_conv")


@pytest.mark.parametrize("case", refs.VAE_CASES)
def test_vae_tree_and_initial_values(case):
    module = _vae(case)
    key = jax.random.PRNGKey(refs.INIT_SEED)
    assert_tree(_shapes(module.init_weights, key), case, "vae")
    assert_initial_values(module.init_weights(key), case, "vae")
    recorded = MANIFEST["cases"][case]["trees"]["vae"]
    without = {k: v for k, v in recorded.items() if k.split("/")[0] not in QUANT_CONVS}
    assert _shapes(_vae(case, quant=False).init_weights, key) == without


@pytest.mark.parametrize("case, run", _case_runs(refs.VAE_CASES), ids=_ids(refs.VAE_CASES))
def test_vae_outputs(case, run):
    dtype = _dtype(run)
    quant = run != "identity_quant"
    module = _vae(case, dtype, quant)
    params = _params(case, "vae", dtype, leave_out=() if quant else QUANT_CONVS)
    images, latents = refs.vae_inputs(case)

    @jax.jit
    def apply(params, images, latents):
        def both(m):
            return (*m.encode(images), m.decode(latents))

        return module.apply({"params": params}, method=both)

    outputs = apply(params, _cast(images, dtype), _cast(latents, dtype))
    for name, out in zip(("mean", "logvar", "decoded"), outputs, strict=True):
        assert out.dtype == dtype, name
        assert_recorded(out, case, run, name)


# ---------------------------------------------------------------------------------------------
# CLIP: transformers' FlaxCLIPModel, FlaxCLIPTextModel and FlaxCLIPTextModelWithProjection.


@functools.cache
def _clip_config(case: str, attention_dropout: float = 0.0):
    kwargs = refs.clip_kwargs(*refs.CLIP_CASES[case])
    kwargs["text_config"] = dict(kwargs["text_config"], attention_dropout=attention_dropout)
    return transformers.CLIPConfig(**kwargs)


def _clip_inits(case: str) -> dict:
    config = _clip_config(case)
    text = config.text_config
    return {
        "model": lambda key: clip.init_clip(clip.CLIPModel(config), key),
        "text": lambda key: clip.init_text(clip.CLIPTextModel(text), key, 4),
        "text_with_projection": lambda key: clip.init_text(
            clip.CLIPTextModelWithProjection(text), key, 4
        ),
    }


@pytest.mark.parametrize("case", refs.CLIP_CASES)
def test_clip_trees_and_initial_values(case):
    key = jax.random.PRNGKey(refs.INIT_SEED)
    for tree, init in _clip_inits(case).items():
        assert_tree(_shapes(init, key), case, tree)
        assert_initial_values(init(key), case, tree)


def _text_tower(module, *inputs, **options):
    return module.text_model(*inputs, **options)


def _vision_tower(module, pixels, **options):
    return module.vision_model(pixels, **options)


@pytest.mark.parametrize("case, run", _case_runs(refs.CLIP_CASES), ids=_ids(refs.CLIP_CASES))
def test_clip_outputs(case, run):
    ids, mask, positions, pixels = refs.clip_inputs(case)
    params = _params(case, "model")
    text_params = {"text_model": params["text_model"]}
    if run == "text_dropout":
        config = _clip_config(case, refs.CLIP_ATTENTION_DROPOUT).text_config
        module = clip.CLIPTextModel(config)
        rngs = {"dropout": jax.random.PRNGKey(refs.DROPOUT_SEED)}
        out = jax.jit(
            lambda p: (
                module.apply(
                    {"params": p}, ids, mask, positions, deterministic=False, rngs=rngs
                ).last_hidden_state
            )
        )(text_params)
        assert_recorded(out, case, run, "last_hidden_state")
        return
    dtype = _dtype(run)
    config = _clip_config(case)
    both = clip.CLIPModel(config, dtype=dtype)
    text = clip.CLIPTextModel(config.text_config, dtype=dtype)
    projected = clip.CLIPTextModelWithProjection(config.text_config, dtype=dtype)

    @jax.jit
    def apply(p, pixels):
        variables = {"params": p}
        inputs = (ids, mask, positions)
        t = both.apply(variables, *inputs, output_hidden_states=True, method=_text_tower)
        v = both.apply(variables, pixels, output_hidden_states=True, method=_vision_tower)
        per_image, per_text = both.apply(variables, ids, pixels, mask, positions)
        alone = text.apply({"params": {"text_model": p["text_model"]}}, *inputs)
        with_projection = projected.apply(
            {"params": {k: p[k] for k in ("text_model", "text_projection")}}, *inputs
        )
        return {
            "text_hidden_states": jnp.stack(t.hidden_states),
            "text_last_hidden_state": t.last_hidden_state,
            "text_pooler_output": t.pooler_output,
            "vision_hidden_states": jnp.stack(v.hidden_states),
            "vision_last_hidden_state": v.last_hidden_state,
            "vision_pooler_output": v.pooler_output,
            "logits_per_image": per_image,
            "logits_per_text": per_text,
            "text_model_last_hidden_state": alone.last_hidden_state,
            "text_model_pooler_output": alone.pooler_output,
            "text_with_projection_embeds": with_projection.embeds,
        }

    outputs = apply(_cast(params, dtype), _cast(pixels, dtype))
    assert sorted(outputs) == sorted(
        k.split(".")[-1] for k in ARRAYS if k.startswith(f"{case}.{run}.")
    )
    for name, out in outputs.items():
        assert out.dtype == dtype, name
        assert_recorded(out, case, run, name)
