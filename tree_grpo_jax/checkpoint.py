"""Checkpoints that resume a run exactly, and refuse to resume another run.

Orbax saves the array state (params, optimizer state) and a small JSON document with
everything else that decides the next iteration: the iteration count, the base RNG key,
the tree-window position, the statistics trackers, the prompt iterator's position and the
run's fingerprint. A checkpoint whose own files are damaged (missing, truncated, corrupt) is
set aside (renamed, never deleted) and the newest readable one is used instead; a checkpoint
that holds another training state than the code builds, or that storage refuses to hand over
(permission denied, unreachable), stops the run with one sentence and nothing is renamed.

The folder may be local or a URL that etils' `epath` reaches (gs:// on TPU pods). With
several processes all of them save and restore together; the primary one tidies the folder.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message is one sentence for the user."""


class _Damaged(Exception):
    """A checkpoint step whose own files are missing or unreadable."""


# tensorstore (orbax's array storage) reports every error as a ValueError led by its status
# code. These codes say the storage itself refused or failed, whatever the files hold.
_STORAGE_CODES = (
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
    "ABORTED",
)
_STORAGE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EIO, errno.ETIMEDOUT, errno.ESTALE}
# What reading damaged files raises: tensorstore's ValueErrors (DATA_LOSS, NOT_FOUND,
# OUT_OF_RANGE, FAILED_PRECONDITION ...), bad JSON or text, an item that is not there
# (KeyError), a missing or cut-short file. orbax wraps the array errors in a bare Exception,
# so the whole chain of causes is searched.
_DAMAGE_TYPES = (ValueError, KeyError, EOFError, FileNotFoundError, NotADirectoryError, _Damaged)


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and the members of exception groups among them."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return seen


