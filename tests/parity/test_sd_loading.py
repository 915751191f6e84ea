"""Stable Diffusion loading: a tiny random SD folder written by diffusers' and transformers'
PyTorch classes is read by our loader (without torch) and every component gives the
PyTorch outputs on the same inputs."""

import json
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import flax_references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.serialization import to_bytes
from flax.traverse_util import flatten_dict

from tree_grpo_jax.models import clip, clip_files, unet
from tree_grpo_jax.models.base import DDIMScheduleConfig, ModelLoadError, Sampling
from tree_grpo_jax.models.sd15.load import StableDiffusionModel, load_sd
from tree_grpo_jax.weights import convert

torch = pytest.importorskip("torch")

ATOL = 1e-4
PROMPTS = ["a photo of a cat", "dog", "a digit of a dog of a cat"]


@pytest.fixture(scope="module")
def folder(sd_folder):
    return sd_folder


@pytest.fixture(scope="module")
def model(sd_model):
    return sd_model


@pytest.fixture(scope="module")
def torch_parts(folder):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    return dict(
        unet=UNet2DConditionModel.from_pretrained(folder / "unet").eval(),
        vae=AutoencoderKL.from_pretrained(folder / "vae").eval(),
        text_encoder=CLIPTextModel.from_pretrained(folder / "text_encoder").eval(),
        tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer"),
    )


def _unet_inputs(model, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, *model.sample_shape)).astype(np.float32)
    t = np.array([1, 421, 981], np.int32)
    cond = rng.standard_normal((3, 16, 32)).astype(np.float32)
    return x, t, cond


def _torch_unet(unet, x, t, cond):
    with torch.no_grad():
        out = unet(torch.from_numpy(x), torch.from_numpy(t).long(), torch.from_numpy(cond))
    return out.sample.numpy()


def _diffusers_convert(torch_model, flax_module):
    """diffusers' own PyTorch->Flax converter (it needs torch), fed init shapes, not an init;
    a plain skip once diffusers has none (0.40 removed it with its Flax models)."""
    try:
        from diffusers.models.modeling_flax_pytorch_utils import (
            convert_pytorch_state_dict_to_flax,
        )
    except ImportError:
        pytest.skip("this diffusers has no PyTorch-to-Flax converter (removed in 0.40)")
    shapes_only = types.SimpleNamespace(
        init_weights=lambda key: jax.eval_shape(flax_module.init_weights, key)
    )
    return convert_pytorch_state_dict_to_flax(torch_model.state_dict(), shapes_only)


def _copy(folder, tmp_path, name="copy"):
    return Path(shutil.copytree(folder, tmp_path / name))


def test_model_fields(model, folder):
    assert isinstance(model, StableDiffusionModel)
    assert model.sample_shape == (4, 8, 8)
    assert model.schedule_config == DDIMScheduleConfig(prediction_type="epsilon")
    assert model.path == folder
    assert model.unet_config == json.loads((folder / "unet" / "config.json").read_text())
    assert model.vae_config["latent_channels"] == 4 and model.text_config["hidden_size"] == 32
    assert model.tokenizer.model_max_length == 16
    # Only UNet weights are trainable.
    assert "conv_in" in model.params and "text_model" not in model.params
    leaves = jax.tree_util.tree_leaves(model.params)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)


