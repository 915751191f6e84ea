"""Checkpoints that resume a run exactly.

Orbax saves the array state (params, optimizer state) and a small JSON document with
everything else that decides the next iteration: the iteration count, the base RNG key,
the tree-window position, the statistics trackers and the prompt iterator's position.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message is one sentence for the user."""


def check_writable(directory: str) -> None:
    """Fails before training starts rather than after the first hour."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {directory}: {e.strerror or e}.") from e


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        check_writable(self.directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        if step in self._manager.all_steps():
            return
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args)
        self._manager.wait_until_finished()

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores into the structure, dtypes and shardings of `target_state`."""
        step = self.latest_step if step is None else step
        if step is None:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored.state, restored.meta

    def restore_params(self, step: int | None = None) -> Any:
        """The trained parameters alone, as saved (no target needed): for export."""
        step = self.latest_step if step is None else step
        if step is None:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore())
        )
        return restored.state["params"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
