"""Pickled reward-model releases -> folders the JAX reward loader reads (safetensors + JSON).

    python -m tree_grpo_jax.rewards.convert hpsv2 --checkpoint=HPS_v2.1_compressed.pt \\
        --out=<new folder> [--open-clip-config=<open_clip model config .json>] \\
        [--tokenizer=<a Hugging Face CLIP folder>] [--dtype=float32|float16|bfloat16|keep]
    python -m tree_grpo_jax.rewards.convert aesthetic \\
        --checkpoint=sac+logos+ava1-l14-linearMSE.pth --clip=<transformers CLIP folder> \\
        --out=<new folder>

`hpsv2` turns an open_clip ViT CLIP state dict (HPS-v2.1 is open_clip's ViT-H-14, fine-tuned;
`--open-clip-config` describes other open_clip ViTs) into a transformers CLIP folder:
`config.json`, `model.safetensors` in transformers' PyTorch key layout, the CLIP tokenizer
files (`vocab.json`, `merges.txt`, `tokenizer_config.json`, `special_tokens_map.json`) and
`reward_config.json`. `aesthetic` keeps the image tower of a transformers CLIP folder
(`config.json`, `model.safetensors` with `vision_model.*` and `visual_projection.weight`) and
writes the LAION aesthetic predictor's MLP as `aesthetic_mlp.safetensors` (float32, the
release's key names) beside it, with `reward_config.json`.

torch is needed only to read the pickled release (`torch.load(..., weights_only=True)`) and to
learn the expected shapes from transformers' CLIP on the meta device. Every key and shape is
checked before anything is written; the folder is built beside `--out` and moved into place,
so a failure leaves no half-built folder; every failure is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tree_grpo_jax.models import export

FORMAT = 1
OUTPUT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "keep": None,
}
# open_clip's model_configs/ViT-H-14.json, the architecture of HPS-v2.1.
VIT_H_14 = {
    "embed_dim": 1024,
    "vision_cfg": {
        "image_size": 224,
        "layers": 32,
        "width": 1280,
        "head_width": 80,
        "patch_size": 14,
    },
    "text_cfg": {
        "context_length": 77,
        "vocab_size": 49408,
        "width": 1024,
        "heads": 16,
        "layers": 24,
    },
}
LAYER_NORM_EPS = 1e-5  # open_clip's LayerNorm (torch's default)
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# open_clip's SimpleTokenizer names the two special tokens differently from transformers.
_OPEN_CLIP_SPECIALS = {"<start_of_text>": BOS_TOKEN, "<end_of_text>": EOS_TOKEN}
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
# Copied from --tokenizer when present; transformers rebuilds it from vocab/merges otherwise.
_OPTIONAL_TOKENIZER_FILES = ("tokenizer.json",)
# The LAION aesthetic predictor: nn.Sequential(Linear, Dropout, Linear, Dropout, Linear,
# Dropout, Linear, Linear); the Linear layers' indices.
AESTHETIC_LINEARS = (0, 2, 4, 6, 7)
AESTHETIC_KEYS = tuple(f"layers.{i}.{p}" for i in AESTHETIC_LINEARS for p in ("weight", "bias"))
# Buffers, not weights: open_clip's causal mask (saved by some versions) and transformers'
# position ids (saved by older transformers).
_IGNORED_OPEN_CLIP_KEYS = frozenset({"attn_mask"})
_POSITION_IDS = re.compile(r"^(text|vision)_model\.embeddings\.position_ids$")
_MAX_NAMED = 5

_FEATURE_MESSAGE = (
    "the open_clip config sets {where}={value}, which a transformers CLIP cannot express; "
    "this converter handles plain open_clip ViT CLIPs only."
)
# Config keys whose value changes the weights or the computation: the values we can map.
_TOP_MAPPABLE = {
    "custom_text": (False,),
    "init_logit_bias": (None,),
    "nonscalar_logit_scale": (False,),
    "multimodal_cfg": (None,),
}
_TOP_FREE = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "cast_dtype", "init_logit_scale"}
_BLOCK_MAPPABLE = {
    "ls_init_value": (None,),
    "act_kwargs": (None, {}),
    "norm_kwargs": (None, {}),
    "block_type": (None, "default"),
    "qk_norm": (False,),
    "scaled_cosine_attn": (False,),
    "scale_heads": (False,),
    "scale_attn_inner": (False,),
    "scale_attn": (False,),
    "scale_fc": (False,),
}
_VISION_MAPPABLE = {
    **_BLOCK_MAPPABLE,
    "attentional_pool": (False,),
    "no_ln_pre": (False,),
    "pos_embed_type": ("learnable", "sin_cos_2d"),
    "pool_type": ("tok",),
    "timm_model_name": (None,),
}
# `final_ln_after_pool` is exact for token pooling (LayerNorm acts per token); patch dropout
# is off in eval; the timm and pooler options act only with their feature switched on.
_VISION_FREE = {
    "layers",
    "width",
    "head_width",
    "mlp_ratio",
    "patch_size",
    "image_size",
    "patch_dropout",
    "attn_pooler_queries",
    "attn_pooler_heads",
    "final_ln_after_pool",
    "output_tokens",
    "timm_model_pretrained",
    "timm_pool",
    "timm_proj",
    "timm_proj_bias",
    "timm_drop",
    "timm_drop_path",
}
_TEXT_MAPPABLE = {
    **_BLOCK_MAPPABLE,
    "hf_model_name": (None,),
    "hf_tokenizer_name": (None,),
    "tokenizer_mode": (None,),
    "tokenizer_kwargs": (None, {}),
    "embed_cls": (False,),
    "no_causal_mask": (False,),
    "pool_type": ("argmax", "eos"),
    "proj_bias": (False,),
    "proj_type": ("linear",),
}
# open_clip's text tower ignores `final_ln_after_pool` without a class token; `pad_id` acts
# only without the causal mask; the hf_* options only with `hf_model_name`.
_TEXT_FREE = {
    "context_length",
    "vocab_size",
    "width",
    "heads",
    "layers",
    "mlp_ratio",
    "pad_id",
    "eos_id",
    "final_ln_after_pool",
    "output_tokens",
    "hf_model_pretrained",
    "hf_proj_type",
    "hf_pooler_type",
}
_VISION_DEFAULTS = {"layers": 12, "width": 768, "head_width": 64, "mlp_ratio": 4.0}
_VISION_DEFAULTS |= {"patch_size": 16, "image_size": 224}
_TEXT_DEFAULTS = {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8}
_TEXT_DEFAULTS |= {"layers": 12, "mlp_ratio": 4.0, "pool_type": "argmax", "eos_id": 2}


class ConversionError(ValueError):
    """A release, folder or option that cannot be converted; the message is one sentence."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else ""


