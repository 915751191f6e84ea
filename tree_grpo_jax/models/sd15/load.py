"""Stable Diffusion 1.x from a diffusers-layout folder, as a `StableDiffusionModel`.

The folder holds `unet/`, `vae/`, `text_encoder/`, `tokenizer/` and `scheduler/`, each with
its config. Weights are read from Flax msgpack files when present, otherwise from the
PyTorch safetensors files real SD1.5 folders carry, converted in numpy by `weights.convert`
(torch is never imported). Only the UNet weights are trainable `params`; the text encoder
and the VAE decoder are frozen and closed over by `encode_prompts` and `decode`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from tree_grpo_jax.core.sampling import PREDICTION_TYPES
from tree_grpo_jax.errors import flat
from tree_grpo_jax.models import clip, clip_files
from tree_grpo_jax.models.autoencoder_kl import AutoencoderKL, module_from_config
from tree_grpo_jax.models.base import (
    DDIMScheduleConfig,
    Decoder,
    ModelLoadError,
    TextToImageModel,
    cast_floats,
    remat_mode,
)
from tree_grpo_jax.models.sd15.unet import (
    DOWN_BLOCKS,
    MID_BLOCKS,
    UP_BLOCKS,
    UNet2DConditionModel,
    unet_module,
)
from tree_grpo_jax.weights import convert, files

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
_CONFIG_FILES = {
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": (),  # clip_files: tokenizer.json, or vocab.json and merges.txt
    "scheduler": ("scheduler_config.json",),
}
# (Flax msgpack, PyTorch safetensors stem) per weighted component.
_WEIGHT_NAMES = {
    "unet": ("diffusion_flax_model.msgpack", "diffusion_pytorch_model"),
    "vae": ("diffusion_flax_model.msgpack", "diffusion_pytorch_model"),
    "text_encoder": ("flax_model.msgpack", "model"),
}
POINT = "point --config.model.path at a local diffusers-layout Stable Diffusion folder"
_HUB_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.safetensors"]

# PyTorch UNet config fields that our UNet does not read, with the one value it implements.
_UNET_FIXED = {
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "center_input_sample": False,
    "class_embed_type": None,
    "num_class_embeds": None,
    "addition_embed_type": None,
    "time_embedding_type": "positional",
    "resnet_time_scale_shift": "default",
    "upcast_attention": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "time_cond_proj_dim": None,
    "mid_block_scale_factor": 1,
    "downsample_padding": 1,
    "attention_type": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "timestep_post_act": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "cross_attention_norm": None,
    "class_embeddings_concat": False,
}
_VAE_FIXED = {
    "act_fn": "silu",
    "shift_factor": None,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}
_SCHEDULER_FIXED = {
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "rescale_betas_zero_snr": False,
    "timestep_spacing": "leading",
    "thresholding": False,
}


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StableDiffusionModel(TextToImageModel):
    """A loaded SD1.x folder; its DDIM schedule follows the folder's scheduler config."""

    path: Path  # the local folder (a hub id resolved to its snapshot)
    unet: UNet2DConditionModel  # the Flax module that `denoise` applies
    unet_config: dict  # unet/config.json, as read
    vae_config: dict
    text_config: dict
    tokenizer: Any  # transformers' CLIPTokenizer


# ---------------------------------------------------------------------------------------------
# The folder.


def resolve_model_path(path: str) -> Path:
    """A local folder as is; anything else through the hub (one clear sentence on failure)."""
    return files.resolve_folder(path, "model path", POINT, _HUB_PATTERNS)


def _component_dir(root: Path, name: str) -> Path:
    folder = root / name
    if not folder.is_dir():
        needed = ", ".join(c + "/" for c in COMPONENTS)
        raise ModelLoadError(
            f"model folder {root} has no {name}/ folder (it needs {needed}); {POINT}."
        )
    for filename in _CONFIG_FILES[name]:
        if not (folder / filename).is_file():
            raise ModelLoadError(f"model folder {root} has no {name}/{filename}; {POINT}.")
    if name == "tokenizer":
        clip_files.check_tokenizer(root, name, POINT)
    return folder


def read_json(path: Path) -> dict:
    return files.read_json(path, POINT)


