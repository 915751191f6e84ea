"""Checkpoints that resume a run exactly, and refuse to resume another run.

Orbax saves the array state (params, optimizer state) and a small JSON document with
everything else that decides the next iteration: the iteration count, the base RNG key,
the tree-window position, the statistics trackers, the prompt iterator's position and the
run's fingerprint. A checkpoint that cannot be read is set aside (renamed, never deleted)
and the newest readable one is used instead.

The folder may be local or a URL that etils' `epath` reaches (gs:// on TPU pods). With
several processes all of them save and restore together; the primary one tidies the folder.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message is one sentence for the user."""


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only
        )
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

    def _restore(self, step: int, target_state: Any | None) -> tuple[Any, dict]:
        if target_state is None:  # as saved, on this process's first device (whatever the
            # mesh it was saved from: a pod's checkpoint exports on one machine)
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            abstract = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                self._manager.item_metadata(step)["state"],
            )
        else:
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target_state)
        state_args = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        )
        if restored.meta is None or restored.state is None:
            raise CheckpointError(f"checkpoint {step} lacks its state or its meta document.")
        return restored.state, restored.meta

    def restore(self, target_state: Any | None = None, step: int | None = None):
        """(state, meta, step) of the newest readable checkpoint (or of `step`).

        The state takes the structure, dtypes and shardings of `target_state` (when None:
        as saved, on one device). An unreadable checkpoint is reported in one line, set aside as
        `<step>.unreadable-<time>` unless the folder is read-only, and the next older one is
        tried.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        for candidate in steps:
            try:
                state, meta = self._restore(candidate, target_state)
                return state, meta, candidate
            except Exception as e:  # noqa: BLE001 - any unreadable file: try an older one
                reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
                print(
                    f"warning: checkpoint {candidate} in {self.directory} cannot be read "
                    f"({type(e).__name__}: {reason}); trying an older one.",
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
            except Exception:  # noqa: BLE001 - `restore` reports and sets it aside later
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