def _reason(error: BaseException) -> str:
    text = _first_line(error).split(". ")[0][:200]  # torch's messages run on for sentences
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _named(names, limit: int = _MAX_NAMED) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


# --------------------------------------------------------------------------- optional imports


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ConversionError(
            "reading the pickled release needs PyTorch, which is not installed; install it "
            "with `pip install torch` (the CPU build is enough)."
        ) from None
    return torch


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConversionError(
            "checking the shapes needs transformers, which is not installed; install it with "
            "`pip install transformers`."
        ) from None
    return transformers


# --------------------------------------------------------------------------- reading


def _tensor_to_numpy(torch, value) -> np.ndarray:
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def to_numpy_state_dict(state_dict: Mapping, what: str = "the checkpoint") -> dict:
    """{name: numpy array} from torch tensors or arrays, with a leading `module.` removed."""
    out = {}
    torch = None
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ConversionError(f"{what} has a key {key!r} that is not a name.")
        name = key[len("module.") :] if key.startswith("module.") else key
        if isinstance(value, np.ndarray):
            out[name] = value
            continue
        if torch is None and type(value).__module__.startswith("torch"):
            torch = _import_torch()
        if torch is not None and isinstance(value, torch.Tensor):
            out[name] = _tensor_to_numpy(torch, value)
        else:
            raise ConversionError(
                f"{what} holds a {type(value).__name__} under {key!r}, not a tensor, so it is "
                "not a state dict of weights."
            )
    return out


