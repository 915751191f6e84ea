"""The run's programs kept between runs: a second start does not trace them.

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

A file is named by all of the key but the arguments (`file_key`: known from the config
alone), and holds the whole key of the run that wrote it and what each program was lowered
for. So a run reads its file, lowers the programs for those shapes, compiles them (JAX's
cache answers) and runs the rollout and the train step once on zeros (their first call's
setup) in a thread while its model loads (`EarlyPrograms`); once its arguments exist it takes
them if the whole key is its own. A run that finds none traces and exports them, writes the
file and runs those. Either way a run with the store runs the exported programs: their
results are bit for bit the traced ones' (tests/unit/test_program_store.py,
tests/integration/test_stored_programs.py).

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

import concurrent.futures
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
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from tree_grpo_jax.errors import first_line, reason

FORMAT = 2  # of the files: a change of what they hold makes every older one a miss
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


@dataclasses.dataclass(eq=False)
class StoredProgram:
    """An exported program run in place of the traced one: called (or lowered) with the
    traced function's arguments but its static ones, which are part of it. It notes what it
    was lowered for (`arguments`), so that a later run can lower it before its arguments
    exist (`lower_ahead`), as they will be: the same program, JAX's cache's same entry."""

    exported: jax.export.Exported
    donate_argnums: tuple[int, ...] = ()
    arguments: list | None = None  # `described` arguments of the last lowering

    @functools.cached_property
    def _jitted(self):
        return jax.jit(self.exported.call, donate_argnums=self.donate_argnums)

    def lower(self, *args):
        self.arguments = described(args)
        return self._jitted.lower(*args)

    def lower_ahead(self, mesh):
        """Lowered for shapes like the `arguments` it was last lowered for (on `mesh`)."""
        return self._jitted.lower(*jax.tree_util.tree_unflatten(*_shapes(self.arguments, mesh)))

    def __call__(self, *args):
        return self._jitted(*args)


def described(args) -> list:
    """What a lowering sees of `args`: their tree and, per leaf, shape, dtype, weak type and
    where it is placed (None: not committed to a device, so the program chooses)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)

    def leaf(x):
        aval = jax.typeof(x)
        where = None
        sharding = getattr(x, "sharding", None)
        # an array placed on purpose, or shapes that say where they go (`ShapeDtypeStruct`)
        if getattr(x, "committed", not isinstance(x, jax.Array)) and sharding is not None:
            if isinstance(sharding, jax.sharding.NamedSharding):
                where = ("mesh", tuple(sharding.spec))
            else:  # one device's
                where = ("device", next(iter(sharding.device_set)).id)
        return (tuple(aval.shape), str(aval.dtype), bool(aval.weak_type), where)

    return [treedef, [leaf(x) for x in leaves]]


def _placement(where, mesh):
    if where is None:
        return None
    if where[0] == "mesh":
        return jax.sharding.NamedSharding(mesh, jax.P(*where[1]))
    return jax.sharding.SingleDeviceSharding(jax.devices()[where[1]])


def _shapes(arguments: list, mesh) -> tuple:
    treedef, leaves = arguments

    def shape(leaf):
        dims, dtype, weak, where = leaf
        sharding = _placement(where, mesh)
        return jax.ShapeDtypeStruct(dims, np.dtype(dtype), weak_type=weak, sharding=sharding)

    return treedef, [shape(leaf) for leaf in leaves]


def _zeros(arguments: list, mesh) -> list:
    """Arguments of zeros as `arguments` describes them (host arrays, placed where the run
    places its own; Python numbers where the run passes weakly typed scalars)."""
    treedef, leaves = arguments

    def zeros(leaf):
        dims, dtype, weak, where = leaf
        if weak and not dims:
            return np.zeros((), dtype).item()
        value = np.zeros(dims, dtype)
        return value if where is None else jax.device_put(value, _placement(where, mesh))

    return jax.tree_util.tree_unflatten(treedef, [zeros(leaf) for leaf in leaves])


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
    """The tree of `tree` and each leaf's shape, dtype, weak type and placement."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return [
            list(np.shape(x)),
            str(x.dtype) if hasattr(x, "dtype") else type(x).__name__,
            bool(getattr(x, "weak_type", False)),
            bool(getattr(x, "committed", False)),
            None if sharding is None else repr(sharding),
        ]

    return [str(treedef), [leaf(x) for x in leaves]]


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def file_key(config) -> str:
    """What names a run's file: everything of `key` but the arguments, known before the
    model loads (so its programs can be read and compiled meanwhile, `EarlyPrograms`)."""
    return _digest(
        {
            "format": FORMAT,
            "code": code_digest(),
            "versions": _versions(),
            "backend": _backend(),
            "config": config_fields(config),
        }
    )


def key(config, arguments) -> str:
    """The store's key for a run of `config` whose programs take `arguments` (any tree): its
    file's (`file_key`) and the arguments' tree, shapes, dtypes and placements."""
    return _digest({"file": file_key(config), "arguments": signature(arguments)})


def folder() -> pathlib.Path | None:
    """`<compilation cache folder>/programs` when JAX's persistent cache is on in a local
    folder, else None."""
    cache = jax.config.jax_compilation_cache_dir
    if not jax.config.jax_enable_compilation_cache or not cache or "://" in str(cache):
        return None
    return pathlib.Path(cache) / FOLDER


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Stored:
    """A file's content: its programs, and the `key` of the run that stored them."""

    key: str
    programs: dict[str, StoredProgram]


