"""Stable Diffusion 1.x from a diffusers-layout folder, as a `TextToImageModel`.

The folder holds `unet/`, `vae/`, `text_encoder/`, `tokenizer/` and `scheduler/`, each with
its config. Weights are read from Flax msgpack files when present, otherwise from the
PyTorch safetensors files real SD1.5 folders carry, converted in numpy by
`models.convert` (torch is never imported). Only the UNet weights are trainable `params`;
the text encoder and the VAE decoder are frozen and closed over by `encode_prompts` and
`decode`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, serialization
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file

from tree_grpo_jax.models import convert
from tree_grpo_jax.models.base import TextToImageModel
from tree_grpo_jax.models.quiet import quiet_flax_deprecation_notices

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
_CONFIG_FILES = {
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("vocab.json", "merges.txt"),
    "scheduler": ("scheduler_config.json",),
}
# (Flax msgpack, PyTorch safetensors stem) per weighted component.
_WEIGHT_NAMES = {
    "unet": ("diffusion_flax_model.msgpack", "diffusion_pytorch_model"),
    "vae": ("diffusion_flax_model.msgpack", "diffusion_pytorch_model"),
    "text_encoder": ("flax_model.msgpack", "model"),
}
_POINT = "point --config.model.path at a local diffusers-layout Stable Diffusion folder"
_HUB_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.safetensors"]

# PyTorch UNet config fields that the Flax UNet does not read, with the one value it implements.
_UNET_FIXED = {
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "center_input_sample": False,
    "class_embed_type": None,
    "num_class_embeds": None,
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
_UNET_BLOCKS = {
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
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
# Modules whose setup logs diffusers' Flax deprecation notice on every trace.


class ModelLoadError(ValueError):
    """A model folder is missing, incomplete or does not match what the loader supports."""


@dataclasses.dataclass(frozen=True, eq=False)
class StableDiffusionModel(TextToImageModel):
    """A TextToImageModel whose DDIM schedules follow the folder's scheduler config."""

    def make_schedule(self, num_steps: int, **kwargs):
        return super().make_schedule(num_steps, **{**self.extras["schedule_kwargs"], **kwargs})


# Some of the notices are logged while diffusers' Flax modules are imported.
quiet_flax_deprecation_notices()


class _LinenAsInPyTorch(types.ModuleType):
    """`flax.linen` as diffusers' Flax attention module sees it, with PyTorch's numerics.

    diffusers' Flax UNet differs from the PyTorch UNet that SD was trained as in two places,
    both in `attention_flax`: its GEGLU uses tanh-approximate GELU (PyTorch: exact erf) and
    its Transformer2D input GroupNorm uses eps 1e-5 (PyTorch: 1e-6). Everything else
    falls through to `flax.linen`.
    """

    def __getattr__(self, name):
        return getattr(linen, name)

    @staticmethod
    def gelu(x):
        return linen.gelu(x, approximate=False)

    @staticmethod
    def GroupNorm(*args, **kwargs):  # noqa: N802 - stands in for the class
        return linen.GroupNorm(*args, **{**kwargs, "epsilon": 1e-6})


@contextlib.contextmanager
def pytorch_numerics():
    """While tracing inside this block, diffusers' Flax UNet computes the PyTorch UNet's
    function. The switch is scoped: other models built on the same diffusers classes (the
    tiny model) keep the library's own numerics."""
    from diffusers.models import attention_flax

    saved = attention_flax.nn
    attention_flax.nn = _LinenAsInPyTorch("flax.linen")
    try:
        yield
    finally:
        attention_flax.nn = saved


# ---------------------------------------------------------------------------------------------
# The folder.