def test_unet_matches_torch(model, torch_parts):
    x, t, cond = _unet_inputs(model)
    ours = np.asarray(jax.jit(model.denoise)(model.params, x, t, cond))
    theirs = _torch_unet(torch_parts["unet"], x, t, cond)
    assert ours.shape == theirs.shape == x.shape
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_unet_is_diffusers_tree_with_pytorch_numerics(model, torch_parts):
    """Our UNet has diffusers' former Flax UNet's parameter tree (as tests/fixtures/ recorded
    it for this architecture); with the same params, that class's numerics (`FLAX_NUMERICS`,
    which tests/parity/test_flax_references.py shows it computed bit for bit: tanh GELU,
    GroupNorm eps 1e-5 in its transformers) are visibly further from PyTorch than ours."""
    recorded = flax_references.load()[0]["cases"]["unet_sd15"]["trees"]["unet"]
    recorded = {tuple(name.split("/")): tuple(shape) for name, shape in recorded.items()}
    assert convert.shapes_of(model.params) == recorded
    x, t, cond = _unet_inputs(model)
    theirs = _torch_unet(torch_parts["unet"], x, t, cond)
    ours = np.asarray(jax.jit(model.denoise)(model.params, x, t, cond))
    flax_numerics = unet.unet_module(model.unet_config, **unet.FLAX_NUMERICS)
    lib = np.asarray(
        jax.jit(lambda p: flax_numerics.apply({"params": p}, x, t, cond).sample)(model.params)
    )
    assert np.abs(lib - theirs).max() > 10 * np.abs(ours - theirs).max()


def test_text_encoder_matches_torch(model, torch_parts):
    tok = torch_parts["tokenizer"]
    ids = tok(PROMPTS, padding="max_length", max_length=tok.model_max_length, return_tensors="pt")
    with torch.no_grad():
        theirs = torch_parts["text_encoder"](ids.input_ids).last_hidden_state.numpy()
    ours = np.asarray(model.encode_prompts(PROMPTS))
    assert ours.dtype == np.float32 and ours.shape == (3, 16, 32)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_vae_decode_matches_torch(model, torch_parts):
    latents = np.random.default_rng(1).standard_normal((3, 4, 8, 8)).astype(np.float32) * 0.2
    vae = torch_parts["vae"]
    with torch.no_grad():
        image = vae.decode(torch.from_numpy(latents) / vae.config.scaling_factor).sample
    theirs = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    ours = np.asarray(model.decode(latents))
    assert ours.shape == (3, 16, 16, 3) and ours.dtype == np.float32
    assert ours.min() >= 0.0 and ours.max() <= 1.0
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_schedule_follows_scheduler_config(model, folder):
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_pretrained(folder / "scheduler")
    scheduler.set_timesteps(25)
    schedule = model.make_schedule(25, Sampling(eta=0.5))
    np.testing.assert_array_equal(np.asarray(schedule.timesteps), scheduler.timesteps.numpy())
    alphas = scheduler.alphas_cumprod.numpy()[scheduler.timesteps.numpy()]
    np.testing.assert_allclose(np.asarray(schedule.alpha_bar), alphas, rtol=1e-6)
    assert float(schedule.eta) == 0.5


def test_our_conversion_equals_diffusers_converter(model, torch_parts):
    """diffusers' own PyTorch->Flax converter (which needs torch) gives the same UNet tree."""
    theirs = _diffusers_convert(torch_parts["unet"], model.unet)
    ours, theirs = flatten_dict(model.params), flatten_dict(dict(theirs))
    assert set(ours) == set(theirs)
    for key in ours:
        np.testing.assert_array_equal(
            np.asarray(ours[key]), np.asarray(theirs[key]), err_msg=str(key)
        )


def test_our_text_conversion_equals_transformers_converter(folder, torch_parts):
    """transformers' own PyTorch->Flax converter (while transformers has Flax models, before
    5) gives the text encoder the same tree and values as ours."""
    try:
        from transformers import FlaxCLIPTextModel
        from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
    except ImportError:
        pytest.skip("this transformers has no PyTorch-to-Flax converter (removed in 5)")
    encoder = torch_parts["text_encoder"]
    flax_model = FlaxCLIPTextModel(encoder.config)
    theirs = flatten_dict(
        dict(convert_pytorch_state_dict_to_flax(encoder.state_dict(), flax_model))
    )
    text_shapes = clip.param_shapes(clip.init_text, clip.CLIPTextModel(encoder.config))
    state = {k: v.numpy() for k, v in encoder.state_dict().items()}
    ours = convert.pytorch_to_flax(state, convert.shapes_of(text_shapes), merge_indices=False)
    ours = flatten_dict(ours)
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        np.testing.assert_array_equal(value, np.asarray(theirs[key]), err_msg=str(key))


