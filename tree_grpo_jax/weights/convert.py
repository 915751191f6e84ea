"""PyTorch-named weights <-> Flax param trees, in numpy only (torch is never imported).

Model and reward folders ship PyTorch `*.safetensors` files. The Flax modules we run
(our `models.unet` UNet, named as diffusers' former Flax UNet; our `models.autoencoder_kl`
VAE, named as diffusers' former `FlaxAutoencoderKL`; our `models.clip`, named as
transformers' Flax CLIP) hold the same tensors under other names and layouts:

- module lists: diffusers' Flax modules name them `down_blocks_0` where PyTorch says
  `down_blocks.0`; the CLIP towers keep `layers/0` as two path segments;
- leaves: conv `weight` [O, I, H, W] -> `kernel` [H, W, I, O] (a video model's Conv3d
  [O, I, T, H, W] -> [T, H, W, I, O]), linear `weight` -> transposed
  `kernel`, norm `weight` -> `scale` (or `weight` where the Flax module keeps that name),
  embedding `weight` -> `embedding`;
- the VAE's attention keeps the old names (`query`, `key`, `value`, `proj_attn`) where
  recent PyTorch files say `to_q`, `to_k`, `to_v`, `to_out.0`.

Which Flax leaf a PyTorch `weight` becomes is decided by the reference tree (the Flax
module's own init shapes), so the mapping needs no per-architecture table.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tree_grpo_jax.errors import UserError
from tree_grpo_jax.weights.files import ModelLoadError

FlatTree = dict[tuple[str, ...], np.ndarray]
FlatShapes = Mapping[tuple[str, ...], tuple[int, ...]]

# Buffers that PyTorch files may carry but that are not parameters.
_BUFFERS = ("position_ids",)
# PyTorch (new) -> Flax (old) attention names, tried only where the Flax tree has them.
_ATTENTION_RENAMES = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out_0": "proj_attn"}
# Flax leaf names a PyTorch `weight` (or old `gamma`) may become, most specific first; a Flax
# leaf literally named `weight` (transformers' Flax T5 layer norm) takes it unchanged.
_WEIGHT_LEAVES = ("scale", "embedding", "kernel", "weight")
# diffusers module lists: Flax `name_N` is PyTorch `name.N` only for these names
# (`time_embedding.linear_1` is a plain attribute in both).
DIFFUSERS_LIST_NAMES = frozenset(
    {
        "down_blocks",
        "up_blocks",
        "attentions",
        "resnets",
        "downsamplers",
        "upsamplers",
        "transformer_blocks",
        "single_transformer_blocks",
        "blocks",  # WanTransformer3DModel's blocks (a LoRA's PEFT keys name them `blocks.N`)
        "to_out",
        "net",
    }
)
_MAX_NAMED = 5


class ParamTreeMismatch(UserError):
    """Converted weights do not fit the Flax module's parameter tree."""