def _load_weights(folder: Path, component: str, reference, variant: str | None):
    """The component's params as a nested numpy dict, checked against `reference` shapes."""
    flax_name, stem = _WEIGHT_NAMES[component]
    wants_variant = variant is not None and (folder / f"{stem}.{variant}.safetensors").is_file()
    with convert.weights_of(folder, POINT):
        if (folder / flax_name).is_file() and not wants_variant:
            params = files.read_msgpack(folder / flax_name, POINT)
            convert.check_against_reference(flatten_dict(params), reference)
            return params
        state = files.read_safetensors_stem(folder, stem, POINT, variant)
        if state is not None:
            # diffusers names module lists `down_blocks_0`; transformers keeps `layers/0`.
            if component == "text_encoder":
                return convert.pytorch_to_flax(
                    clip_files.with_text_prefix(state), reference, merge_indices=False
                )
            return convert.pytorch_to_flax(state, reference, merge_indices=True)
    if list(folder.glob("*.bin")):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights (*.bin), which need torch to read; "
            f"save them as {stem}.safetensors or {POINT} that has safetensors files."
        )
    raise ModelLoadError(
        f"{folder} has no weights (looked for {flax_name} and {stem}.safetensors); {POINT}."
    )


def unet_reference_shapes(unet: UNet2DConditionModel) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The flat {path: shape} of the UNet's params (no weights are computed)."""
    return convert.shapes_of(jax.eval_shape(unet.init_weights, jax.random.PRNGKey(0)))


# ---------------------------------------------------------------------------------------------
# Components.


def check_unet_config(config: dict, where: Path) -> None:
    """Raises ModelLoadError unless our UNet computes what the config describes."""
    files.check_fixed(config, _UNET_FIXED, where)
    files.check_field_types(config, UNet2DConditionModel, where)
    for key, supported in (("down_block_types", DOWN_BLOCKS), ("up_block_types", UP_BLOCKS)):
        unknown = [b for b in config.get(key, ()) if b not in supported]
        if unknown:
            raise ModelLoadError(
                f"{where} uses {key} {unknown}, but only {supported} are supported."
            )
    mid = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid not in MID_BLOCKS:
        raise ModelLoadError(f"{where} uses mid_block_type {mid!r}, which is not supported.")


def check_runtime_options(attention: str) -> None:
    """model.attention is the transformer families' choice; the UNet runs its own."""
    if attention != "xla":
        raise ModelLoadError(
            f"model.attention {attention!r} is not available for Stable Diffusion 1.x, whose "
            "UNet runs its own attention; set --config.model.attention=xla."
        )


def unet_from_config(config: dict, where: Path, dtype, **options) -> UNet2DConditionModel:
    """The UNet a `unet/config.json` describes, checked; `options` go to the module."""
    check_unet_config(config, where)
    return unet_module(config, dtype, **options)


def load_unet(folder: Path, dtype, variant=None, **options):
    """`(module, params, config)` of a `unet/` folder; `options` go to the module."""
    config = read_json(folder / "config.json")
    module = unet_from_config(config, folder / "config.json", dtype, **options)
    params = _load_weights(folder, "unet", unet_reference_shapes(module), variant)
    return module, cast_floats(params, dtype), config


def vae_module(config: dict, where: Path, dtype) -> AutoencoderKL:
    """The VAE (`models.autoencoder_kl`) a `vae/config.json` describes, checked."""
    return module_from_config(config, where, dtype, _VAE_FIXED)


def decoder_params(vae_params) -> dict:
    """The VAE params that decoding reads: the encoder half is never run."""
    return {k: vae_params[k] for k in ("post_quant_conv", "decoder")}


def _load_vae(folder: Path, dtype, variant=None):
    config = read_json(folder / "config.json")
    module = vae_module(config, folder / "config.json", dtype)
    shapes = convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.PRNGKey(0)))
    params = decoder_params(_load_weights(folder, "vae", shapes, variant))
    return module, cast_floats(params, dtype), config


def _load_text_encoder(folder: Path, dtype, variant=None):
    from transformers import CLIPTextConfig

    try:
        config = CLIPTextConfig.from_json_file(str(folder / "config.json"))
    except Exception as e:  # transformers 5 checks each field's type as it builds
        raise ModelLoadError(
            f"{folder / 'config.json'} is not a valid CLIP text config: {flat(e)}; {POINT}."
        ) from None
    clip.check_activations(config, folder / "config.json", POINT)
    module = clip.CLIPTextModel(config, dtype=dtype)
    shapes = clip.param_shapes(clip.init_text, module)
    params = _load_weights(folder, "text_encoder", convert.shapes_of(shapes), variant)
    return module, cast_floats(params, dtype), config


def schedule_config(scheduler_config: dict, where: Path) -> DDIMScheduleConfig:
    """The model side of the DDIM schedule, from a diffusers scheduler config."""
    files.check_fixed(scheduler_config, _SCHEDULER_FIXED, where)
    prediction_type = scheduler_config.get("prediction_type", "epsilon")
    if prediction_type not in PREDICTION_TYPES:
        raise ModelLoadError(
            f"{where} sets prediction_type={prediction_type!r}, but only {PREDICTION_TYPES} "
            "are supported."
        )
    keys = ("num_train_timesteps", "beta_start", "beta_end", "steps_offset", "set_alpha_to_one")
    kwargs = {k: scheduler_config[k] for k in keys if k in scheduler_config}
    return DDIMScheduleConfig(prediction_type=prediction_type, **kwargs)


