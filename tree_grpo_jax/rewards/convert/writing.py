"""Writing the converted folder: the `--out` check and the staged write.

JSON, text and safetensors files are written beside `--out` and moved into place whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from safetensors.numpy import save_file

from tree_grpo_jax.rewards.convert.errors import ConversionError
from tree_grpo_jax.weights import staging


def check_out_dir(out, overwrite: bool, sources=()) -> Path:
    """The resolved output folder, after refusing one that would overwrite work or a source."""
    try:
        staging.check_out_dir(None, out, overwrite, sources, what="the output folder")
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

    def fill(folder: Path) -> None:
        for name, content in files.items():
            path = folder / name
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            elif name.endswith(".safetensors"):
                save_file(dict(content), path, metadata={"format": "pt"})
                os.chmod(path, 0o666 & ~umask)  # safetensors creates its files owner-only
            else:
                _write_json(path, content)

    return staging.write_staged(out, fill)


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
