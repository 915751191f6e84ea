"""The evaluation's measures of one batch of fixed prompts and noises, for both of its
callers: the run's evaluation (`Evaluator.evaluate_samples`, every `eval.every` iterations)
and `python -m tree_grpo_jax.evaluate` (chunk by chunk). Both sample with the deterministic
sampler (`Evaluator.batch`) and measure with the same helpers, one a figure: each eval
reward's value per sample, a video's temporal distance (`evaluation.temporal`), the
diversity of each group of samples that share a prompt (`evaluation.diversity`) and the
exact KL of each trajectory to the reference. The callers reduce them as they report: the
run to means, the command to means and spreads over all of its chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import numpy as np

from tree_grpo_jax import sharding
from tree_grpo_jax.errors import UserError
from tree_grpo_jax.evaluation import diversity, temporal
from tree_grpo_jax.run import scoring


@dataclasses.dataclass(frozen=True)
class EvalSamples:
    """Decoded evaluation samples: this process's rows of a batch padded over the devices."""

    decoded: scoring.Decoded  # this process's rows, decoded in parts
    prompts: list[str]  # their prompts
    count: int  # rows of the real batch; the rest is padding
    kl: np.ndarray | None = None  # [count] per-sample KL to the reference, every process's
    metadata: list | None = None  # this process's rows' prompt metadata (None: none known)

    @property
    def images(self):
        """This process's rows, whole."""
        return self.decoded.whole

    def values(self, fn) -> np.ndarray:
        """`fn(images, prompts)` of every process's real rows, in order (`[count, ...]`); a
        reward that takes metadata gets the rows' metadata too, and one that runs on the
        host scores part by part as the parts are decoded."""
        reads = getattr(fn, "takes_metadata", False) or getattr(fn, "takes_input_images", False)
        with_metadata = self.metadata is not None and reads

        def call(images, prompts, metadata):
            out = fn(images, prompts, metadata=metadata) if with_metadata else fn(images, prompts)
            return out, {}, None

        on_host = getattr(fn, "on_host", False)
        out, _, _ = scoring.scored(call, self.decoded, self.prompts, self.metadata, on_host)
        return sharding.gather(np.asarray(out, np.float64))[: self.count]

    def all_images(self) -> np.ndarray:
        return sharding.gather(np.asarray(self.images))[: self.count]


@dataclasses.dataclass(frozen=True)
class Measures:
    """The figures of a batch of N samples, every process's rows in order."""

    samples: EvalSamples  # the decoded batch (this process's rows)
    metrics: dict[str, np.ndarray]  # each eval reward's value per sample, [N]
    temporal_distance: np.ndarray | None  # [N], videos only
    embeddings: np.ndarray | None  # [N, D], the diversity's embedding; None without groups
    diversity: np.ndarray | None  # [G], one per group; None without groups
    kl: np.ndarray | None  # [N], with the KL only


def measure(
    evaluator,
    params,
    prompts: Sequence[str],
    noise,
    groups: Sequence,
    with_kl: bool,
    metadata: Sequence | None = None,
) -> Measures:
    """Samples `prompts` from `noise` [N, *S] with `params` and measures them. `groups`: the
    row indices of each prompt's samples (two or more each) whose diversity is measured;
    empty, or an evaluator without a diversity embedding, for none. `with_kl`: also the KL
    to the evaluator's `kl_reference`. `metadata`: each prompt's, for the rewards that take it."""
    batch = evaluator.batch(params, prompts, noise, with_kl, metadata)
    metrics = {name: batch.values(reward) for name, reward in evaluator.rewards.items()}
    distances = embeddings = spread = None
    if evaluator.frame_embed is not None:  # videos: each frame embedded once, for both figures
        frames = batch.values(lambda videos, _: evaluator.frame_embed(videos))
        distances = temporal.distances(frames)
        embeddings = diversity.flat_frames(frames)  # what `evaluator.embed` gives a video
    if len(groups) and evaluator.embed is not None:
        if embeddings is None:
            embeddings = batch.values(lambda images, _: evaluator.embed(images))
        spread = diversity.per_group(embeddings, groups)
    else:
        embeddings = None
    return Measures(batch, metrics, distances, embeddings, spread, batch.kl)


@functools.lru_cache(maxsize=8)
def check_eval_noise_fits(count: int, sample_shape: tuple[int, ...]) -> None:
    """Raises UserError (one sentence naming the settings) when the fixed evaluation noise
    of `count` samples would take more than half of this machine's memory (it is drawn on
    the host, twice over while copied), before any of it is allocated."""
    needed = 2 * 4 * count * int(np.prod(sample_shape))
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: nothing to check against
        return
    if needed > host // 2:
        raise UserError(
            f"the fixed evaluation noise of {count:,} samples of shape {tuple(sample_shape)} "
            f"needs about {needed / 2**30:.1f} GiB of host memory, more than half of this "
            f"machine's {host / 2**30:.1f} GiB; lower prompts.eval_count (or "
            "eval.samples_per_prompt)."
        )


def eval_noise(seed: int, count: int, sample_shape: tuple[int, ...]) -> np.ndarray:
    """The fixed evaluation noise [count, *S]. Its rows depend on `count`: a caller that
    evaluates in parts draws the whole set and takes its rows."""
    check_eval_noise_fits(count, sample_shape)
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (count, *sample_shape)))
