"""The run's programs kept between runs: a second start neither traces nor lowers them.

Tracing a run's rollout, evaluation and train step takes seconds (about 4 s of the tiny
demo's start on two CPU cores) before JAX's persistent compilation cache can even look for
their executables. The store keeps the three exported (`jax.export`: their StableHLO and the
trees of their arguments and results) in a file keyed by everything that makes them what
they are:

- the package's code (every `.py` file of `tree_grpo_jax`, hashed) and the versions of
  Python, jax, jaxlib, flax, optax and numpy;
- the backend (its platform and version, the devices), `XLA_FLAGS` and every jax setting
  but those of its logs;
- the run's config, but for the fields that reach no program (`name`, `log`, `checkpoint`,
  `compile_cache`);
- the tree, shapes, dtypes and shardings of the programs' arguments.

A run whose key finds its file lowers the stored programs (a fraction of a second) and
compiles them, which JAX's cache answers; a run that finds none traces and exports them,
writes the file and runs those. Either way a run with the store runs the exported programs:
their results are bit for bit the traced ones' (tests/unit/test_program_store.py).

The files live in `<compilation cache folder>/programs/`, one per key. Each is written whole
under a temporary name and renamed into place, so two runs at once each read a whole file
or none; it carries a checksum, so a truncated or damaged file is one line and the programs
are traced again (and the file written anew); the `MAX_ENTRIES` most recently used are kept.

The store is on when JAX's persistent compilation cache is (`compile_cache.enabled`, a local
folder) for a run on one device in one process, with full fine-tuning and one update per
minibatch, of a model whose programs follow from the code and config alone
(`TextToImageModel.programs_from_code`: the tiny model; a folder's model reads its
architecture from files the key does not hold). Other runs trace as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import pickle
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from tree_grpo_jax.errors import first_line, reason

FORMAT = 1  # of the files: a change of what they hold makes every older one a miss
MAGIC = b"tree_grpo_jax programs\n"
MAX_ENTRIES = 16
STALE_TEMPORARY_S = 3600
SUFFIX = ".programs"
FOLDER = "programs"  # inside the compilation cache's folder
# config sections and fields that reach no program: a run that changes only these reuses
CONFIG_NOT_IN_PROGRAMS = ("name", "log.", "checkpoint.", "compile_cache.")
DUE = ("rollout", "evaluate", "train_step")  # what a file holds: every program, or no file
# per stored program, the arguments the run donates to it (its buffers reused for the outputs)
DONATED = {"train_step": (0,)}


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """An exported program run in place of the traced one: called (or lowered) with the
    traced function's arguments but its static ones, which are part of it."""

    exported: jax.export.Exported
    donate_argnums: tuple[int, ...] = ()

    @functools.cached_property
    def _jitted(self):
        return jax.jit(self.exported.call, donate_argnums=self.donate_argnums)

    def lower(self, *args):
        return self._jitted.lower(*args)

    def __call__(self, *args):
        return self._jitted(*args)


def exported_program(name: str, export: Callable[[], jax.export.Exported]) -> dict:
    """`{name: StoredProgram}` of `export()`, or `{}` and one line when JAX cannot export it
    (a host callback, a custom call without a stable ABI): the run then traces it."""
    try:
        return {name: StoredProgram(export(), DONATED.get(name, ()))}
    except Exception as e:
        _note(f"the {name} is not stored ({first_line(e)}); it is traced on every start.")
        return {}


@functools.cache
def code_digest() -> str:
    """The sha256 of every `.py` file of the package, with its path."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _versions() -> dict:
    import flax
    import jaxlib
    import optax

    return {
        "python": sys.version,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
    }


def _backend() -> dict:
    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "platform_version": devices[0].client.platform_version,
        "devices": [(d.id, d.device_kind) for d in devices],
        "processes": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_settings": {
            k: repr(v) for k, v in sorted(jax.config.values.items()) if not _reporting_only(k)
        },
    }


def _reporting_only(setting: str) -> bool:
    """jax settings that change what JAX logs, not what a program computes."""
    return bool({"log", "logging", "explain"} & set(setting.split("_")))


def config_fields(config) -> dict:
    """The config's fields that may reach a program, flat (`section.field` -> JSON value)."""
    from tree_grpo_jax.config import flatten

    return {
        path: json.loads(json.dumps(value, default=str))
        for path, value in flatten(config, leaves_only=True).items()
        if not any(
            path == k or (k.endswith(".") and path.startswith(k)) for k in CONFIG_NOT_IN_PROGRAMS
        )
    }


