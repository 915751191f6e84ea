"""The LAION aesthetic predictor: its MLP checked and paired with a CLIP image tower.

`convert_aesthetic` keeps the image tower of a transformers CLIP and the MLP in float32.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np

from tree_grpo_jax.rewards.convert.clip_configs import _POSITION_IDS, reference_shapes
from tree_grpo_jax.rewards.convert.dtypes import _cast, _check_dtype
from tree_grpo_jax.rewards.convert.errors import (
    ConversionError,
    _fit_message,
    _import_transformers,
    _misshaped,
    _reason,
)
from tree_grpo_jax.rewards.convert.reading import _looks_like_open_clip, to_numpy_state_dict

# The LAION aesthetic predictor: nn.Sequential(Linear, Dropout, Linear, Dropout, Linear,
# Dropout, Linear, Linear); the Linear layers' indices.
AESTHETIC_LINEARS = (0, 2, 4, 6, 7)
AESTHETIC_KEYS = tuple(f"layers.{i}.{p}" for i in AESTHETIC_LINEARS for p in ("weight", "bias"))


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
    misshaped = _misshaped(vision, expected)
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