def load_checkpoint(path) -> dict:
    """The state dict in a torch release file as numpy arrays (its dtypes kept).

    Accepts a bare state dict or one under "state_dict"; strips a leading `module.`.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConversionError(f"checkpoint {path} does not exist.")
    if path.is_dir():
        raise ConversionError(f"checkpoint {path} is a folder; pass the release file.")
    torch = _import_torch()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise ConversionError(f"could not read checkpoint {path}: {e.strerror or e}.") from None
    except pickle.UnpicklingError as e:
        raise ConversionError(
            f"checkpoint {path} is damaged, truncated or not a plain torch weights file "
            f"({_reason(e)})."
        ) from None
    except Exception as e:  # RuntimeError (a cut zip archive), EOFError, ValueError, ...
        raise ConversionError(
            f"checkpoint {path} is damaged, truncated or not a torch file ({_reason(e)})."
        ) from None
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ConversionError(
            f"checkpoint {path} holds a {type(obj).__name__}, not a state dict of named tensors."
        )
    return to_numpy_state_dict(obj, f"checkpoint {path}")


def _looks_like_aesthetic(keys) -> bool:
    keys = set(keys)
    return bool(keys) and all(re.fullmatch(r"layers\.\d+\.(weight|bias)", k) for k in keys)


def _looks_like_open_clip(keys) -> bool:
    keys = set(keys)
    visual = any(k.startswith("visual.") for k in keys)
    text = "token_embedding.weight" in keys or any(k.startswith("text.") for k in keys)
    return visual and text


def _looks_like_transformers_clip(keys) -> bool:
    return any(k.startswith(("vision_model.", "text_model.")) for k in keys)


# --------------------------------------------------------------------------- open_clip config


def read_open_clip_config(path) -> dict:
    """An open_clip model config: a `model_configs/*.json` or a hub `open_clip_config.json`."""
    path = Path(path).expanduser()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"open_clip config {path} does not exist.") from None
    except OSError as e:
        raise ConversionError(
            f"could not read open_clip config {path}: {e.strerror or e}."
        ) from None
    except ValueError as e:
        raise ConversionError(f"open_clip config {path} is not JSON ({_reason(e)}).") from None
    if not isinstance(config, dict):
        raise ConversionError(f"open_clip config {path} does not hold a JSON object.")
    return config


def _check_section(section: dict, where: str, mappable: dict, free: set) -> None:
    for key, value in section.items():
        if key in mappable:
            if not any(value == ok and type(value) is type(ok) for ok in mappable[key]):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise ConversionError(_FEATURE_MESSAGE.format(where=f"{where}{key}", value=shown))
        elif key not in free:
            raise ConversionError(
                f"the open_clip config has the key {where}{key}, which this converter does not "
                "know; it handles plain open_clip ViT CLIPs only."
            )


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConversionError(
            f"the open_clip config's {where} must be a positive integer, not {value!r}."
        )
    return value


def _square(value, where: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConversionError(
                f"the open_clip config's {where} is {list(value)}, but a transformers CLIP "
                "needs a square size."
            )
        value = value[0]
    return _positive_int(value, where)


def _mlp_width(width: int, ratio, where: str) -> int:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
        raise ConversionError(
            f"the open_clip config's {where} must be a positive number, not {ratio!r}."
        )
    return int(width * ratio)  # as open_clip's ResidualAttentionBlock


def hf_clip_config(open_clip_config: dict | None = None, logit_scale: float | None = None) -> dict:
    """The transformers `CLIPConfig` (as a dict) of an open_clip ViT CLIP model config.

    `open_clip_config` defaults to ViT-H-14; features a transformers CLIP cannot express are
    refused with a one-sentence ConversionError.
    """
    config = dict(VIT_H_14 if open_clip_config is None else open_clip_config)
    if "model_cfg" in config and "embed_dim" not in config:  # a hub open_clip_config.json
        config = dict(config["model_cfg"])
    if not isinstance(config.get("vision_cfg"), dict) or not isinstance(
        config.get("text_cfg"), dict
    ):
        raise ConversionError(
            'the open_clip config needs "embed_dim", a "vision_cfg" object and a "text_cfg" object.'
        )
    _check_section(config, "", _TOP_MAPPABLE, _TOP_FREE)
    vision = _VISION_DEFAULTS | config["vision_cfg"]
    text = _TEXT_DEFAULTS | config["text_cfg"]
    if isinstance(vision["layers"], (list, tuple)):
        raise ConversionError(
            "the open_clip config's vision_cfg.layers is a list, so its image tower is a ResNet; "
            "this converter handles ViT towers only."
        )
    _check_section(config["vision_cfg"], "vision_cfg.", _VISION_MAPPABLE, _VISION_FREE)
    _check_section(config["text_cfg"], "text_cfg.", _TEXT_MAPPABLE, _TEXT_FREE)
    embed_dim = _positive_int(config.get("embed_dim"), "embed_dim")
    quick_gelu = config.get("quick_gelu", False)
    if not isinstance(quick_gelu, bool):
        raise ConversionError(
            f"the open_clip config's quick_gelu must be true or false, not {quick_gelu!r}."
        )
    act = "quick_gelu" if quick_gelu else "gelu"

    v_width = _positive_int(vision["width"], "vision_cfg.width")
    head_width = _positive_int(vision["head_width"], "vision_cfg.head_width")
    if v_width % head_width:
        raise ConversionError(
            f"the open_clip config's vision_cfg.width {v_width} is not a multiple of its "
            f"head_width {head_width}."
        )
    t_width = _positive_int(text["width"], "text_cfg.width")
    t_heads = _positive_int(text["heads"], "text_cfg.heads")
    if t_width % t_heads:
        raise ConversionError(
            f"the open_clip config's text_cfg.width {t_width} is not a multiple of its "
            f"heads {t_heads}."
        )
    vocab_size = _positive_int(text["vocab_size"], "text_cfg.vocab_size")
    if vocab_size < 3:
        raise ConversionError("the open_clip config's text_cfg.vocab_size is too small for CLIP.")
    eot = vocab_size - 1  # open_clip's tokenizer appends <start_of_text>, <end_of_text> last
    if text["pool_type"] == "eos" and text["eos_id"] != eot:
        raise ConversionError(
            f"the open_clip config pools the text at eos_id {text['eos_id']!r}, not at the "
            f"end-of-text token {eot}; this converter handles argmax/end-of-text pooling only."
        )
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": t_width,
        "intermediate_size": _mlp_width(t_width, text["mlp_ratio"], "text_cfg.mlp_ratio"),
        "num_hidden_layers": _positive_int(text["layers"], "text_cfg.layers"),
        "num_attention_heads": t_heads,
        "max_position_embeddings": _positive_int(text["context_length"], "text_cfg.context_length"),
        "hidden_act": act,
        "layer_norm_eps": LAYER_NORM_EPS,
        "projection_dim": embed_dim,
        "bos_token_id": vocab_size - 2,
        "eos_token_id": eot,
        "pad_token_id": eot,
    }
    vision_config = {
        "hidden_size": v_width,
        "intermediate_size": _mlp_width(v_width, vision["mlp_ratio"], "vision_cfg.mlp_ratio"),
        "num_hidden_layers": _positive_int(vision["layers"], "vision_cfg.layers"),
        "num_attention_heads": v_width // head_width,
        "num_channels": 3,
        "image_size": _square(vision["image_size"], "vision_cfg.image_size"),
        "patch_size": _square(vision["patch_size"], "vision_cfg.patch_size"),
        "hidden_act": act,
        "layer_norm_eps": LAYER_NORM_EPS,
        "projection_dim": embed_dim,
    }
    transformers = _import_transformers()
    config = {
        "architectures": ["CLIPModel"],
        "model_type": "clip",
        "projection_dim": embed_dim,
        "logit_scale_init_value": 2.6592 if logit_scale is None else float(logit_scale),
        "text_config": {"model_type": "clip_text_model", **text_config},
        "vision_config": {"model_type": "clip_vision_model", **vision_config},
        "transformers_version": transformers.__version__,
    }
    try:  # every value written explicitly, and transformers must accept them all
        transformers.CLIPConfig.from_dict(copy.deepcopy(config))
    except Exception as e:
        raise ConversionError(f"transformers refuses the CLIP config ({_reason(e)}).") from None
    return config


def reference_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of transformers' `CLIPModel` state dict for `hf_config` (built on meta)."""
    torch = _import_torch()
    transformers = _import_transformers()
    config = transformers.CLIPConfig.from_dict(copy.deepcopy(dict(hf_config)))
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = transformers.CLIPModel(config)
    finally:
        transformers.logging.set_verbosity(level)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not _POSITION_IDS.match(k)}