def test_loading_path_runs_without_torch(folder):
    """In a fresh interpreter where `import torch` fails, loading and running still work."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import jax
        import numpy as np
        from tree_grpo_jax.models.sd15.load import load_sd
        m = load_sd({str(folder)!r})
        c = m.encode_prompts(["a cat"])
        x = np.zeros((1, 4, 8, 8), np.float32)
        assert jax.jit(m.denoise)(m.params, x, np.array([10]), c).shape == x.shape
        assert m.decode(x).shape == (1, 16, 16, 3)
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def _flax_msgpack(torch_model, module_shapes: dict, path: Path, name: str, merge: bool) -> None:
    """A component's weights as the Flax msgpack file diffusers' and transformers' former
    Flax classes saved (`to_bytes` of their param tree, which is ours: test_flax_references.py
    checks the names and shapes against those classes' own)."""
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    if not merge:  # the CLIP tower's names, with `text_model.` whichever release wrote them
        state = clip_files.with_text_prefix(state)
    params = convert.pytorch_to_flax(state, convert.shapes_of(module_shapes), merge_indices=merge)
    (path / name).write_bytes(to_bytes(params))


def test_flax_weight_files_load_the_same(folder, model, torch_parts, tmp_path):
    """A folder holding only Flax msgpack files, as the Flax UNet, VAE and CLIP classes saved
    them, loads to the same params and outputs."""
    from transformers import CLIPTextConfig

    from tree_grpo_jax.models.sd15.load import vae_module

    flax_folder = _copy(folder, tmp_path)
    for path in flax_folder.glob("*/*.safetensors"):
        path.unlink()
    key = jax.random.PRNGKey(0)
    unet_shapes = jax.eval_shape(model.unet.init_weights, key)
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    vae = vae_module(vae_config, folder / "vae" / "config.json", jnp.float32)
    text_config = CLIPTextConfig.from_json_file(str(folder / "text_encoder" / "config.json"))
    text_shapes = clip.param_shapes(clip.init_text, clip.CLIPTextModel(text_config))
    for component, shapes, name, merge in (
        ("unet", unet_shapes, "diffusion_flax_model.msgpack", True),
        ("vae", jax.eval_shape(vae.init_weights, key), "diffusion_flax_model.msgpack", True),
        ("text_encoder", text_shapes, "flax_model.msgpack", False),
    ):
        _flax_msgpack(torch_parts[component], shapes, flax_folder / component, name, merge)

    loaded = load_sd(str(flax_folder))
    assert not list(flax_folder.glob("*/*.safetensors"))
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, model.params)
    np.testing.assert_allclose(
        loaded.encode_prompts(PROMPTS), model.encode_prompts(PROMPTS), atol=1e-6
    )
    latents = np.random.default_rng(2).standard_normal((2, 4, 8, 8)).astype(np.float32) * 0.2
    np.testing.assert_allclose(loaded.decode(latents), model.decode(latents), atol=1e-6)


def test_clip_files_of_either_transformers_release_encode_the_same(folder, model, tmp_path):
    """The tokenizer and text encoder as the other transformers release would have saved them
    (tokenizer.json alone or vocab.json and merges.txt; tensor names without or with
    `text_model.`) load to the same prompt embeddings."""
    from clip_fixtures import swap_text_naming, swap_tokenizer_layout

    other = _copy(folder, tmp_path)
    swap_tokenizer_layout(other / "tokenizer")
    swap_text_naming(other / "text_encoder" / "model.safetensors")
    np.testing.assert_array_equal(
        load_sd(str(other)).encode_prompts(PROMPTS), model.encode_prompts(PROMPTS)
    )