def _is_storage_problem(e: BaseException) -> bool:
    if isinstance(e, (PermissionError, ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
        return True
    text = str(e)
    return isinstance(e, ValueError) and any(code in text for code in _STORAGE_CODES)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    reason = text.splitlines()[0][:200] if text else repr(e)
    return f"{type(e).__name__}: {reason}"


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_specs(tree) -> dict[str, tuple[tuple[int, ...] | None, np.dtype | None]]:
    """path -> (shape, dtype) of every leaf (None where the leaf does not say); paths as
    orbax names them ("opt_state.1.mu.w"), so a saved tree's metadata and a live state (its
    dataclasses, named tuples and dicts) compare leaf by leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    specs = {}
    for path, leaf in leaves:
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None and isinstance(leaf, (int, float, complex, bool, np.generic)):
            shape, dtype = (), np.asarray(leaf).dtype
        specs[".".join(_key_name(k) for k in path)] = (
            None if shape is None else tuple(shape),
            None if dtype is None else np.dtype(dtype),
        )
    return specs


def _same_spec(a, b) -> bool:  # what one side does not say is not held against it
    return all(x is None or y is None or x == y for x, y in zip(a, b))


def _spec_text(spec) -> str:
    shape, dtype = spec
    return " ".join(str(x) for x in (shape, dtype) if x is not None) or "unknown"


def state_mismatch(saved: Any, target: Any) -> str | None:
    """What differs between a saved state's metadata tree and a target state (the leaves one
    has and the other lacks, and the shapes or dtypes that differ); None if they agree."""
    have, want = _leaf_specs(saved), _leaf_specs(target)
    # In the target's leaf order (its params first), then the saved tree's.
    differences = [f"it lacks {k}, which this code has" for k in want if k not in have]
    differences += [f"it has {k}, which this code does not" for k in have if k not in want]
    differences += [
        f"its {k} is {_spec_text(have[k])} where this code has {_spec_text(want[k])}"
        for k in want
        if k in have and not _same_spec(have[k], want[k])
    ]
    if not differences:
        return None
    more = f" (and {len(differences) - 3} more differences)" if len(differences) > 3 else ""
    return ", ".join(differences[:3]) + more


def as_path(directory: str) -> epath.Path:
    """A local folder (made absolute) or a URL such as gs://bucket/run/checkpoints."""
    directory = os.fspath(directory)
    return epath.Path(directory if "://" in directory else os.path.abspath(directory))


def check_writable(directory: str) -> None:
    """Fails before training starts rather than after the first hour."""
    try:
        path = as_path(directory)
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{os.getpid()}.{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {directory}: {e.strerror or e}.") from e


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """One sentence naming what differs between two run fingerprints; None if they agree."""
    keys = sorted(set(saved) | set(current))
    differ = [k for k in keys if saved.get(k) != current.get(k)]
    if not differ:
        return None
    shown = "; ".join(f"{k} was {saved.get(k)!r}, now {current.get(k)!r}" for k in differ[:3])
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    return f"{shown}{more}"


class Checkpointer:
    """Orbax checkpoints of one run's state in `directory`.

    `read_only` opens an existing folder for restoring (export) and never writes to it.
    """

    def __init__(self, directory: str, keep: int = 3, read_only: bool = False):
        path = as_path(directory)
        self.directory = str(path)
        self.keep = keep
        self.protected: set[int] = set()  # steps kept beyond `keep` (the best eval's)
        if read_only:
            if not path.is_dir():
                raise CheckpointError(f"there is no checkpoint folder {self.directory}.")
        elif jax.process_index() == 0:
            check_writable(self.directory)
            # A save cut short by a kill leaves a temporary folder; the run holds the
            # workdir's lock, so no other run is writing it.
            for child in path.iterdir():
                if ".orbax-checkpoint-tmp" in child.name:
                    child.rmtree(missing_ok=True)
        if jax.process_count() > 1:  # nobody saves before the folder is tidy
            multihost_utils.sync_global_devices("tree_grpo_jax: checkpoint folder ready")
        # `keep` is applied by `save` itself, so that a protected step outlives it
        options = ocp.CheckpointManagerOptions(create=not read_only, read_only=read_only)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
        self.read_only = read_only

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        if step in self._manager.all_steps():
            return
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args)
        self._manager.wait_until_finished()
        steps = self.all_steps()
        for old in steps[: max(len(steps) - self.keep, 0)]:
            if old not in self.protected:
                self._manager.delete(old)

    def protect(self, step: int | None) -> None:
        """Keeps checkpoint `step` whatever `keep` says (None: no step is protected)."""
        self.protected = set() if step is None else {int(step)}

    def _restore(self, step: int, target_state: Any | None) -> tuple[Any, dict]:
        saved = self._manager.item_metadata(step)["state"]
        if saved is None:
            raise _Damaged(f"checkpoint {step} lacks the metadata of its state")
        if target_state is None:  # as saved, on this process's first device (whatever the
            # mesh it was saved from: a pod's checkpoint exports on one machine)
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            abstract = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved
            )
        else:
            # Checked before reading: orbax's own errors for a tree that does not fit look
            # like those of damaged files, and a good checkpoint must never be set aside.
            differs = state_mismatch(saved, target_state)
            if differs:
                raise CheckpointError(
                    f"checkpoint {step} in {self.directory} holds another training state than "
                    f"this code builds ({differs}); resume it with the code that saved it or "
                    "choose another --workdir (no checkpoint was changed)."
                )
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target_state)
        state_args = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        )
        if restored.meta is None or restored.state is None:
            raise _Damaged(f"checkpoint {step} lacks its state or its meta document")
        return restored.state, restored.meta

    def _probe(self, step: int) -> None:
        """Lists checkpoint `step`'s folders and reads their small metadata files: orbax
        reads metadata leniently (a folder it may not list reads as empty, a file it may not
        open as missing), so a storage error there would otherwise pass for damage."""
        folder = as_path(self.directory) / str(step)
        for child in folder.iterdir():
            if child.is_dir():
                for inner in child.iterdir():
                    if inner.name in ("_METADATA", "metadata") and inner.is_file():
                        inner.read_bytes()
            elif child.name == "_CHECKPOINT_METADATA":
                child.read_bytes()

    def _unusable(self, step: int, error: Exception) -> CheckpointError | None:
        """None when `error` (raised reading checkpoint `step`) says its files are damaged;
        otherwise the one-sentence CheckpointError to stop with, leaving the checkpoint be."""
        causes = _causes(error)
        try:
            self._probe(step)
        except Exception as probe_error:  # noqa: BLE001 - only a storage error counts here
            causes += _causes(probe_error)
        storage = next((e for e in causes if _is_storage_problem(e)), None)
        if storage is not None:
            return CheckpointError(
                f"checkpoint {step} in {self.directory} cannot be read ({_one_line(storage)}), "
                "a storage problem rather than a damaged file; fix the folder's access and "
                "rerun (no checkpoint was changed)."
            )
        if any(isinstance(e, _DAMAGE_TYPES) for e in causes):
            return None
        return CheckpointError(
            f"restoring checkpoint {step} from {self.directory} failed ({_one_line(error)}), "
            "which is not what a damaged file raises; fix the cause and rerun (no checkpoint "
            "was changed)."
        )

    def restore(self, target_state: Any | None = None, step: int | None = None):
        """(state, meta, step) of the newest readable checkpoint (or of `step`).

        The state takes the structure, dtypes and shardings of `target_state` (when None:
        as saved, on one device). A checkpoint whose files are damaged is reported in one line,
        set aside as `<step>.unreadable-<time>` unless the folder is read-only, and the next
        older one is tried. A saved state whose leaves, shapes or dtypes differ from
        `target_state`'s, a storage error (permission denied, unreachable) or any other
        failure raises CheckpointError and renames nothing.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        for candidate in steps:
            try:
                state, meta = self._restore(candidate, target_state)
                return state, meta, candidate
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted into damage and the rest below
                stop = self._unusable(candidate, e)
                if stop is not None:
                    raise stop from e
                damage = next((c for c in _causes(e) if isinstance(c, _DAMAGE_TYPES)), e)
                print(
                    f"warning: checkpoint {candidate} in {self.directory} cannot be read "
                    f"({_one_line(damage)}); trying an older one.",
                    file=sys.stderr,
                    flush=True,
                )
                if not self.read_only:
                    self._set_aside(candidate)
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be read (tried {len(steps)}); "
            "move the folder away to start over."
        )

    def read_meta(self) -> dict:
        """The meta document of the newest checkpoint whose meta can be read ({} if none)."""
        for step in self.all_steps()[::-1]:
            try:
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )
            except Exception as e:  # noqa: BLE001 - damage: `restore` reports it, sets it aside
                stop = self._unusable(step, e)
                if stop is not None:
                    raise stop from e
                continue
            if restored.meta is not None:
                return restored.meta
        return {}

    def restore_params(self, step: int | None = None) -> Any:
        """The trained parameters alone, as saved (no target needed): for export."""
        state, _, _ = self.restore(None, step)
        return state["params"]

    def _set_aside(self, step: int) -> None:
        path = as_path(self.directory) / str(step)
        if jax.process_index() == 0 and path.exists():
            path.rename(path.parent / f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"tree_grpo_jax: set aside {step}")
        self._manager.reload()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
