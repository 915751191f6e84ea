"""Checkpoints that resume a run exactly, and refuse to resume another run.

Orbax saves the array state (params, optimizer state) and a small JSON document with
everything else that decides the next iteration: the iteration count, the base RNG key,
the tree-window position, the statistics trackers, the prompt iterator's position and the
run's fingerprint. A checkpoint whose own files are damaged (missing, truncated, corrupt) is
set aside (renamed, never deleted) and the newest readable one is used instead; a checkpoint
that holds another training state than the code builds, or that storage refuses to hand over
(permission denied, unreachable), stops the run with one sentence and nothing is renamed.

Every save records, in the meta document, a digest of each array of the state (two uint32
sums over its bits, the same whatever the mesh: on the host when one process holds the whole
state, on the devices when it is sharded over several processes); a restore recomputes them
over what it read, so bits changed on disk since the save (files that still read cleanly)
count as damage like any other (`run.digests`). Checkpoints saved without digests restore
unchecked.

Host arrays that differ between processes (the replay buffer's rows, each process its own)
are saved beside the steps, one numpy archive per step and process in `host_state/`, written
before the step itself (a step that exists has them) and removed with it; the archive's own
checksums tell damage.

The folder may be local or a URL that etils' `epath` reaches (gs:// on TPU pods). With
several processes all of them save and restore together; the primary one tidies the folder.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from tree_grpo_jax import interrupts
from tree_grpo_jax.errors import reason
from tree_grpo_jax.run.digests import (
    DIGESTS_KEY,
    first_digest_mismatch,
    named_leaves,
    state_digests,
)
from tree_grpo_jax.weights import stacking

HOST_FOLDER = "host_state"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message is one sentence for the user."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a storage that refused); the ones
    before it are kept. The message is one sentence for the user."""


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