# --------------------------------------------------------------------------- open_clip -> HF

_COPY, _TRANSPOSE, _SPLIT3 = "copy", "transpose", "split3"


def _block_plan(oc_prefix: str, hf_prefix: str, layers: int) -> list:
    plan = []
    for i in range(layers):
        oc, hf = f"{oc_prefix}.{i}", f"{hf_prefix}.{i}"
        for p in ("weight", "bias"):
            attn = [f"{hf}.self_attn.{n}_proj.{p}" for n in "qkv"]
            plan += [
                (f"{oc}.ln_1.{p}", _COPY, [f"{hf}.layer_norm1.{p}"]),
                (f"{oc}.attn.in_proj_{p}", _SPLIT3, attn),
                (f"{oc}.attn.out_proj.{p}", _COPY, [f"{hf}.self_attn.out_proj.{p}"]),
                (f"{oc}.ln_2.{p}", _COPY, [f"{hf}.layer_norm2.{p}"]),
                (f"{oc}.mlp.c_fc.{p}", _COPY, [f"{hf}.mlp.fc1.{p}"]),
                (f"{oc}.mlp.c_proj.{p}", _COPY, [f"{hf}.mlp.fc2.{p}"]),
            ]
    return plan


def _layer_norm_plan(oc: str, hf: str) -> list:
    return [(f"{oc}.{p}", _COPY, [f"{hf}.{p}"]) for p in ("weight", "bias")]


def key_plan(hf_config: dict) -> list[tuple[str, str, list[str]]]:
    """(open_clip key, how, transformers keys) for every weight of a ViT CLIP."""
    v_layers = hf_config["vision_config"]["num_hidden_layers"]
    t_layers = hf_config["text_config"]["num_hidden_layers"]
    return [
        ("visual.class_embedding", _COPY, ["vision_model.embeddings.class_embedding"]),
        ("visual.conv1.weight", _COPY, ["vision_model.embeddings.patch_embedding.weight"]),
        (
            "visual.positional_embedding",
            _COPY,
            ["vision_model.embeddings.position_embedding.weight"],
        ),
        *_layer_norm_plan("visual.ln_pre", "vision_model.pre_layrnorm"),
        *_block_plan("visual.transformer.resblocks", "vision_model.encoder.layers", v_layers),
        *_layer_norm_plan("visual.ln_post", "vision_model.post_layernorm"),
        ("visual.proj", _TRANSPOSE, ["visual_projection.weight"]),
        ("token_embedding.weight", _COPY, ["text_model.embeddings.token_embedding.weight"]),
        ("positional_embedding", _COPY, ["text_model.embeddings.position_embedding.weight"]),
        *_block_plan("transformer.resblocks", "text_model.encoder.layers", t_layers),
        *_layer_norm_plan("ln_final", "text_model.final_layer_norm"),
        ("text_projection", _TRANSPOSE, ["text_projection.weight"]),
        ("logit_scale", _COPY, ["logit_scale"]),
    ]


def _open_clip_shape(how: str, hf_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if how == _TRANSPOSE:
        return tuple(reversed(hf_shapes[0]))
    if how == _SPLIT3:
        return (3 * hf_shapes[0][0], *hf_shapes[0][1:])
    return hf_shapes[0]


def _fit_message(missing, unexpected, misshaped) -> str:
    parts = []
    if missing:
        parts.append(f"missing {_named(missing)}")
    if unexpected:
        parts.append(f"unexpected {_named(unexpected)}")
    if misshaped:
        parts.append(
            "mis-shaped " + _named(f"{k} {got} (expected {want})" for k, got, want in misshaped)
        )
    return "; ".join(parts)


def _check_fit(state_dict: Mapping, expected: Mapping, what: str, config_name: str) -> None:
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = [
        (k, tuple(v.shape), tuple(expected[k]))
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != tuple(expected[k])
    ]
    if missing or unexpected or misshaped:
        raise ConversionError(
            f"{what} does not fit {config_name} ({_fit_message(missing, unexpected, misshaped)})."
        )


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def _cast(array: np.ndarray, dtype) -> np.ndarray:
    """`array` as `dtype` (floating arrays only; None keeps it), C-contiguous."""
    if dtype is not None and _is_float(array.dtype):
        array = array.astype(dtype, copy=False)
    # np.ascontiguousarray would turn a scalar (logit_scale) into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


def _dtype_name(weights: Mapping[str, np.ndarray]) -> str | None:
    """The one floating dtype of `weights` ("float16", "bfloat16", ...), None if mixed."""
    names = {v.dtype.name for v in weights.values() if _is_float(v.dtype)}
    return names.pop() if len(names) == 1 else None


def _set_dtype(config: dict, dtype: str | None) -> None:
    """Records the weights' dtype under the key(s) the config uses (newer transformers: dtype)."""
    if dtype is None:
        return
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype


def _check_dtype(dtype: str):
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}.")
    return OUTPUT_DTYPES[dtype]


