"""Reading the inputs, as numpy arrays.

The pickled torch release (`torch.load(..., weights_only=True)`), what kind of state dict it
looks like, and a transformers CLIP folder's config and safetensors (no pickle).
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from tree_grpo_jax.rewards.convert.errors import (
    ConversionError,
    _import_torch,
    _reason,
    _unreadable,
)


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
        except OSError as e:
            raise _unreadable("CLIP weights file", shard, e) from None
        except (SafetensorError, ValueError, TypeError) as e:
            raise ConversionError(
                f"CLIP weights file {shard} is damaged or truncated ({_reason(e)})."
            ) from None
    return config, vision, names