def read(directory: pathlib.Path, name: str) -> Stored | None:
    """The programs stored under the file key `name`, or None: none stored, or a file that
    cannot be read whole (one line says so; the caller traces them again)."""
    path = directory / f"{name}{SUFFIX}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _note(f"could not read the stored programs {path} ({reason(e)}); tracing them again.")
        return None
    try:
        stored = _decode(data, name)
    except Exception as e:  # a truncated or damaged file, whatever unpickling raises
        _note(f"the stored programs {path} are damaged ({reason(e)}); tracing them again.")
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: kept longest
    return stored


def _decode(data: bytes, name: str) -> Stored:
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise ValueError("not a programs file")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise ValueError("its checksum does not match: truncated or changed")
    stored = pickle.loads(payload)
    if stored["format"] != FORMAT or stored["file"] != name or set(stored["programs"]) != set(DUE):
        raise ValueError("it holds another key's programs")
    programs = {
        n: StoredProgram(exported, DONATED.get(n, ()), arguments)
        for n, (exported, arguments) in stored["programs"].items()
    }
    return Stored(stored["key"], programs)


def write(directory: pathlib.Path, name: str, run_key: str, programs: dict) -> None:
    """Stores `programs` (name -> `StoredProgram`, each lowered once) under the file key
    `name`, for runs whose `key` is `run_key`, whole or not at all; a failure is one line
    (the next run traces them again)."""
    try:
        payload = pickle.dumps(
            {
                "format": FORMAT,
                "file": name,
                "key": run_key,
                # the exported VJP is a local function (not picklable); no program of a run
                # takes a gradient through a stored program
                "programs": {
                    n: (dataclasses.replace(p.exported, _get_vjp=None), p.arguments)
                    for n, p in programs.items()
                },
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        directory.mkdir(parents=True, exist_ok=True)
        data = MAGIC + hashlib.sha256(payload).digest() + payload
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name[:16]}.")
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(data)
            os.chmod(temporary, 0o644)  # as JAX's cache entries beside it
            os.replace(temporary, directory / f"{name}{SUFFIX}")
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


# run once on zeros ahead: the first call of a loaded executable sets up its kernels (XLA:CPU
# builds their runtimes), seconds of the first iteration; the evaluation's is small
WARMED_UP = ("rollout", "train_step")


def may_store(config, mesh) -> bool:
    """Whether a run of `config` on `mesh` may keep its programs here (the model aside:
    `TextToImageModel.programs_from_code`)."""
    return (
        not int(config.lora.rank)
        and not config.train.updates_per_iteration
        and jax.process_count() == 1
        and mesh.devices.size == 1
    )


_early: dict = {}  # file key -> its `EarlyPrograms`, until the run takes them


def start_early(config) -> None:
    """Starts loading the stored programs of a run of `config` (`EarlyPrograms`), when JAX's
    persistent cache is on and the run may keep its programs; once per file key. The run's
    `precompile` takes them (`early_programs`) if they turn out to be its own."""
    from tree_grpo_jax import sharding

    if sharding.describes_a_job():  # several processes store nothing; and it would start
        return  # JAX's backend before the run joins its job
    directory = folder()
    if directory is None or not directory.is_dir():
        return
    name = file_key(config)
    if name in _early:
        return
    try:
        mesh = sharding.config_mesh(config)
    except ValueError:  # a mesh these devices cannot form: the run's build says so
        return
    if may_store(config, mesh):
        _early[name] = EarlyPrograms(directory, name, mesh)


def early_programs(name: str):
    """The `EarlyPrograms` started for the file key `name`, handed over once, or None."""
    return _early.pop(name, None)


class EarlyPrograms:
    """The stored programs of a run read, lowered, compiled and run once on zeros in a
    thread while the run starts (its model loads, its rewards build; XLA works without
    Python's lock), for `precompile` to take if their key is the run's."""

    def __init__(self, directory: pathlib.Path, name: str, mesh):
        self._stored = None
        self._thread = threading.Thread(
            target=self._load, args=(directory, name, mesh), name="stored-programs", daemon=True
        )
        self._thread.start()

    def _load(self, directory, name, mesh) -> None:
        stored = read(directory, name)
        if stored is None:
            return

        def ready(program_name, lowered, arguments):
            compiled = lowered.compile()
            if program_name in WARMED_UP:
                jax.block_until_ready(compiled(*_zeros(arguments, mesh)))

        try:  # each compiles (and runs) in its own thread as soon as it is lowered
            with concurrent.futures.ThreadPoolExecutor(len(stored.programs)) as pool:
                done = [
                    pool.submit(ready, n, p.lower_ahead(mesh), p.arguments)
                    for n, p in stored.programs.items()
                ]
                for future in done:
                    future.result()
        except Exception as e:  # a program of another JAX, a device that went away
            _note(f"the stored programs in {directory} could not be loaded ({first_line(e)}).")
            return
        self._stored = stored

    def result(self) -> Stored | None:
        """The stored programs, lowered and compiled (waits for them), or None."""
        self._thread.join()
        return self._stored