def _save_failure(error: BaseException) -> str:
    """What stopped a save, in a few words: a full disk named as such."""
    for e in _causes(error):
        text = str(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            return "no space left on the device"
    return reason(error)


def _leaf_specs(tree) -> dict[str, tuple[tuple[int, ...] | None, np.dtype | None]]:
    """path -> (shape, dtype) of every leaf (None where the leaf does not say)."""
    specs = {}
    for path, leaf in named_leaves(tree):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None and isinstance(leaf, (int, float, complex, bool, np.generic)):
            shape, dtype = (), np.asarray(leaf).dtype
        specs[path] = (
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


def _stacks_blocks(tree) -> bool:
    """Whether a state holds scanned blocks (a module name `weights.stacking` stacks)."""
    return any(
        stacking.parse(part) is not None
        for path, _ in named_leaves(tree)
        for part in path.split(".")
    )


def scan_layers_hint(saved: Any, target: Any) -> str | None:
    """What to set when a saved state and a target differ in how they hold the transformer's
    blocks (one by one, or scanned runs stacked: `model.scan_layers`); None otherwise."""
    saved_stacked, target_stacked = _stacks_blocks(saved), _stacks_blocks(target)
    if saved_stacked == target_stacked:
        return None
    held = "stacked in scanned runs" if saved_stacked else "one by one"
    return (
        f"it holds the transformer's blocks {held}: resume it with "
        f"--config.model.scan_layers={saved_stacked}"
    )


class _NoPreviousSaveWait(logging.Filter):
    """orbax counts the wait `Checkpointer.save` makes for its own save to finish as the
    next save's wait for the previous one, and warns about it when it took over a second;
    no save here ever waits for a previous one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            (
                "Waiting for previous save to complete",
                # options it adjusts for a folder opened read-only on purpose
                "CheckpointManagerOptions.read_only=True",
            )
        )


class _NoSaveErrors(logging.Filter):
    """While a save runs: its failure, which orbax logs from every thread it ran on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


# orbax logs through absl, whose records all come from this logger.
logging.getLogger("absl").addFilter(_NoPreviousSaveWait())


def _abandoned_read(unraisable) -> bool:
    """When one array of a checkpoint fails to read, orbax abandons the others in flight:
    their coroutines raise again as they are collected, and tensorstore's callbacks find
    the event loop closed. Python reports each as an "Exception ignored" traceback (with
    TensorStore's whole multi-line spec) at any later moment, up to the process's exit.
    The failure itself was already reported (the checkpointer's warning line)."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def drop_abandoned_read_reports() -> None:
    """Filters those reports out of `sys.unraisablehook` for the rest of the process (they
    come after the restore has returned); every other one goes to the hook as before."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(unraisable) -> None:
        if not _abandoned_read(unraisable):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def quiet_orbax_reads():
    """orbax's own log lines silenced while checkpoints are opened and read: that a
    read-only folder is read-only, and every file of a damaged checkpoint it fails to parse,
    which the checkpointer's one warning line per damaged checkpoint already says."""
    drop_abandoned_read_reports()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def as_path(directory: str) -> epath.Path:
    """A local folder (made absolute) or a URL such as gs://bucket/run/checkpoints."""
    directory = os.fspath(directory)
    return epath.Path(directory if "://" in directory else os.path.abspath(directory))


def broken_link(directory: str) -> str | None:
    """The local folder or parent of it that is a symbolic link leading nowhere (a loop, or
    a missing target), which mkdir would report as "File exists"; None if none is."""
    if "://" in str(directory):
        return None
    path = os.path.abspath(directory)
    while path != os.path.dirname(path):
        if os.path.islink(path) and not os.path.exists(path):
            return path
        path = os.path.dirname(path)
    return None


def missing_folders(directory: str) -> list[str]:
    """`directory` (local) and those of its parents that do not exist yet, deepest first."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def check_writable(directory: str) -> None:
    """Fails before training starts rather than after the first hour; the folders it made
    before failing go again."""
    link = broken_link(directory)
    if link is not None:
        raise CheckpointError(
            f"cannot write to {directory}: {link} is a symbolic link that leads nowhere (a "
            "loop or a missing target); remove it or choose another folder."
        )
    made = [] if "://" in str(directory) else missing_folders(directory)
    try:
        path = as_path(directory)
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{os.getpid()}.{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        for folder in made:  # deepest first; one not empty is not ours alone: kept
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise CheckpointError(f"cannot write checkpoints to {directory}: {e.strerror or e}.") from e
    except ImportError as e:  # fsspec's filesystem for the URL's scheme is not installed
        scheme = str(directory).split("://", 1)[0]
        package = {"gs": "gcsfs", "s3": "s3fs"}.get(scheme, f"the fsspec package for {scheme}://")
        raise CheckpointError(
            f"checkpoints in {directory} need {package}, which is not installed "
            f"(pip install {package}), or a local checkpoint.dir."
        ) from e


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
        self.unreadable: dict[int, str] = {}  # steps `restore` passed over, and why
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
        with quiet_orbax_reads():
            self._manager = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
        self.read_only = read_only

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def _host_file(self, step: int) -> epath.Path:
        name = f"{step}.process{jax.process_index()}.npz"
        return as_path(self.directory) / HOST_FOLDER / name

    def _write_host_arrays(self, step: int, arrays: dict) -> None:
        path = self._host_file(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f"{path.name}.partial"
        with partial.open("wb") as f:
            np.savez(f, **arrays)
        partial.rename(path)

    def read_host_arrays(self, step: int) -> dict[str, np.ndarray]:
        """This process's host arrays saved with checkpoint `step`; one sentence
        (CheckpointError) when they are missing or damaged."""
        path = self._host_file(step)
        try:
            with path.open("rb") as f, np.load(f) as saved:
                return {name: saved[name] for name in saved.files}
        except Exception as e:  # noqa: BLE001 - missing, cut short or failing its checksum
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} lacks readable host arrays for process "
                f"{jax.process_index()} ({path.name}: {reason(e)}); resume from another "
                "checkpoint or start over in another --workdir."
            ) from e

    def _delete_host_arrays(self, step: int) -> None:
        path = self._host_file(step)  # each process its own
        if path.exists():
            path.unlink()

    def save(self, step: int, state: Any, meta: dict, host_arrays: dict | None = None) -> None:
        """Saves `state` (its arrays' digests recorded in the meta document) and `meta`;
        `host_arrays` (numpy arrays, each process its own) beside them."""
        if step in self._manager.all_steps():
            return
        meta = {**meta, DIGESTS_KEY: state_digests(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        # orbax logs a failing save once per background thread, each with its traceback:
        # the one sentence below says it instead.
        absl_logger = logging.getLogger("absl")
        quiet = _NoSaveErrors()
        absl_logger.addFilter(quiet)
        try:
            # a second signal (which stops at once) waits for the checkpoint to be whole
            with interrupts.critical():
                if host_arrays is not None:  # before the step: a step that exists has them
                    self._write_host_arrays(step, host_arrays)
                self._manager.save(step, args=args)
                self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - any failure: the earlier checkpoints stand
            # its abandoned writes report again, as asyncio collects them, up to the exit
            logging.getLogger("asyncio").addFilter(_NoSaveErrors())
            raise SaveError(
                f"could not save checkpoint {step} in {self.directory} ({_save_failure(e)}); "
                "the checkpoints before it are kept, and its unfinished folder is removed at "
                "the next start."
            ) from None
        finally:
            absl_logger.removeFilter(quiet)
        steps = self.all_steps()
        for old in steps[: max(len(steps) - self.keep, 0)]:
            if old not in self.protected:
                self._manager.delete(old)
                self._delete_host_arrays(old)

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
                layout = scan_layers_hint(saved, target_state)
                raise CheckpointError(
                    f"checkpoint {step} in {self.directory} holds another training state than "
                    f"this code builds ({differs}); "
                    + (
                        layout
                        or "resume it with the code that saved it or choose another --workdir"
                    )
                    + " (no checkpoint was changed)."
                )
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target_state)
        state_args = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        )
        if restored.meta is None or restored.state is None:
            raise _Damaged(f"checkpoint {step} lacks its state or its meta document")
        meta = dict(restored.meta)
        recorded = meta.pop(DIGESTS_KEY, None)
        if recorded is not None:
            changed = first_digest_mismatch(recorded, restored.state)
            if changed is not None:
                raise _Damaged(
                    f"checkpoint {step}'s {changed} does not match the digest recorded when it "
                    "was saved"
                )
        return restored.state, meta

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
                f"checkpoint {step} in {self.directory} cannot be read ({reason(storage)}), "
                "a storage problem rather than a damaged file; fix the folder's access and "
                "rerun (no checkpoint was changed)."
            )
        if any(isinstance(e, _DAMAGE_TYPES) for e in causes):
            return None
        return CheckpointError(
            f"restoring checkpoint {step} from {self.directory} failed ({reason(error)}), "
            "which is not what a damaged file raises; fix the cause and rerun (no checkpoint "
            "was changed)."
        )

    def restore(self, target_state: Any | None = None, step: int | None = None):
        """(state, meta, step) of the newest readable checkpoint (or of `step`).

        The state takes the structure, dtypes and shardings of `target_state` (when None:
        as saved, on one device). A checkpoint whose files are damaged is reported in one line,
        set aside as `<step>.unreadable-<time>` unless the folder is read-only, and the next
        older one is tried; so is one whose arrays differ from the digests recorded when it
        was saved. A saved state whose leaves, shapes or dtypes differ from
        `target_state`'s, a storage error (permission denied, unreachable) or any other
        failure raises CheckpointError and renames nothing.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        for candidate in steps:
            try:
                with quiet_orbax_reads():
                    state, meta = self._restore(candidate, target_state)
                return state, meta, candidate
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted into damage and the rest below
                stop = self._unusable(candidate, e)
                if stop is not None:
                    raise stop from e
                damage = next((c for c in _causes(e) if isinstance(c, _DAMAGE_TYPES)), e)
                self.unreadable[candidate] = reason(damage)
                print(
                    f"warning: checkpoint {candidate} in {self.directory} cannot be read "
                    f"({reason(damage)}); trying an older one.",
                    file=sys.stderr,
                    flush=True,
                )
                if not self.read_only:
                    self._set_aside(candidate)
        if step is not None:  # one step was asked for: the others may still be intact
            others = ", ".join(str(s) for s in self.all_steps() if s != step)
            held = f"; it also holds {others}: ask for one of those" if others else ""
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} cannot be read "
                f"({self.unreadable[step]}){held}."
            )
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be read (tried {len(steps)}); "
            "move the folder away to start over."
        )

    def read_meta(self) -> dict:
        """The meta document of the newest checkpoint whose meta can be read ({} if none)."""
        for step in self.all_steps()[::-1]:
            try:
                with quiet_orbax_reads():
                    restored = self._manager.restore(
                        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                    )
            except Exception as e:  # noqa: BLE001 - damage: `restore` reports it, sets it aside
                stop = self._unusable(step, e)
                if stop is not None:
                    raise stop from e
                continue
            if restored.meta is not None:
                return {k: v for k, v in restored.meta.items() if k != DIGESTS_KEY}
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
