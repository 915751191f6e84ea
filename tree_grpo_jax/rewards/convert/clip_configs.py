"""open_clip model configs -> transformers `CLIPConfig`s.

Reading the JSON, refusing what a transformers CLIP cannot express, and the state-dict shapes
transformers expects for a config.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from tree_grpo_jax.rewards.convert.errors import (
    ConversionError,
    _import_torch,
    _import_transformers,
    _reason,
    _unreadable,
)

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
# Buffers, not weights: transformers' position ids (saved by older transformers).
_POSITION_IDS = re.compile(r"^(text|vision)_model\.embeddings\.position_ids$")

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


def read_open_clip_config(path) -> dict:
    """An open_clip model config: a `model_configs/*.json` or a hub `open_clip_config.json`."""
    path = Path(path).expanduser()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise _unreadable("open_clip config", path, e) from None
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


# More layers than any CLIP tower has (open_clip's largest, ViT-bigG-14, has 48): the key
# plan and the expected shapes are made layer by layer, so a count of 10**12 would hang.
MOST_LAYERS = 1000


def _layer_count(value, where: str) -> int:
    count = _positive_int(value, where)
    if count > MOST_LAYERS:
        raise ConversionError(
            f"the open_clip config's {where} is {count:,}; no CLIP tower has more than "
            f"{MOST_LAYERS:,} layers (open_clip's largest ViT has 48)."
        )
    return count


def _width_and_divisor(section: dict, where: str, divisor: str) -> tuple[int, int]:
    """A tower's `width` and its `divisor` field (the heads, or one head's width), positive
    integers that divide: the attention splits the width evenly."""
    width = _positive_int(section["width"], f"{where}.width")
    by = _positive_int(section[divisor], f"{where}.{divisor}")
    if width % by:
        raise ConversionError(
            f"the open_clip config's {where}.width {width} is not a multiple of its {divisor} {by}."
        )
    return width, by


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

    v_width, head_width = _width_and_divisor(vision, "vision_cfg", "head_width")
    t_width, t_heads = _width_and_divisor(text, "text_cfg", "heads")
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
        "num_hidden_layers": _layer_count(text["layers"], "text_cfg.layers"),
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
        "num_hidden_layers": _layer_count(vision["layers"], "vision_cfg.layers"),
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
