"""The converter's error, `ConversionError`, and the pieces of its one-sentence messages.

Also the optional imports (torch, transformers), which fail as a `ConversionError`.
"""

from __future__ import annotations

from tree_grpo_jax.errors import UserError, first_line

_MAX_NAMED = 5


class ConversionError(UserError):
    """A release, folder or option that cannot be converted; the message is one sentence."""


def _reason(error: BaseException) -> str:
    # torch's messages run on for sentences: the first one only
    text = first_line(error, default="").rstrip(".").split(". ")[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _named(names, limit: int = _MAX_NAMED) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def _unreadable(what: str, path, error: OSError) -> ConversionError:
    """The sentence for a file `what` at `path` that the OS would not read."""
    if isinstance(error, FileNotFoundError):
        return ConversionError(f"{what} {path} does not exist.")
    return ConversionError(f"could not read {what} {path}: {error.strerror or error}.")


def _misshaped(tensors, expected) -> list[tuple[str, tuple, tuple]]:
    """(name, shape, expected shape) of each tensor in `expected` whose shape is another."""
    return [
        (k, tuple(v.shape), tuple(expected[k]))
        for k, v in tensors.items()
        if k in expected and tuple(v.shape) != tuple(expected[k])
    ]


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
