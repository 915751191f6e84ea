"""What the forward-process objectives (`nft.NFT`, `awm.AWM`, `dgpo.DGPO`, `dpo.DPO`,
`crd.CRD`) share: they noise the rollout's final samples again and train the velocity there.
Their credit, row means, time draws, old-policy mixing and counts, and their base class
`ForwardObjective` (drawn rows, a flow model, zero rows from the rows' record)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.core import sampling
from tree_grpo_jax.core.guidance import PyTree
from tree_grpo_jax.methods.objective import Objective

# advantages = (reward - prompt mean) / (std + STD_EPS), the released stat trackers'.
STD_EPS = 1e-4
# The adaptive weights' floor: the released code's, so a perfect prediction divides by it.
WEIGHT_FLOOR = 1e-5

# ---------------------------------------------------------------------------------------------
# Credit: rewards -> advantages -> optimality probabilities.


def centred_per_prompt(rewards: np.ndarray) -> np.ndarray:
    """[P, L] rewards less each prompt's mean, in float64."""
    rewards = np.asarray(rewards, np.float64)
    chex.assert_rank(rewards, 2)
    # less each prompt's first reward before the mean: a constant prompt gives exact zeros
    shifted = rewards - rewards[:, :1]
    return shifted - shifted.mean(axis=1, keepdims=True)


def advantages(rewards: np.ndarray) -> np.ndarray:
    """[P, L] rewards -> advantages: each prompt's rewards less their mean, over the std of
    the whole batch (the released code's per-prompt tracker with `global_std`)."""
    rewards = np.asarray(rewards, np.float64)
    return centred_per_prompt(rewards) / (rewards.std() + STD_EPS)


def optimality(advantages: np.ndarray, clip: float) -> np.ndarray:
    """Advantages clipped to +-clip, mapped linearly onto [0, 1] (0: the worst, 1/2: the
    prompt's mean, 1: the best)."""
    a = np.clip(np.asarray(advantages, np.float64), -clip, clip)
    return np.clip(a / clip / 2.0 + 0.5, 0.0, 1.0)


def row_mean(values: jax.Array) -> jax.Array:
    """The mean of each row [R, ...] over its sample axes."""
    return jnp.mean(values, axis=tuple(range(1, values.ndim)))


# ---------------------------------------------------------------------------------------------
# Times: AWM's and CRD's draws of the sigmas the samples are noised to.

TIME_SAMPLINGS = ("discrete", "discrete_wo_init", "discrete_with_init", "uniform", "logit_normal")
MIN_TIME = 0.01  # the released floor: the smallest continuous t
UNIFORM_LOWER = 0.2  # the released "uniform" sampler's lower bound before the shift


def _shift(t, shift: float):
    return shift * t / (1.0 + (shift - 1.0) * t)


def _strata(rng: np.random.Generator, samples: int, count: int) -> np.ndarray:
    """[samples, count] one uniform draw per stratum [j / count, (j + 1) / count), each
    sample's strata in its own random order (the released stratified draws)."""
    u = (np.arange(count) + rng.uniform(size=(samples, count))) / count
    return rng.permuted(u, axis=1)


def sample_times(
    kind: str,
    rng: np.random.Generator,
    samples: int,
    count: int,
    sigmas: np.ndarray,
    fraction: float,
    shift: float,
) -> np.ndarray:
    """[samples, count] times t in (0, 1] for each sample, as the released `time_type` does:
    "discrete*" take the sampler's own sigmas at step indices drawn one per stratum of
    [0 (1 without / forced init), int(N * fraction)] ("discrete_with_init": step 0 and
    count - 1 strata from 1); "uniform" stratifies [0.2, 1] and shifts; "logit_normal"
    stratifies a standard normal's quantiles, sigmoid, shift, at least 0.01."""
    num_steps = len(sigmas) - 1
    top = int(num_steps * fraction)
    if kind.startswith("discrete"):
        first = 0 if kind == "discrete" else 1
        strata = count - 1 if kind == "discrete_with_init" else count
        bounds = np.linspace(first, top, strata + 1)
        lower, upper = np.floor(bounds[:-1]), np.floor(bounds[1:])
        u = rng.uniform(size=(samples, strata))
        steps = (lower + np.floor(u * (upper - lower))).astype(int)
        if kind == "discrete_with_init":
            steps = np.concatenate([np.zeros((samples, 1), int), steps], axis=1)
        return np.asarray(sigmas, np.float64)[np.minimum(steps, num_steps - 1)]
    u = _strata(rng, samples, count)
    if kind == "uniform":
        return _shift(UNIFORM_LOWER + u * (1.0 - UNIFORM_LOWER), shift)
    from scipy.special import ndtri  # the normal's quantile function

    t = _shift(1.0 / (1.0 + np.exp(-ndtri(np.clip(u, 1e-7, 1 - 1e-7)))), shift)
    return np.maximum(t, MIN_TIME)


