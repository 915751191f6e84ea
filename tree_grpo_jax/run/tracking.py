"""DDPO's per-prompt stat tracker as a run uses it: built when the config asks for it and
the method can use it, and seen by each process through its own rows of the global batch
(every process updates it with the whole batch, so all keep the same statistics)."""

from __future__ import annotations

import dataclasses

import numpy as np

from tree_grpo_jax import methods
from tree_grpo_jax.core import advantages as adv


@dataclasses.dataclass(frozen=True)
class TrackerRows:
    """The stat tracker as one process's advantages see it: updated with the whole batch,
    so every process keeps the same statistics, and answering this process's rows."""

    tracker: adv.PerPromptStatTracker
    prompts: list[str]  # the global batch
    rewards: np.ndarray  # [P, L], the global batch
    rows: slice

    def update(self, prompt_ids, rewards) -> np.ndarray:
        """`prompt_ids` and `rewards` are this process's rows: they take their place in the
        global batch, with which the tracker is updated; their advantages come back."""
        prompts, all_rewards = list(self.prompts), np.array(self.rewards, np.float64)
        prompts[self.rows] = list(prompt_ids)
        all_rewards[self.rows] = np.asarray(rewards, np.float64)
        return self.tracker.update(prompts, all_rewards)[self.rows]


def make_tracker(config, method: methods.Method) -> adv.PerPromptStatTracker | None:
    """DDPO's per-prompt stat tracker when the config asks for it and the method uses it."""
    if not (config.advantage.stat_tracker and method.stat_tracker):
        return None
    return adv.PerPromptStatTracker(
        config.advantage.tracker_buffer, config.advantage.tracker_min_count
    )
