"""The tiny model's weight files: Flax msgpack in `tree_grpo_jax/assets/`, checked on load."""

from __future__ import annotations

import pathlib

import flax.serialization
import jax
import numpy as np

from tree_grpo_jax.errors import reason
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.tiny.networks import init_weights

ASSETS_DIR = pathlib.Path(__file__).resolve().parents[2] / "assets"
KINDS = ("ddim", "flow")
FORMAT_VERSION = 1
TRAIN_COMMAND = "python -m tree_grpo_jax.models.tiny.train --out-dir=tree_grpo_jax/assets"


def weights_path(kind: str) -> pathlib.Path:
    """The shipped weights of one twin."""
    return ASSETS_DIR / f"tiny_{kind}.msgpack"


def read_payload(path, what: str, command: str) -> dict:
    """A Flax msgpack file as a dict; a missing, damaged or truncated file is one sentence.

    `what` names the contents ("tiny model weights") and `command` rebuilds the file.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} is missing; run `{command}`.")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"could not read {what} file {path}: {e.strerror or e}.") from None
    try:
        payload = flax.serialization.msgpack_restore(data)
    except Exception as e:  # msgpack's ExtraData, UnpackValueError, ValueError, ...
        raise ModelLoadError(
            f"{what} file {path} is damaged or truncated and cannot be read "
            f"({reason(e)}); rebuild it with `{command}`."
        ) from None
    if not isinstance(payload, dict):
        raise ModelLoadError(
            f"{what} file {path} is not a weights file (it decodes to a "
            f"{type(payload).__name__}); rebuild it with `{command}`."
        )
    return payload


def save_weights(path, weights: dict, kind: str, storage_dtype=np.float16) -> None:
    """Writes `{"unet", "text_encoder"}` as Flax msgpack; float16 storage halves the file."""
    payload = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "weights": jax.tree.map(lambda a: np.asarray(a, storage_dtype), weights),
    }
    pathlib.Path(path).write_bytes(flax.serialization.msgpack_serialize(payload))


def load_weights(path, kind: str) -> dict:
    """Reads a file written by `save_weights` and checks it against this architecture."""
    payload = read_payload(path, "tiny model weights", f"{TRAIN_COMMAND} --kind={kind}")
    if payload.get("format_version") != FORMAT_VERSION or payload.get("kind") != kind:
        raise ModelLoadError(
            f"{path} holds format {payload.get('format_version')!r} of kind "
            f"{payload.get('kind')!r}; expected format {FORMAT_VERSION} of kind {kind!r}."
        )
    weights = payload.get("weights")
    expected = jax.eval_shape(init_weights, jax.random.key(0))
    shapes = jax.tree.map(lambda a: getattr(a, "shape", None), weights)
    if weights is None or shapes != jax.tree.map(lambda a: a.shape, expected):
        raise ModelLoadError(f"{path} does not match the tiny model's architecture.")
    return jax.tree.map(lambda a: np.asarray(a, np.float32), weights)