# ---------------------------------------------------------------------------------------------
# The model functions.


def sample_shape(unet_config: dict) -> tuple[int, int, int]:
    """One latent, channels first, as the UNet config sizes it."""
    size = unet_config.get("sample_size", 64)
    return (unet_config.get("in_channels", 4), size, size)


def make_denoise(unet: UNet2DConditionModel):
    def denoise(params, x, t, cond):
        t = jnp.broadcast_to(jnp.asarray(t), (x.shape[0],))
        return unet.apply({"params": params}, x, t, cond).sample

    return denoise


def _make_encode_prompts(module, params, tokenizer, max_length: int):
    @jax.jit
    def encode_ids(params, ids):
        # SD feeds the text encoder no padding mask: padded positions attend as in training.
        out = module.apply({"params": params}, ids)
        return out.last_hidden_state.astype(jnp.float32)

    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        ids = tokenizer(
            list(prompts),
            padding="max_length",
            max_length=max_length,
            truncation=True,
            return_tensors="np",
        ).input_ids
        return encode_ids(params, jnp.asarray(ids, jnp.int32))

    return encode_prompts


def decode_fn(module, vae_config: dict, batch_size: int, dtype):
    """`(decoder params, latents [B, 4, h, w]) -> images [B, H, W, 3]` in [0, 1], jitted;
    `batch_size` latents go through the decoder at once."""
    scaling_factor = vae_config.get("scaling_factor", 0.18215)

    def decode_one(params, z):  # z [h, w, c] -> image [H, W, 3]
        return module.apply({"params": params}, z[None], method=module.decode)[0]

    @jax.jit
    def decode_latents(params, latents):
        # Our VAE is channels-last; the latents come channels-first, as diffusers' do.
        z = jnp.transpose(latents, (0, 2, 3, 1)).astype(dtype) / scaling_factor
        images = jax.lax.map(lambda zi: decode_one(params, zi), z, batch_size=batch_size)
        return jnp.clip(images.astype(jnp.float32) / 2.0 + 0.5, 0.0, 1.0)

    return decode_latents


def _make_decode(module, params, vae_config: dict, batch_size: int, dtype):
    return Decoder(decode_fn(module, vae_config, batch_size, dtype), params)


def load_sd(
    path: str,
    dtype=jnp.float32,
    *,
    variant: str | None = None,
    decode_batch_size: int = 8,
    use_memory_efficient_attention: bool = False,
    split_head_dim: bool = False,
    remat: str = "none",
    scan_layers: bool = True,
    attention: str = "xla",
) -> StableDiffusionModel:
    """Loads a Stable Diffusion 1.x pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation (float32 or bfloat16).
    `variant` ("fp16") prefers `*.fp16.safetensors`. `decode_batch_size` bounds how many
    latents the VAE decodes at once. `use_memory_efficient_attention` and `split_head_dim`
    go to the UNet's attention; `remat` (model.remat) recomputes each of its down,
    mid and up blocks in the backward pass. The UNet has no runs of identical blocks to
    scan (`scan_layers` changes nothing) and runs its own attention (`attention` must be
    "xla").
    """
    check_runtime_options(attention)
    root = resolve_model_path(path)
    folders = {name: _component_dir(root, name) for name in COMPONENTS}
    scheduler_file = folders["scheduler"] / "scheduler_config.json"
    schedule = schedule_config(read_json(scheduler_file), scheduler_file)
    unet, unet_params, unet_config = load_unet(
        folders["unet"],
        dtype,
        variant,
        use_memory_efficient_attention=use_memory_efficient_attention,
        split_head_dim=split_head_dim,
        remat=remat,
    )
    vae, vae_params, vae_config = _load_vae(folders["vae"], dtype, variant)
    text, text_params, text_config = _load_text_encoder(folders["text_encoder"], dtype, variant)
    tokenizer = clip_files.load_tokenizer(folders["tokenizer"], POINT)
    max_length = min(tokenizer.model_max_length, text_config.max_position_embeddings)
    return StableDiffusionModel(
        name=root.name,
        sample_shape=sample_shape(unet_config),
        params=unet_params,
        denoise=make_denoise(unet),
        encode_prompts=_make_encode_prompts(text, text_params, tokenizer, max_length),
        decode=_make_decode(vae, vae_params, vae_config, decode_batch_size, dtype),
        schedule_config=schedule,
        path=root,
        unet=unet,
        unet_config=unet_config,
        vae_config=vae_config,
        text_config=text_config.to_dict(),
        tokenizer=tokenizer,
        remat=remat_mode(remat),
    )