def convert_open_clip(
    state_dict: Mapping,
    open_clip_config: dict | None = None,
    dtype: str = "float32",
    config_name: str | None = None,
    what: str = "the state dict",
) -> tuple[dict, dict[str, np.ndarray]]:
    """(transformers CLIPConfig dict, transformers-named numpy state dict) of an open_clip CLIP.

    `state_dict` holds torch tensors or numpy arrays under open_clip's names (a leading
    `module.` is removed); `open_clip_config` is an open_clip model config (default ViT-H-14);
    `dtype` is an `OUTPUT_DTYPES` name ("keep" keeps each tensor's dtype). Every key and shape
    is checked against transformers' CLIPModel built from the config; any mismatch is one
    ConversionError naming up to five keys.
    """
    out_dtype = _check_dtype(dtype)
    sd = to_numpy_state_dict(state_dict, what)
    if not _looks_like_open_clip(sd):
        if _looks_like_aesthetic(sd):
            raise ConversionError(
                f"{what} looks like the LAION aesthetic predictor's MLP, not an open_clip CLIP "
                "checkpoint; convert it with the `aesthetic` subcommand."
            )
        if _looks_like_transformers_clip(sd):
            raise ConversionError(
                f"{what} has transformers CLIP names (vision_model.*), so it does not look like "
                "an open_clip CLIP checkpoint and needs no conversion."
            )
        raise ConversionError(
            f"{what} does not look like an open_clip CLIP checkpoint (it has no visual.* and "
            f"token_embedding weights; keys like {_named(sorted(sd), 3)})."
        )
    if any(k.startswith("text.") for k in sd):
        raise ConversionError(
            f"{what} has a custom open_clip text tower (text.*), which this converter does not map."
        )
    if config_name is None:
        config_name = "the ViT-H-14 config" if open_clip_config is None else "the open_clip config"
    sd = {k: v for k, v in sd.items() if k not in _IGNORED_OPEN_CLIP_KEYS}
    logit_scale = sd.get("logit_scale")
    scale = (
        float(np.asarray(logit_scale, np.float32)) if getattr(logit_scale, "size", 0) == 1 else None
    )
    hf_config = hf_clip_config(open_clip_config, scale)
    hf_shapes = reference_shapes(hf_config)
    plan = key_plan(hf_config)
    planned = [hf for _, _, hfs in plan for hf in hfs]
    if sorted(planned) != sorted(hf_shapes):
        raise ConversionError(
            "this transformers version names CLIP weights differently from what this converter "
            f"writes ({_named(sorted(set(planned) ^ set(hf_shapes)))}); use transformers 4.x."
        )
    expected = {oc: _open_clip_shape(how, [hf_shapes[k] for k in hfs]) for oc, how, hfs in plan}
    try:
        _check_fit(sd, expected, what, config_name)
    except ConversionError as e:
        if open_clip_config is not None:
            raise
        raise ConversionError(
            f"{_first_line(e)}; pass --open-clip-config=<its open_clip model config> if it is "
            "another architecture."
        ) from None

    out = {}
    for oc, how, hfs in plan:
        value = sd[oc]
        if how == _TRANSPOSE:
            out[hfs[0]] = value.T
        elif how == _SPLIT3:
            for name, part in zip(hfs, np.split(value, 3, axis=0)):
                out[name] = part
        else:
            out[hfs[0]] = value
    out = {k: _cast(v, out_dtype) for k, v in out.items()}
    bad = [k for k, v in out.items() if tuple(v.shape) != hf_shapes[k]]
    if bad:  # the plan and transformers disagree: a converter bug, not a user error
        raise AssertionError(f"converted shapes differ from transformers' for {_named(bad)}")
    _set_dtype(hf_config, _dtype_name(out) if dtype == "keep" else dtype)
    return hf_config, out


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_config(context_length: int) -> dict:
    return {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": context_length,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "errors": "replace",
        "do_lower_case": True,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }


def _special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }


def open_clip_tokenizer_files(context_length: int = 77) -> dict[str, str]:
    """{file name: text} of a transformers CLIP tokenizer built from open_clip's bundled BPE.

    The vocabulary is open_clip's SimpleTokenizer's, in its order, with its two special tokens
    under transformers' names.
    """
    try:
        from open_clip.tokenizer import SimpleTokenizer
    except ImportError:
        raise ConversionError(
            "open_clip is not installed, so there is no BPE vocabulary to build the tokenizer "
            "from; pass --tokenizer=<a Hugging Face CLIP folder> "
            "(e.g. openai/clip-vit-large-patch14)."
        ) from None
    tokenizer = SimpleTokenizer(context_length=context_length)
    encoder = tokenizer.encoder
    contiguous = sorted(encoder.values()) == list(range(len(encoder)))
    if not contiguous or not set(_OPEN_CLIP_SPECIALS) <= set(encoder):
        raise ConversionError(
            "this open_clip version builds its vocabulary differently; pass --tokenizer=<a "
            "Hugging Face CLIP folder>."
        )
    vocab = {_OPEN_CLIP_SPECIALS.get(token, token): i for token, i in encoder.items()}
    merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.get)
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n",
        "tokenizer_config.json": json.dumps(_tokenizer_config(context_length), indent=2) + "\n",
        "special_tokens_map.json": json.dumps(_special_tokens_map(), indent=2) + "\n",
    }


