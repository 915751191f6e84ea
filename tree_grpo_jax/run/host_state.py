"""What besides the arrays decides a run's next iteration: where the prompt iterator stands,
the per-prompt stat tracker and the replay buffer's rows. A trainer owns one (`reseed` starts
a fresh one); the loop takes a snapshot between iterations, a checkpoint saves it and a
resume puts it back."""

from __future__ import annotations

import dataclasses

import jax

from tree_grpo_jax.core import advantages as adv
from tree_grpo_jax.core import replay as replay_buffer
from tree_grpo_jax.run.checkpoint import CheckpointError
from tree_grpo_jax.run.prompts import PromptIterator, prompt_iterator
from tree_grpo_jax.run.tracking import make_tracker

REPLAY = "replay"  # the snapshot's key of the replay buffer (saved as arrays, not in the meta)


@dataclasses.dataclass(frozen=True, eq=False)
class HostState:
    """The trainer's mutable parts, changed in place by every iteration."""

    prompts: PromptIterator | None  # None: a trainer of shapes (the plan) draws no prompts
    tracker: adv.PerPromptStatTracker | None
    # `train.replay`: the last iterations' rows, trained again (core/replay.py); None: off
    replay: replay_buffer.ReplayBuffer | None = None

    @classmethod
    def fresh(cls, config, method) -> HostState:
        """A run's start under `config`: its prompts in their first order, an empty tracker
        and replay buffer."""
        return cls(
            prompt_iterator(config),
            make_tracker(config, method),
            replay_buffer.buffer(config.train.replay),
        )

    def snapshot(self) -> dict:
        """The state, taken between iterations (the replay buffer's rows are saved as arrays
        beside the checkpoint, not in its meta)."""
        return {
            "prompt_iterator": self.prompts.state_dict(),
            "stat_tracker": self.tracker.state_dict() if self.tracker else None,
            REPLAY: self.replay.snapshot() if self.replay else None,
        }

    def restore(self, meta: dict, step: int, ckpt) -> None:
        """The state checkpoint `step` of `ckpt` saved (`meta`: its meta), put back."""
        self.prompts.load_state_dict(meta["prompt_iterator"])
        if self.replay is not None:
            saved = meta.get("replay_processes", jax.process_count())
            if saved != jax.process_count():
                raise CheckpointError(
                    f"checkpoint {step} in {ckpt.directory} holds the replay buffers of {saved} "
                    f"processes, each its own rows; resume it with {saved} processes, not "
                    f"{jax.process_count()}."
                )
            self.replay.load(ckpt.read_host_arrays(step))
        if self.tracker is not None and meta.get("stat_tracker"):
            self.tracker.load_state_dict(meta["stat_tracker"])


def in_meta(snapshot: dict) -> dict:
    """A snapshot's part of a checkpoint's meta: all but the replay rows, and the count of
    processes that saved them (each its own: a resume needs as many processes)."""
    return {
        **{k: v for k, v in snapshot.items() if k != REPLAY},
        **({"replay_processes": jax.process_count()} if snapshot.get(REPLAY) else {}),
    }