def time_and_noise_draws(key: jax.Array) -> tuple[np.random.Generator, jax.Array]:
    """This process's draws from an iteration's rows key: a host generator for the times and
    a key for the noises (each process its own, from `jax.process_index`)."""
    key = jax.random.fold_in(key, jax.process_index())
    time_key, noise_key = jax.random.split(key)
    return np.random.default_rng(np.asarray(jax.random.key_data(time_key)).tolist()), noise_key


# ---------------------------------------------------------------------------------------------
# The old copy of the policy.


def old_policy_decay(iterations_done: int, flat: int, rate: float, ceiling: float) -> float:
    """d after `iterations_done` iterations: 0 for the first `flat`, then rising by `rate`
    per iteration up to `ceiling` (the released `return_decay`, counted in iterations)."""
    if iterations_done < flat:
        return 0.0
    return float(min((iterations_done - flat) * rate, ceiling))


@functools.partial(jax.jit, donate_argnums=(0,))
def mix_old_policy(old: PyTree, new: PyTree, decay: jax.Array) -> PyTree:
    """old <- decay * old + (1 - decay) * new, leaf by leaf, in the old leaves' dtype."""
    return jax.tree_util.tree_map(
        lambda o, n: (decay * o.astype(jnp.float32) + (1.0 - decay) * n.astype(jnp.float32)).astype(
            o.dtype
        ),
        old,
        new,
    )


# ---------------------------------------------------------------------------------------------
# Counts.


def row_counts(spec, guidance: bool, *, edges: int, rows: int, forwards: int, grads: int) -> dict:
    """`Objective.training_counts` of a forward-process objective: `edges` trained samples,
    `rows` training rows, `forwards` denoiser rows of which `grads` are differentiated; no
    edge of the tree (the spec's own counts are 0). `guidance`: the rollout's."""
    return {
        "guidance": guidance,
        "rollout_rows": spec.rollout_denoiser_calls(guidance),
        "trained_edges": edges,
        "train_rows": rows,
        "train_forward_rows": forwards,
        "train_grad_rows": grads,
        "spec_trainable_edges": 0,
        "spec_train_rows": 0,
    }


def leaf_row_counts(spec, rows: int, forwards: int) -> dict:
    """The counts of `rows` rows of the final samples per prompt, each through `forwards`
    denoiser calls of which one, the trained weights', is differentiated; no guidance."""
    return row_counts(spec, False, edges=rows, rows=rows, forwards=rows * forwards, grads=rows)


# ---------------------------------------------------------------------------------------------
# The base class.

# Every forward-process row field's dtype (None: the samples' own); x0 and noise end with the
# sample's axes, and a field in `ForwardObjective.grouped_fields` has the group's axis after
# the row's.
FIELD_DTYPES = {
    "x0": None,
    "noise": None,
    "step": np.int32,
    "time": np.float32,
    "prompt": np.int32,
    "optimality": np.float32,
    "advantage": np.float32,
    "mask": np.bool_,
}
SAMPLE_FIELDS = ("x0", "noise")


class ForwardObjective(Objective):
    """A forward-process objective: its rows are drawn (times and noises), its model is a
    rectified flow, and it keeps an old copy of the policy that `decay` moves."""

    keeps_old_policy = True
    draws_rows = True
    rows_type: ClassVar[type]  # its rows' record (a `core.transitions.MaskedRows`)
    grouped_fields: ClassVar[tuple[str, ...]] = ()  # the fields with a group axis
    decay_metric: ClassVar[str] = "old_policy_decay"  # the metric that reports `decay`

    def row_group(self, config) -> int:
        """The size of the grouped fields' group axis: a prompt's G samples."""
        return int(config.tree.group_size)

    def check_model(self, config, model):
        schedule = model.make_schedule(config.sampling.num_steps, config.sampling)
        if isinstance(schedule, sampling.FlowSchedule):
            return None
        return (
            f"tree.method={config.tree.method} trains a velocity on forward-noised samples: it "
            f"needs a rectified-flow model (tiny_flow, sd3, flux), not model.name="
            f"{config.model.name}."
        )

    def zero_rows(self, config, rows, sample_shape, max_k, dtype, make=np.zeros):
        group = (self.row_group(config),) if self.grouped_fields else ()

        def zeros(name: str):
            shape = (rows, *(group if name in self.grouped_fields else ()))
            if name in SAMPLE_FIELDS:
                return make((*shape, *sample_shape), dtype)
            return make(shape, FIELD_DTYPES[name])

        return self.rows_type(**{f.name: zeros(f.name) for f in dataclasses.fields(self.rows_type)})

    def decay(self, config, iterations_done: int) -> float:
        """The old copy's d once `iterations_done` iterations are done."""
        raise NotImplementedError(f"{self.name} keeps no old policy to move.")

    def after_update(self, config, old, params, iteration) -> tuple[Any, dict]:
        """old <- d * old + (1 - d) * new, d after iteration `iteration` is done."""
        decay = self.decay(config, iteration + 1)
        return mix_old_policy(old, params, jnp.float32(decay)), {self.decay_metric: decay}