def resolve_model_path(path: str) -> Path:
    """A local folder as is; anything else through the hub (one clear sentence on failure)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ModelLoadError(f"model path {path} is a file, not a folder; {_POINT}.")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # any hub failure becomes the same sentence
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"model path {path} is not a folder and could not be downloaded: {reason}; "
            "point --config.model.path at a local diffusers-layout folder."
        ) from None


def _component_dir(root: Path, name: str) -> Path:
    folder = root / name
    if not folder.is_dir():
        needed = ", ".join(c + "/" for c in COMPONENTS)
        raise ModelLoadError(
            f"model folder {root} has no {name}/ folder (it needs {needed}); {_POINT}."
        )
    for filename in _CONFIG_FILES[name]:
        if not (folder / filename).is_file():
            raise ModelLoadError(f"model folder {root} has no {name}/{filename}; {_POINT}.")
    return folder


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"could not read {path}: {e}; {_POINT}.") from None


def _check_fixed(config: dict, fixed: dict, where: Path) -> None:
    for key, supported in fixed.items():
        if key in config and config[key] != supported:
            raise ModelLoadError(
                f"{where} sets {key}={config[key]!r}, but only {key}={supported!r} is supported."
            )


def _load_safetensors(folder: Path, stem: str, variant: str | None) -> dict[str, np.ndarray] | None:
    names = [f"{stem}.{variant}.safetensors"] if variant else []
    names += [f"{stem}.safetensors", f"{stem}.fp16.safetensors"]
    for name in names:
        if (folder / name).is_file():
            return load_file(folder / name)
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():  # sharded: {"weight_map": {tensor: shard file}}
        state = {}
        for shard in sorted(set(_read_json(index)["weight_map"].values())):
            state.update(load_file(folder / shard))
        return state
    return None


def _load_weights(folder: Path, component: str, reference, variant: str | None):
    """The component's params as a nested numpy dict, checked against `reference` shapes."""
    flax_name, stem = _WEIGHT_NAMES[component]
    wants_variant = variant is not None and (folder / f"{stem}.{variant}.safetensors").is_file()
    try:
        if (folder / flax_name).is_file() and not wants_variant:
            params = serialization.msgpack_restore((folder / flax_name).read_bytes())
            convert.check_against_reference(flatten_dict(params), reference)
            return params
        state = _load_safetensors(folder, stem, variant)
        if state is not None:
            # diffusers names module lists `down_blocks_0`; transformers keeps `layers/0`.
            merge = component != "text_encoder"
            return convert.pytorch_to_flax(state, reference, merge_indices=merge)
    except convert.ParamTreeMismatch as e:
        raise ModelLoadError(
            f"the weights in {folder} do not match its config ({e}); {_POINT}."
        ) from None
    if list(folder.glob("*.bin")):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights (*.bin), which need torch to read; "
            f"save them as {stem}.safetensors or {_POINT} that has safetensors files."
        )
    raise ModelLoadError(
        f"{folder} has no weights (looked for {flax_name} and {stem}.safetensors); {_POINT}."
    )


def _cast(params, dtype):
    def cast(x):
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map(cast, params)


def _flax_kwargs(cls, config: dict) -> dict:
    """The config fields the Flax class takes, lists turned into tuples."""
    fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name", "dtype"}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields}


def _reference_shapes(module, *args):
    return convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.PRNGKey(0), *args))


# ---------------------------------------------------------------------------------------------
# Components.


def unet_module(config: dict, dtype=jnp.float32, **options):
    """diffusers' Flax UNet for a (PyTorch or Flax) UNet config; options go to the module.

    Apply it inside `pytorch_numerics()` (as `denoise` does) to compute exactly what
    diffusers' PyTorch UNet computes, so that weights trained here behave the same once
    exported.
    """
    from diffusers import FlaxUNet2DConditionModel

    kwargs = _flax_kwargs(FlaxUNet2DConditionModel, config)
    # SD1.x's `attention_head_dim` is really the head count (as in diffusers' PyTorch UNet,
    # heads = num_attention_heads or attention_head_dim); the Flax UNet only reads the latter.
    if kwargs.get("num_attention_heads") is not None:
        kwargs["attention_head_dim"] = kwargs["num_attention_heads"]
    kwargs["num_attention_heads"] = None
    return FlaxUNet2DConditionModel(**{**kwargs, **options}, dtype=dtype)


def _check_unet_config(config: dict, where: Path) -> None:
    _check_fixed(config, _UNET_FIXED, where)
    for key, supported in _UNET_BLOCKS.items():
        unknown = [b for b in config.get(key, ()) if b not in supported]
        if unknown:
            raise ModelLoadError(
                f"{where} uses {key} {unknown}, but only {supported} are supported."
            )
    mid = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid not in ("UNetMidBlock2DCrossAttn", None):
        raise ModelLoadError(f"{where} uses mid_block_type {mid!r}, which is not supported.")


def load_unet(folder: Path, dtype, variant=None, **options):
    config = _read_json(folder / "config.json")
    _check_unet_config(config, folder / "config.json")
    module = unet_module(config, dtype, **options)
    params = _load_weights(folder, "unet", _reference_shapes(module), variant)
    return module, _cast(params, dtype), config


def _load_vae(folder: Path, dtype, variant=None):
    from diffusers import FlaxAutoencoderKL

    config = _read_json(folder / "config.json")
    _check_fixed(config, _VAE_FIXED, folder / "config.json")
    module = FlaxAutoencoderKL(**_flax_kwargs(FlaxAutoencoderKL, config), dtype=dtype)
    params = _load_weights(folder, "vae", _reference_shapes(module), variant)
    # Only the decoder half is ever run; dropping the encoder saves its memory.
    params = {k: params[k] for k in ("post_quant_conv", "decoder")}
    return module, _cast(params, dtype), config


def _load_text_encoder(folder: Path, dtype, variant=None):
    from transformers import CLIPTextConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPTextModule

    config = CLIPTextConfig.from_json_file(str(folder / "config.json"))
    module = FlaxCLIPTextModule(config=config, dtype=dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids), ids)["params"]
    )
    params = _load_weights(folder, "text_encoder", convert.shapes_of(shapes), variant)
    return module, _cast(params, dtype), config


