"""Prompt sets and a deterministic, resumable, shardable prompt stream.

`load_prompts("animals")` gives a built-in set; `load_prompts("my_prompts.txt")` reads one
prompt per line. `PromptIterator` walks the prompts in a fresh seeded shuffle every epoch.
Its only state is `position`, the number of prompts drawn by all hosts together, so saving
`state_dict()` and restoring it continues the exact same stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tree_grpo_jax.errors import echo
from tree_grpo_jax.models import registry as model_registry

# Common animals, as bare names (DDPO's animal prompts are the names alone).
ANIMALS = (
    "cat", "dog", "horse", "cow", "pig", "sheep", "goat", "chicken", "duck", "goose",
    "rabbit", "mouse", "squirrel", "hedgehog", "fox", "wolf", "bear", "deer", "raccoon", "lion",
    "tiger", "leopard", "elephant", "giraffe", "zebra", "monkey", "gorilla", "kangaroo", "koala",
    "camel", "llama", "owl", "eagle", "parrot", "penguin", "flamingo", "frog", "turtle", "snake",
    "lizard", "crocodile", "fish", "shark", "dolphin", "whale", "octopus", "butterfly", "bee",
)  # fmt: skip
SIMPLE_ANIMALS = ("cat", "dog", "horse", "rabbit", "bird", "fish", "cow", "sheep")

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "animals": ANIMALS,
    "simple_animals": SIMPLE_ANIMALS,
}


def prompt_sets() -> dict[str, tuple[str, ...]]:
    """Every built-in set: the ones above and those model families bring (the tiny
    model's "digits")."""
    sets = dict(PROMPT_SETS)
    for family in model_registry.families():
        sets.update(family.prompt_sets)
    return sets


def load_prompts(source: str) -> list[str]:
    """A built-in set by name, or a text file with one prompt per line (blank lines skipped)."""
    sets = prompt_sets()
    if source in sets:
        return list(sets[source])
    path = Path(source).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(sets))
        raise ValueError(
            f"prompt source {echo(source)} is neither a built-in set ({names}) nor an existing "
            "text file with one prompt per line."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad = e.object[e.start : e.start + 1].hex()
        raise ValueError(
            f"prompt file {path} is not UTF-8 text (byte 0x{bad} at offset {e.start} cannot "
            "be decoded); save it as UTF-8 with one prompt per line."
        ) from None
    except OSError as e:
        raise ValueError(f"prompt file {path} cannot be read: {e.strerror or e}.") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts; write one prompt per line.")
    return prompts


class PromptIterator:
    """Batches of prompts, reshuffled every epoch with `seed`, exactly resumable.

    The stream is global: every `next_batch` advances `position` by
    `batch_size * num_shards`, and shard `shard_index` takes its own contiguous
    `batch_size` slice of that global batch. Hosts with the same seed and position therefore
    draw disjoint prompts within a global batch (and within an epoch when the number of
    prompts is a multiple of the global batch).
    """

    def __init__(
        self,
        prompts: Sequence[str],
        batch_size: int,
        seed: int,
        position: int = 0,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
    ):
        if not prompts:
            raise ValueError("PromptIterator needs at least one prompt.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(
                f"shard_index must be in [0, num_shards), got {shard_index} of {num_shards}."
            )
        if position < 0:
            raise ValueError(f"position must be non-negative, got {position}.")
        self.prompts = list(prompts)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.position = int(position)
        self.shard_index = int(shard_index)
        self.num_shards = int(num_shards)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_shards

    @property
    def epoch(self) -> int:
        return self.position // len(self.prompts)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a batch spans at most a few epochs
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(len(self.prompts))
        return self._perms[epoch]

    def _prompt_at(self, index: int) -> str:
        epoch, offset = divmod(index, len(self.prompts))
        return self.prompts[self._permutation(epoch)[offset]]

    def next_batch(self) -> list[str]:
        start = self.position + self.shard_index * self.batch_size
        batch = [self._prompt_at(start + i) for i in range(self.batch_size)]
        self.position += self.global_batch_size
        return batch

    def next_global_batch(self) -> list[str]:
        """Every shard's batch of this draw, in shard order: shard i's `next_batch` is rows
        i * batch_size .. (i + 1) * batch_size - 1 of it. Advances like `next_batch`."""
        batch = [self._prompt_at(self.position + i) for i in range(self.global_batch_size)]
        self.position += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Small, all ints: what a checkpoint stores."""
        return {"position": self.position, "seed": self.seed, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """Continues a saved stream; the seed and the prompt count must be the same."""
        for key, mine in (("seed", self.seed), ("num_prompts", len(self.prompts))):
            if int(state[key]) != mine:
                raise ValueError(
                    f"the saved prompt stream has {key}={int(state[key])} but this one has "
                    f"{key}={mine}; resume with the same prompts and seed."
                )
        self.position = int(state["position"])