def test_bfloat16_params_and_compute(folder, model):
    bf16 = load_sd(str(folder), dtype=jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(bf16.params))
    x, t, cond = _unet_inputs(model)
    ours = np.asarray(jax.jit(bf16.denoise)(bf16.params, x, t, cond), np.float32)
    ref = np.asarray(jax.jit(model.denoise)(model.params, x, t, cond))
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert bf16.encode_prompts(PROMPTS).dtype == jnp.float32


def test_fp16_safetensors_variant(folder, model, tmp_path):
    from safetensors.numpy import load_file, save_file

    copy = _copy(folder, tmp_path)
    unet_file = copy / "unet" / "diffusion_pytorch_model.safetensors"
    half = {k: v.astype(np.float16) for k, v in load_file(unet_file).items()}
    save_file(half, copy / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    # Asked for, the variant wins over the fp32 file; alone, it is found without asking.
    chosen = load_sd(str(copy), variant="fp16").params
    unet_file.unlink()
    found = load_sd(str(copy)).params
    for params in (chosen, found):
        kernel = np.asarray(params["conv_in"]["kernel"])
        assert kernel.dtype == np.float32
        assert not np.array_equal(kernel, model.params["conv_in"]["kernel"])
        np.testing.assert_allclose(kernel, model.params["conv_in"]["kernel"], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Clear errors.


def test_missing_folder_is_one_sentence(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist \\(no such folder\\)") as err:
        load_sd(str(tmp_path / "nowhere"))
    assert "--config.model.path" in str(err.value)


def test_hub_failure_is_one_sentence(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network here")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError) as err:
        load_sd("someone/some-model")
    message = str(err.value)
    assert (
        "someone/some-model is not a folder and could not be downloaded: no network here" in message
    )
    assert "\n" not in message


@pytest.mark.parametrize("component", ["unet", "vae", "text_encoder", "tokenizer", "scheduler"])
def test_missing_component_is_named(folder, tmp_path, component):
    broken = _copy(folder, tmp_path)
    shutil.rmtree(broken / component)
    with pytest.raises(ModelLoadError, match=f"no {component}/ folder"):
        load_sd(str(broken))


def test_missing_weights_are_named(folder, tmp_path):
    broken = _copy(folder, tmp_path)
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="vae has no weights"):
        load_sd(str(broken))


def test_weights_not_matching_config_name_the_keys(folder, tmp_path):
    broken = _copy(folder, tmp_path)
    config_file = broken / "unet" / "config.json"
    config = json.loads(config_file.read_text())
    config["cross_attention_dim"] = 64
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"wrong shape .*attn2/to_k/kernel"):
        load_sd(str(broken))


def test_unsupported_beta_schedule_is_one_sentence(folder, tmp_path):
    broken = _copy(folder, tmp_path)
    config_file = broken / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config["beta_schedule"] = "linear"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="beta_schedule='linear'.*'scaled_linear'"):
        load_sd(str(broken))


def test_conversion_reports_unexpected_keys():
    reference = {("lin", "kernel"): (3, 2), ("lin", "bias"): (2,)}
    state = {
        "lin.weight": np.zeros((2, 3)),
        "lin.bias": np.zeros(2),
        "extra.weight": np.zeros(1),
    }
    with pytest.raises(convert.ParamTreeMismatch, match="unexpected extra.weight"):
        convert.pytorch_to_flax(state, reference)
    del state["extra.weight"]
    out = convert.pytorch_to_flax(state, reference)
    assert out["lin"]["kernel"].shape == (3, 2)


def test_unet_key_mapping_round_trips(model):
    """flax -> pytorch -> flax is the identity on the UNet tree (names and values)."""
    pt = convert.flax_to_pytorch(model.params)
    assert "time_embedding.linear_1.weight" in pt
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.weight" in pt
    back = convert.pytorch_to_flax(pt, convert.shapes_of(model.params))
    for key, value in flatten_dict(model.params).items():
        np.testing.assert_array_equal(np.asarray(value), flatten_dict(back)[key])