def shapes_of(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flat {path: shape} of a param tree (arrays or `jax.eval_shape` structs)."""
    return {k: tuple(v.shape) for k, v in flatten_dict(dict(tree)).items()}


def _module_path(pt_key: str, merge_indices: bool) -> tuple[str, ...]:
    parts = pt_key.split(".")
    if not merge_indices:
        return tuple(parts)
    merged: list[str] = []
    for part in parts:
        if part.isdigit() and merged:
            merged[-1] = f"{merged[-1]}_{part}"
        else:
            merged.append(part)
    return tuple(merged)


# conv kernels by rank: PyTorch [O, I, *window] -> Flax [*window, I, O], and back
_CONV_TO_FLAX = {4: (2, 3, 1, 0), 5: (2, 3, 4, 1, 0)}  # OIHW -> HWIO, OITHW -> THWIO
_CONV_TO_PYTORCH = {4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}


def _to_kernel(value: np.ndarray, target_ndim: int) -> np.ndarray:
    if value.ndim == 4 and target_ndim == 2:
        # Old checkpoints store attention projections as 1x1 convs.
        value = value[:, :, 0, 0]
    if value.ndim in _CONV_TO_FLAX:
        return np.transpose(value, _CONV_TO_FLAX[value.ndim])
    if value.ndim == 2:
        return value.T
    return value


def _resolve(path: tuple[str, ...], value: np.ndarray, reference: FlatShapes):
    """The Flax key and value of one PyTorch tensor, or (None, None) if nothing fits."""
    module, leaf = path[:-1], path[-1]
    modules = [module]
    if module and module[-1] in _ATTENTION_RENAMES:
        modules.append(module[:-1] + (_ATTENTION_RENAMES[module[-1]],))
    if leaf in ("weight", "gamma"):
        leaves = _WEIGHT_LEAVES
    elif leaf in ("bias", "beta"):
        leaves = ("bias",)
    else:
        leaves = (leaf,)
    for mod in modules:
        for flax_leaf in leaves:
            key = mod + (flax_leaf,)
            if key not in reference:
                continue
            if flax_leaf == "kernel":
                return key, _to_kernel(value, len(reference[key]))
            return key, value
    return None, None


def _describe(keys, label: str) -> str:
    names = sorted("/".join(k) if isinstance(k, tuple) else k for k in keys)
    shown = ", ".join(names[:_MAX_NAMED])
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return f"{label} {shown}{more}"


def check_against_reference(flat: FlatTree, reference: FlatShapes, extra_pt_keys=()) -> None:
    """Raises ParamTreeMismatch naming missing, unexpected and mis-shaped keys."""
    missing = [k for k in reference if k not in flat]
    unexpected = list(extra_pt_keys) + [k for k in flat if k not in reference]
    wrong = [
        f"{'/'.join(k)} {tuple(v.shape)} (expected {tuple(reference[k])})"
        for k, v in flat.items()
        if k in reference and tuple(v.shape) != tuple(reference[k])
    ]
    problems = []
    if missing:
        problems.append(_describe(missing, "missing"))
    if unexpected:
        problems.append(_describe(unexpected, "unexpected"))
    if wrong:
        problems.append(f"wrong shape {', '.join(wrong[:_MAX_NAMED])}")
    if problems:
        raise ParamTreeMismatch("; ".join(problems))


def pytorch_to_flax(
    state: Mapping[str, np.ndarray], reference: FlatShapes, *, merge_indices: bool = True
) -> dict:
    """Converts a PyTorch-named state dict of numpy arrays into a nested Flax param dict.

    `reference` is the Flax module's flat {path: shape}; `merge_indices` is True for
    diffusers modules (`down_blocks_0`) and False for transformers ones (`layers/0`).
    Raises ParamTreeMismatch when the result does not match `reference` exactly.
    """
    flat: FlatTree = {}
    unmatched = []
    for pt_key, value in state.items():
        if pt_key.rsplit(".", 1)[-1] in _BUFFERS:
            continue
        key, converted = _resolve(_module_path(pt_key, merge_indices), np.asarray(value), reference)
        if key is None:
            unmatched.append(pt_key)
        else:
            flat[key] = converted
    check_against_reference(flat, reference, unmatched)
    return unflatten_dict(flat)


def _pt_segment(segment: str, list_names) -> str:
    match = re.fullmatch(r"(.+)_(\d+)", segment)
    if match and match.group(1) in list_names:
        return f"{match.group(1)}.{match.group(2)}"
    return segment


def flax_to_pytorch(params, *, list_names=DIFFUSERS_LIST_NAMES) -> dict[str, np.ndarray]:
    """The inverse of `pytorch_to_flax` for diffusers-named modules (the UNet).

    Returns {PyTorch key: numpy array} with PyTorch layouts (OIHW and OITHW convs, [out, in]
    linears).
    """
    state = {}
    for path, value in flatten_dict(dict(params)).items():
        value = np.asarray(value)
        module = ".".join(_pt_segment(s, list_names) for s in path[:-1])
        leaf = path[-1]
        if leaf == "kernel":
            to_pytorch = _CONV_TO_PYTORCH.get(value.ndim)
            value = value.T if to_pytorch is None else np.transpose(value, to_pytorch)
        pt_leaf = "weight" if leaf in ("kernel", "scale", "embedding") else leaf
        state[f"{module}.{pt_leaf}" if module else pt_leaf] = np.ascontiguousarray(value)
    return state


@contextlib.contextmanager
def weights_of(folder, hint: str):
    """Within it, a ParamTreeMismatch (the weights read from `folder` against the module its
    config builds) becomes one ModelLoadError sentence naming the folder."""
    try:
        yield
    except ParamTreeMismatch as e:
        raise ModelLoadError(
            f"the weights in {folder} do not match its config ({e}); {hint}."
        ) from None


def folder_to_flax(folder, state, reference: FlatShapes, hint: str, *, merge_indices=True):
    """`pytorch_to_flax` for the weights read from `folder`: a mismatch with the module's
    `reference` is one ModelLoadError sentence naming the folder."""
    with weights_of(folder, hint):
        return pytorch_to_flax(state, reference, merge_indices=merge_indices)
