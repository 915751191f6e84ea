"""Replay: the PPO rows of the last N iterations trained again beside each iteration's own.

Each iteration's rows (`transitions.Transitions`: parent states, actions, the log-probs they
were sampled with, their advantages) are kept on the host with the conditioning of the prompt
batch they index, for the next N iterations. An update trains the fresh rows and the held
ones together; each held row keeps the advantage its own iteration gave it and the
log-prob of its action under the parameters that sampled it, so the loss's ratio
exp(logp_now - logp_at_sampling) is the importance ratio of the current policy to the one
that drew the action, clipped as PPO clips any ratio.

Fixed shapes: the conditioning the step looks rows up in is always N + 1 prompt batches
(`train_cond`: this iteration's, then the held iterations' oldest first, then zeros for the
slots not yet filled), so the compiled step sees one shape however full the buffer is; the
number of rows, and with it the number of minibatches, is what grows.

The buffer is host state saved with the run's checkpoints (`arrays` / `from_arrays`: plain
numpy arrays, each process its own rows), so a resumed run replays exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from tree_grpo_jax.core.transitions import Transitions


@dataclasses.dataclass(frozen=True)
class Slot:
    """One past iteration's rows, their `prompt` indexing `cond` [P, L, D] (the global
    prompt batch of that iteration)."""

    iteration: int
    rows: Transitions
    cond: np.ndarray


class ReplayBuffer:
    """The rows of the last `capacity` iterations, oldest first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a replay buffer holds at least 1 iteration, got {capacity}.")
        self.capacity = capacity
        self.slots: tuple[Slot, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(s.rows.num_rows for s in self.slots)

    def push(self, iteration: int, rows: Transitions, cond) -> None:
        """Keeps `rows` (their `prompt` indexing `cond`) and drops the oldest iteration once
        more than `capacity` are held. The arrays are copied to the host."""
        host = jax.tree_util.tree_map(np.asarray, rows)
        slot = Slot(int(iteration), host, np.asarray(cond))
        self.slots = (*self.slots, slot)[-self.capacity :]

    def cond_shape(self, shape) -> tuple[int, ...]:
        """`train_cond`'s shape for a prompt batch's conditioning of `shape`."""
        return ((self.capacity + 1) * shape[0], *shape[1:])

    def train_cond(self, cond) -> np.ndarray:
        """[(capacity + 1) * P, L, D]: `cond` (this iteration's batch), then each held
        iteration's oldest first, then zeros for the empty slots."""
        cond = np.asarray(cond)
        parts = [cond] + [s.cond for s in self.slots]
        for slot in self.slots:
            if slot.cond.shape != cond.shape:
                raise ValueError(
                    f"iteration {slot.iteration}'s conditioning is {slot.cond.shape}, this "
                    f"one's {cond.shape}: replayed prompt batches must keep one shape."
                )
        empty = self.capacity - len(self.slots)
        parts += [np.zeros_like(cond)] * empty
        return np.concatenate(parts)

    def replayed(self, batch_size: int) -> list[Transitions]:
        """The held rows, each slot's `prompt` moved to its place in `train_cond` (slot j
        after this iteration's `batch_size` prompts and j earlier slots)."""
        return [
            s.rows.replace(prompt=s.rows.prompt + np.int32((j + 1) * batch_size))
            for j, s in enumerate(self.slots)
        ]

    def mixed(self, rows: Transitions, cond) -> tuple[Transitions, np.ndarray]:
        """This iteration's `rows` followed by every held row, and the conditioning they
        index (`train_cond`)."""
        cond = np.asarray(cond)
        held = self.replayed(cond.shape[0])
        if not held:
            return rows, self.train_cond(cond)
        host = jax.tree_util.tree_map(np.asarray, rows)
        merged = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), host, *held)
        return merged, self.train_cond(cond)

    # -- saving --------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """The buffer as flat numpy arrays (raw bytes, with a JSON layout naming each one's
        dtype and shape, so bfloat16 and friends come back bit for bit)."""
        out, layout = {}, {"capacity": self.capacity, "slots": []}
        for j, slot in enumerate(self.slots):
            fields = {"cond": slot.cond}
            for field in dataclasses.fields(slot.rows):
                value = getattr(slot.rows, field.name)
                if value is not None:
                    fields[field.name] = value
            entry = {"iteration": slot.iteration, "fields": {}}
            for name, value in fields.items():
                value = np.ascontiguousarray(value)
                out[f"slot{j}.{name}"] = value.view(np.uint8).reshape(-1)
                entry["fields"][name] = [str(value.dtype), list(value.shape)]
            layout["slots"].append(entry)
        out["layout"] = np.frombuffer(json.dumps(layout).encode(), np.uint8)
        return out

    @classmethod
    def from_arrays(cls, arrays) -> ReplayBuffer:
        """The buffer `arrays` holds (what `arrays()` gave)."""
        layout = json.loads(bytes(np.asarray(arrays["layout"], np.uint8)).decode())
        buffer = cls(int(layout["capacity"]))
        slots = []
        for j, entry in enumerate(layout["slots"]):
            values = {}
            for name, (dtype, shape) in entry["fields"].items():
                raw = np.asarray(arrays[f"slot{j}.{name}"], np.uint8)
                values[name] = raw.view(np.dtype(_dtype(dtype))).reshape(shape)
            cond = values.pop("cond")
            slots.append(Slot(int(entry["iteration"]), Transitions(**values), cond))
        buffer.slots = tuple(slots)
        return buffer

    def snapshot(self) -> ReplayBuffer:
        """A copy holding the same slots (their arrays are never changed in place)."""
        copy = ReplayBuffer(self.capacity)
        copy.slots = self.slots
        return copy

    def load(self, arrays) -> None:
        """Takes the held rows of a saved buffer of the same capacity."""
        saved = ReplayBuffer.from_arrays(arrays)
        if saved.capacity != self.capacity:
            raise ValueError(
                f"the saved replay buffer holds {saved.capacity} iterations, this run "
                f"{self.capacity}."
            )
        self.slots = saved.slots


def buffer(iterations: int) -> ReplayBuffer | None:
    """The buffer `train.replay=iterations` asks for; None at 0 (off)."""
    return ReplayBuffer(int(iterations)) if iterations else None


def _dtype(name: str):
    """numpy's dtype, or ml_dtypes' (bfloat16, float8 ...) which numpy does not name."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
