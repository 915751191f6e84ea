"""The dtypes of the written weights: the `--dtype` choices, the casts, the config's record."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from tree_grpo_jax.rewards.convert.errors import ConversionError

OUTPUT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "keep": None,
}


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