def signature(tree) -> list:
    """The tree of `tree` and each leaf's shape, dtype, weak type and sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return [
            list(np.shape(x)),
            str(jax.numpy.result_type(x)) if not hasattr(x, "dtype") else str(x.dtype),
            bool(getattr(x, "weak_type", False)),
            None if sharding is None else repr(sharding),
        ]

    return [str(treedef), [leaf(x) for x in leaves]]


def key(config, arguments) -> str:
    """The store's key for a run of `config` whose programs take `arguments` (any tree)."""
    text = json.dumps(
        {
            "format": FORMAT,
            "code": code_digest(),
            "versions": _versions(),
            "backend": _backend(),
            "config": config_fields(config),
            "arguments": signature(arguments),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def folder() -> pathlib.Path | None:
    """`<compilation cache folder>/programs` when JAX's persistent cache is on in a local
    folder, else None."""
    cache = jax.config.jax_compilation_cache_dir
    if not jax.config.jax_enable_compilation_cache or not cache or "://" in str(cache):
        return None
    return pathlib.Path(cache) / FOLDER


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


def read(directory: pathlib.Path, entry_key: str) -> dict[str, StoredProgram] | None:
    """The programs stored under `entry_key`, or None: none stored, or a file that cannot be
    read whole (one line says so; the caller traces them again)."""
    path = directory / f"{entry_key}{SUFFIX}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _note(f"could not read the stored programs {path} ({reason(e)}); tracing them again.")
        return None
    try:
        programs = _decode(data, entry_key)
    except Exception as e:  # a truncated or damaged file, whatever unpickling raises
        _note(f"the stored programs {path} are damaged ({reason(e)}); tracing them again.")
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: kept longest
    return programs


def _decode(data: bytes, entry_key: str) -> dict[str, StoredProgram]:
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise ValueError("not a programs file")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise ValueError("its checksum does not match: truncated or changed")
    stored = pickle.loads(payload)
    if stored["format"] != FORMAT or stored["key"] != entry_key:
        raise ValueError("it holds another key's programs")
    return {
        name: StoredProgram(exported, DONATED.get(name, ()))
        for name, exported in stored["programs"].items()
    }


def write(directory: pathlib.Path, entry_key: str, exported: dict) -> None:
    """Stores `exported` (name -> `jax.export.Exported`) under `entry_key`, whole or not at
    all; a failure is one line (the next run traces them again)."""
    try:
        programs = {
            # the exported VJP is a local function (not picklable); no program of a run
            # takes a gradient through a stored program
            name: dataclasses.replace(e, _get_vjp=None)
            for name, e in exported.items()
        }
        payload = pickle.dumps(
            {"format": FORMAT, "key": entry_key, "programs": programs},
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        directory.mkdir(parents=True, exist_ok=True)
        data = MAGIC + hashlib.sha256(payload).digest() + payload
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{entry_key[:16]}.")
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(data)
            os.chmod(temporary, 0o644)  # as JAX's cache entries beside it
            os.replace(temporary, directory / f"{entry_key}{SUFFIX}")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except Exception as e:  # a full disk, a read-only folder, a program JAX cannot pickle
        _note(f"the run's programs could not be stored in {directory} ({reason(e)}).")
        return
    _evict(directory)


def _evict(directory: pathlib.Path) -> None:
    """Removes all but the `MAX_ENTRIES` most recently used files, and what a process
    killed while writing left (a temporary file an hour old); another run's removal of the
    same file is no error."""
    entries, now = [], time.time()
    for path in directory.iterdir():
        try:
            modified = path.stat().st_mtime
        except OSError:
            continue
        if path.name.endswith(SUFFIX):
            entries.append((modified, path))
        elif path.name.startswith(".") and now - modified > STALE_TEMPORARY_S:
            with contextlib.suppress(OSError):
                path.unlink()
    for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        with contextlib.suppress(OSError):
            path.unlink()