def _tokenizer_folder(path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"tokenizer folder {folder} does not exist.")
    for candidate in (folder, folder / "tokenizer"):
        if (candidate / "vocab.json").is_file() and (candidate / "merges.txt").is_file():
            return candidate
    raise ConversionError(
        f"{folder} has no vocab.json and merges.txt, so it is not a Hugging Face CLIP "
        "tokenizer folder."
    )


def copied_tokenizer_files(path, context_length: int) -> dict[str, str]:
    """{file name: text} of the CLIP tokenizer in a Hugging Face folder (or its tokenizer/)."""
    folder = _tokenizer_folder(path)
    files = {}
    for name in TOKENIZER_FILES + _OPTIONAL_TOKENIZER_FILES:
        if (folder / name).is_file():
            try:
                files[name] = (folder / name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConversionError(f"could not read {folder / name} ({_reason(e)}).") from None
    files.setdefault(
        "tokenizer_config.json", json.dumps(_tokenizer_config(context_length), indent=2)
    )
    files.setdefault("special_tokens_map.json", json.dumps(_special_tokens_map(), indent=2))
    return files


def check_tokenizer(files: Mapping[str, str], hf_config: dict, where: str) -> None:
    """Refuses a vocabulary other than the text tower's (size, start- and end-of-text ids)."""
    try:
        vocab = json.loads(files["vocab.json"])
    except ValueError as e:
        raise ConversionError(f"the vocab.json of {where} is not JSON ({_reason(e)}).") from None
    if not isinstance(vocab, dict):
        raise ConversionError(f"the vocab.json of {where} does not hold a JSON object.")
    text = hf_config["text_config"]
    if len(vocab) != text["vocab_size"]:
        raise ConversionError(
            f"the tokenizer of {where} has {len(vocab)} tokens but the text tower has "
            f"{text['vocab_size']}."
        )
    if vocab.get(EOS_TOKEN) != text["eos_token_id"] or vocab.get(BOS_TOKEN) != text["bos_token_id"]:
        raise ConversionError(
            f"the tokenizer of {where} puts {BOS_TOKEN} and {EOS_TOKEN} at ids "
            f"{vocab.get(BOS_TOKEN)} and {vocab.get(EOS_TOKEN)}, not at "
            f"{text['bos_token_id']} and {text['eos_token_id']} as open_clip does."
        )


# --------------------------------------------------------------------------- aesthetic


def check_aesthetic_mlp(mlp: Mapping[str, np.ndarray], what: str = "the MLP") -> tuple[int, ...]:
    """The MLP's widths (input, hidden..., 1) after checking the release's structure."""
    keys = set(mlp)
    if _looks_like_open_clip(keys):
        raise ConversionError(
            f"{what} looks like an open_clip CLIP checkpoint, not the LAION aesthetic predictor's "
            "MLP; convert it with the `hpsv2` subcommand."
        )
    missing = [k for k in AESTHETIC_KEYS if k not in keys]
    unexpected = sorted(keys - set(AESTHETIC_KEYS))
    if missing or unexpected:
        raise ConversionError(
            f"{what} does not look like the LAION aesthetic predictor's MLP "
            f"({_fit_message(missing, unexpected, [])})."
        )
    widths = []
    for i in AESTHETIC_LINEARS:
        w, b = mlp[f"layers.{i}.weight"], mlp[f"layers.{i}.bias"]
        if w.ndim != 2 or b.shape != (w.shape[0],):
            raise ConversionError(
                f"{what} has layers.{i} weight {tuple(w.shape)} and bias {tuple(b.shape)}, which "
                "are not one linear layer."
            )
        if widths and w.shape[1] != widths[-1]:
            raise ConversionError(
                f"{what}'s layers.{i} takes {w.shape[1]} inputs but the layer before gives "
                f"{widths[-1]}."
            )
        if not widths:
            widths.append(int(w.shape[1]))
        widths.append(int(w.shape[0]))
    if widths[-1] != 1:
        raise ConversionError(f"{what} ends in {widths[-1]} outputs, not one score.")
    return tuple(widths)


def read_clip_config(path) -> tuple[dict, list[Path]]:
    """(config, safetensors files) of a transformers CLIP folder; no weights are read.

    The files are `model.safetensors` or the shards in `model.safetensors.index.json`.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"--clip folder {folder} does not exist.")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(
            f"{folder} has no config.json, so it is not a transformers CLIP folder "
            "(e.g. openai/clip-vit-large-patch14)."
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"could not read {config_file} ({_reason(e)}).") from None
    if not isinstance(config, dict) or config.get("model_type") != "clip":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise ConversionError(
            f"{config_file} describes a {kind or 'non-CLIP'} model, not a transformers CLIP "
            '(model_type "clip").'
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({folder / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(
                f"could not read the shard index {index} ({_reason(e)})."
            ) from None
    elif (folder / "model.safetensors").is_file():
        shards = [folder / "model.safetensors"]
    elif any(folder.glob("*.bin")):
        raise ConversionError(
            f"{folder} holds only pickled .bin weights; use a CLIP folder with model.safetensors."
        )
    else:
        raise ConversionError(
            f"{folder} has no model.safetensors, so it has no CLIP weights to read."
        )
    return config, shards


def read_clip_folder(path) -> tuple[dict, dict[str, np.ndarray], list[str]]:
    """(config, image-tower tensors, every tensor name) of a transformers CLIP folder.

    Only safetensors are read (no pickle), and of the tensors only the image tower's.
    """
    from safetensors import SafetensorError, safe_open

    config, shards = read_clip_config(path)
    vision, names = {}, []
    for shard in shards:
        try:
            with safe_open(shard, framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    names.append(key)
                    if key.startswith("vision_model.") or key == "visual_projection.weight":
                        vision[key] = f.get_tensor(key)
        except FileNotFoundError:
            raise ConversionError(f"CLIP weights file {shard} does not exist.") from None
        except OSError as e:
            raise ConversionError(
                f"could not read CLIP weights file {shard}: {e.strerror or e}."
            ) from None
        except (SafetensorError, ValueError, TypeError) as e:
            raise ConversionError(
                f"CLIP weights file {shard} is damaged or truncated ({_reason(e)})."
            ) from None
    return config, vision, names


def _is_vision_key(key: str) -> bool:
    return key.startswith("vision_model.") or key == "visual_projection.weight"


def convert_aesthetic(
    mlp_state_dict: Mapping,
    clip_config: dict,
    clip_state_dict: Mapping,
    dtype: str = "float32",
    clip_names=None,
) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(CLIP config, image-tower state dict, float32 MLP state dict) for the aesthetic reward.

    `mlp_state_dict` is the release's MLP (`layers.{0,2,4,6,7}.{weight,bias}`, tensors or
    arrays); `clip_state_dict` holds at least the transformers CLIP's `vision_model.*` and
    `visual_projection.weight` (text-tower weights, named in `clip_names` or present, are
    dropped, as are `position_ids` buffers). The MLP's input width must be the CLIP's
    `projection_dim`; every image-tower key and shape is checked against transformers'
    CLIPModel built from `clip_config`.
    """
    out_dtype = _check_dtype(dtype)
    mlp = to_numpy_state_dict(mlp_state_dict, "the aesthetic MLP")
    widths = check_aesthetic_mlp(mlp, "the aesthetic MLP")
    transformers = _import_transformers()
    try:
        config = transformers.CLIPConfig.from_dict(copy.deepcopy(dict(clip_config)))
    except Exception as e:  # a config transformers cannot build
        raise ConversionError(
            f"the CLIP config is not a valid CLIPConfig ({_reason(e)})."
        ) from None
    if widths[0] != config.projection_dim:
        raise ConversionError(
            f"the aesthetic MLP takes {widths[0]}-wide inputs but the CLIP's projection_dim is "
            f"{config.projection_dim}; pass the CLIP it was trained on "
            "(ViT-L/14 for the LAION release)."
        )
    clip = to_numpy_state_dict(clip_state_dict, "the CLIP weights")
    names = set(clip) | set(clip_names or ())
    shapes = reference_shapes(config.to_dict())
    expected = {k: v for k, v in shapes.items() if _is_vision_key(k)}
    text_keys = {k for k in shapes if not _is_vision_key(k)}
    unexpected = sorted(k for k in names if k not in expected and k not in text_keys)
    unexpected = [k for k in unexpected if not _POSITION_IDS.match(k)]
    vision = {k: v for k, v in clip.items() if _is_vision_key(k) and not _POSITION_IDS.match(k)}
    missing = [k for k in expected if k not in vision]
    misshaped = [
        (k, tuple(v.shape), expected[k])
        for k, v in vision.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    if missing or unexpected or misshaped:
        raise ConversionError(
            "the CLIP weights do not fit the CLIP folder's config.json "
            f"({_fit_message(missing, unexpected, misshaped)})."
        )
    vision = {k: _cast(v, out_dtype) for k, v in vision.items()}
    mlp = {k: _cast(mlp[k], np.dtype(np.float32)) for k in AESTHETIC_KEYS}
    out_config = copy.deepcopy(dict(clip_config))
    # CLIPModel sizes visual_projection by the top-level projection_dim, the image tower alone
    # (CLIPVisionModelWithProjection) by vision_config's, which folders may leave at its default.
    vision_config = out_config.setdefault("vision_config", {})
    vision_config["projection_dim"] = config.projection_dim
    return out_config, vision, mlp


# --------------------------------------------------------------------------- writing


def check_out_dir(out, overwrite: bool, sources=()) -> Path:
    """The resolved output folder, after refusing one that would overwrite work or a source."""
    try:
        export.check_out_dir(None, out, overwrite, sources, what="the output folder")
    except ValueError as e:
        raise ConversionError(str(e).rstrip(".")) from None
    return Path(out).expanduser().resolve()


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_folder(out: Path, files: Mapping[str, object]) -> Path:
    """Writes {name: dict (JSON) | str (text) | {key: array} (safetensors)} into `out` at once.

    The files go into a staging folder beside `out`, which then replaces `out`.
    """
    umask = os.umask(0)
    os.umask(umask)

    def fill(staging: Path) -> None:
        for name, content in files.items():
            path = staging / name
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            elif name.endswith(".safetensors"):
                save_file(dict(content), path, metadata={"format": "pt"})
                os.chmod(path, 0o666 & ~umask)  # safetensors creates its files owner-only
            else:
                _write_json(path, content)

    return export.write_staged(out, fill)


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _say(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- commands


def run_hpsv2(args) -> Path:
    checkpoint = Path(args.checkpoint).expanduser()
    out = check_out_dir(args.out, args.overwrite, [checkpoint])
    _check_dtype(args.dtype)
    open_clip_config, config_name = None, "the ViT-H-14 config"
    if args.open_clip_config:
        open_clip_config = read_open_clip_config(args.open_clip_config)
        config_name = f"the open_clip config {Path(args.open_clip_config).name}"
    # The config and the tokenizer are checked before the (large) release is read.
    planned = hf_clip_config(open_clip_config)
    context_length = planned["text_config"]["max_position_embeddings"]
    if args.tokenizer:
        tokenizer = copied_tokenizer_files(args.tokenizer, context_length)
        where = str(_tokenizer_folder(args.tokenizer))
    else:
        tokenizer = open_clip_tokenizer_files(context_length)
        where = "open_clip's BPE vocabulary"
    check_tokenizer(tokenizer, planned, where)
    _say(f"reading {checkpoint}")
    state_dict = load_checkpoint(checkpoint)
    _say(f"checking {len(state_dict)} tensors against {config_name}")
    hf_config, weights = convert_open_clip(
        state_dict, open_clip_config, args.dtype, config_name, what=f"checkpoint {checkpoint.name}"
    )
    del state_dict
    _say(f"writing {out}")
    files = {"config.json": hf_config, "model.safetensors": weights, **tokenizer}
    files["reward_config.json"] = {
        "reward": "hpsv2",
        "converted_from": checkpoint.name,
        "format": FORMAT,
    }
    return write_folder(out, files)


def run_aesthetic(args) -> Path:
    checkpoint = Path(args.checkpoint).expanduser()
    clip_dir = Path(args.clip).expanduser()
    out = check_out_dir(args.out, args.overwrite, [checkpoint, clip_dir])
    _check_dtype(args.dtype)
    read_clip_config(clip_dir)  # a wrong folder is refused before anything is read
    _say(f"reading {checkpoint}")
    mlp = load_checkpoint(checkpoint)
    check_aesthetic_mlp(mlp, f"checkpoint {checkpoint.name}")
    _say(f"reading the image tower in {clip_dir}")
    clip_config, clip_weights, clip_names = read_clip_folder(clip_dir)
    _say(f"checking the MLP and {len(clip_weights)} image-tower tensors")
    config, vision, mlp = convert_aesthetic(mlp, clip_config, clip_weights, args.dtype, clip_names)
    _set_dtype(config, _dtype_name(vision) if args.dtype == "keep" else args.dtype)
    _say(f"writing {out}")
    files = {"config.json": config, "model.safetensors": vision, "aesthetic_mlp.safetensors": mlp}
    files["reward_config.json"] = {
        "reward": "aesthetic",
        "converted_from": checkpoint.name,
        "clip_from": clip_dir.resolve().name,
        "format": FORMAT,
    }
    return write_folder(out, files)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` line (exit status 2), like every other failure."""

    def error(self, message):
        self.exit(
            2, f"error: {message.strip().splitlines()[0].rstrip('.')}; see {self.prog} --help.\n"
        )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tree_grpo_jax.rewards.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{hpsv2,aesthetic}")
    hps = commands.add_parser(
        "hpsv2", help="HPS-v2.1 (an open_clip ViT CLIP) -> a transformers CLIP folder"
    )
    hps.add_argument(
        "--checkpoint", required=True, help="the release file, e.g. HPS_v2.1_compressed.pt"
    )
    hps.add_argument(
        "--open-clip-config", help="an open_clip model config JSON (default: ViT-H-14)"
    )
    hps.add_argument("--tokenizer", help="a Hugging Face CLIP folder to copy the tokenizer from")
    aes = commands.add_parser(
        "aesthetic", help="LAION aesthetic predictor v2 + its CLIP image tower"
    )
    aes.add_argument(
        "--checkpoint",
        required=True,
        help="the release file, e.g. sac+logos+ava1-l14-linearMSE.pth",
    )
    aes.add_argument(
        "--clip", required=True, help="a transformers CLIP folder (openai/clip-vit-large-patch14)"
    )
    for sub in (hps, aes):
        sub.add_argument("--out", required=True, help="the new reward folder")
        sub.add_argument(
            "--dtype", default="float32", choices=sorted(OUTPUT_DTYPES), help="of the CLIP weights"
        )
        sub.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help 0
        return e.code if isinstance(e.code, int) else 2
    try:
        out = run_hpsv2(args) if args.command == "hpsv2" else run_aesthetic(args)
    except ConversionError as e:
        print(f"error: {_first_line(e)}.", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be read or written (permissions, disk full)
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not read or write{where}: {e.strerror or e}.", file=sys.stderr)
        return 2
    _say(f"done: {out} ({_size_text(_folder_size(out))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
