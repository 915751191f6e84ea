"""JAX's persistent compilation cache: a second run with the same programs starts warm.

`enable()` points JAX at a cache folder and lowers the thresholds so that every program is
written: the CPU compiles of a few seconds that dominate a small run, and the two hundred
small ones (array operations run one by one on the host side, each some tens of ms to
compile) that JAX's defaults skip as under a second and a warm start would otherwise
compile again. Call it once, before the first compile; the trainer's
entry point does, unless switched off.

The default folder is `$XDG_CACHE_HOME/tree_grpo_jax/jax`, or `~/.cache/tree_grpo_jax/jax`.
Entries are keyed by the program, the JAX/jaxlib version and the device, so one folder
serves every run and model on a machine; deleting it only costs a cold start. Its
`programs/` subfolder is the program store's (`run.program_store`: the traced programs
themselves, which spares a later run their tracing).
"""

from __future__ import annotations

import os
import pathlib

import jax

ENV_DIR = "TREE_GRPO_JAX_COMPILE_CACHE"  # overrides the default folder
MIN_COMPILE_TIME_S = 0.0  # cache every program, however quick its compile
MIN_ENTRY_SIZE_BYTES = 0  # however small the executable


def default_dir() -> pathlib.Path:
    """`$TREE_GRPO_JAX_COMPILE_CACHE`, else `$XDG_CACHE_HOME/tree_grpo_jax/jax`, else
    `~/.cache/tree_grpo_jax/jax`."""
    if os.environ.get(ENV_DIR):
        return pathlib.Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "tree_grpo_jax" / "jax"


def enable(
    path: str | os.PathLike | None = None,
    *,
    min_compile_time_s: float = MIN_COMPILE_TIME_S,
    min_entry_size_bytes: int = MIN_ENTRY_SIZE_BYTES,
) -> pathlib.Path:
    """Turns the persistent compilation cache on in `path` (default: `default_dir()`),
    creating the folder; returns it. Idempotent."""
    folder = pathlib.Path(path).expanduser() if path else default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    changed = jax.config.jax_compilation_cache_dir != str(folder)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    if changed:
        _reset()  # JAX opens its cache once, at the first compile: let it reopen here
    return folder


def disable() -> None:
    """Turns the persistent cache off for this process (compiles stay in memory only)."""
    jax.config.update("jax_enable_compilation_cache", False)
    _reset()


def _reset() -> None:
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - a JAX without it has nothing to reset
        return
    if compilation_cache.is_initialized():
        compilation_cache.reset_cache()
