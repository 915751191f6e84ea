"""open_clip -> transformers CLIP weights: the key plan and `convert_open_clip`.

The plan copies, transposes or splits (q/k/v) each open_clip tensor; every key and shape is
checked against transformers' CLIPModel before any is mapped.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tree_grpo_jax.errors import first_line
from tree_grpo_jax.rewards.convert.clip_configs import hf_clip_config, reference_shapes
from tree_grpo_jax.rewards.convert.dtypes import _cast, _check_dtype, _dtype_name, _set_dtype
from tree_grpo_jax.rewards.convert.errors import (
    ConversionError,
    _fit_message,
    _misshaped,
    _named,
)
from tree_grpo_jax.rewards.convert.reading import (
    _looks_like_aesthetic,
    _looks_like_open_clip,
    _looks_like_transformers_clip,
    to_numpy_state_dict,
)

# Buffers, not weights: open_clip's causal mask (saved by some versions).
_IGNORED_OPEN_CLIP_KEYS = frozenset({"attn_mask"})
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


def _check_fit(state_dict: Mapping, expected: Mapping, what: str, config_name: str) -> None:
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = _misshaped(state_dict, expected)
    if missing or unexpected or misshaped:
        raise ConversionError(
            f"{what} does not fit {config_name} ({_fit_message(missing, unexpected, misshaped)})."
        )


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
            f"{first_line(e, default='').rstrip('.')}; pass --open-clip-config=<its open_clip "
            "model config> if it is another architecture."
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