def _load_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    try:
        return CLIPTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a broken tokenizer folder is a load error
        raise ModelLoadError(f"could not read the tokenizer in {folder}: {e}; {_POINT}.") from None


def schedule_kwargs(scheduler_config: dict, where: Path) -> tuple[dict, str]:
    """`make_ddim_schedule` keyword arguments and the prediction type from a scheduler config."""
    _check_fixed(scheduler_config, _SCHEDULER_FIXED, where)
    keys = ("num_train_timesteps", "beta_start", "beta_end", "steps_offset", "set_alpha_to_one")
    kwargs = {k: scheduler_config[k] for k in keys if k in scheduler_config}
    return kwargs, scheduler_config.get("prediction_type", "epsilon")


# ---------------------------------------------------------------------------------------------
# The model functions.


def _make_denoise(unet):
    def denoise(params, x, t, cond):
        # The Flax UNet wraps a non-jax `t` in another axis; make it a [B] jax array.
        t = jnp.broadcast_to(jnp.asarray(t), (x.shape[0],))
        with pytorch_numerics():  # runs while tracing: the compiled function keeps it
            return unet.apply({"params": params}, x, t, cond).sample

    return denoise


def _make_encode_prompts(module, params, tokenizer, max_length: int):
    @jax.jit
    def encode_ids(params, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        # SD feeds the text encoder no padding mask: padded positions attend as in training.
        out = module.apply({"params": params}, ids, jnp.ones_like(ids), positions, True)
        return out[0].astype(jnp.float32)

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


def _make_decode(module, params, scaling_factor: float, batch_size: int, dtype):
    def decode_one(params, z):  # z [h, w, c] -> image [H, W, 3]
        image = module.apply(
            {"params": params},
            z[None],
            method=lambda m, z: m.decoder(m.post_quant_conv(z), deterministic=True),
        )
        return image[0]

    @jax.jit
    def decode_latents(params, latents):
        # NHWC for the Flax VAE; diffusers' own `decode` guesses the layout from the shape.
        z = jnp.transpose(latents, (0, 2, 3, 1)).astype(dtype) / scaling_factor
        images = jax.lax.map(lambda zi: decode_one(params, zi), z, batch_size=batch_size)
        return jnp.clip(images.astype(jnp.float32) / 2.0 + 0.5, 0.0, 1.0)

    return lambda latents: decode_latents(params, latents)


def load_sd(
    path: str,
    dtype=jnp.float32,
    *,
    variant: str | None = None,
    decode_batch_size: int = 8,
    use_memory_efficient_attention: bool = False,
    split_head_dim: bool = False,
) -> StableDiffusionModel:
    """Loads a Stable Diffusion 1.x pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation (float32 or bfloat16).
    `variant` ("fp16") prefers `*.fp16.safetensors`. `decode_batch_size` bounds how many
    latents the VAE decodes at once. The last two options go to diffusers' Flax UNet.
    The UNet has no remat switch in diffusers 0.39: wrap `denoise` in `jax.checkpoint`.
    """
    root = resolve_model_path(path)
    folders = {name: _component_dir(root, name) for name in COMPONENTS}
    schedule, prediction_type = schedule_kwargs(
        _read_json(folders["scheduler"] / "scheduler_config.json"),
        folders["scheduler"] / "scheduler_config.json",
    )
    unet, unet_params, unet_config = load_unet(
        folders["unet"],
        dtype,
        variant,
        use_memory_efficient_attention=use_memory_efficient_attention,
        split_head_dim=split_head_dim,
    )
    vae, vae_params, vae_config = _load_vae(folders["vae"], dtype, variant)
    text, text_params, text_config = _load_text_encoder(folders["text_encoder"], dtype, variant)
    tokenizer = _load_tokenizer(folders["tokenizer"])
    max_length = min(tokenizer.model_max_length, text_config.max_position_embeddings)
    size = unet_config.get("sample_size", 64)
    return StableDiffusionModel(
        name=root.name,
        sample_shape=(unet_config.get("in_channels", 4), size, size),
        params=unet_params,
        denoise=_make_denoise(unet),
        encode_prompts=_make_encode_prompts(text, text_params, tokenizer, max_length),
        decode=_make_decode(
            vae, vae_params, vae_config.get("scaling_factor", 0.18215), decode_batch_size, dtype
        ),
        schedule_kind="ddim",
        prediction_type=prediction_type,
        extras={
            "path": str(root),
            "unet_config": unet_config,
            "vae_config": vae_config,
            "text_config": text_config.to_dict(),
            "tokenizer": tokenizer,
            "unet_module": unet,
            "schedule_kwargs": schedule,
        },
    )
