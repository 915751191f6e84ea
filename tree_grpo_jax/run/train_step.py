"""The optimizer and the one jitted, sharded train step."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from tree_grpo_jax import sharding
from tree_grpo_jax.core.loss import LossInputs, LossSettings, ppo_loss

# The steps donate their state; on CPU, or where an output cannot take a donated buffer's
# place, XLA keeps the copy and JAX warns at every compile (harmless, thousands of characters).
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any


@struct.dataclass
class OldPolicyState(TrainState):
    """The state of a method that samples from an old copy of the policy and trains against
    it (DiffusionNFT): `old_params` is checkpointed with the rest, so a resume is exact."""

    old_params: Any = None


def initial_state(tx, params, old_policy: bool = False) -> TrainState:
    """A fresh state for `params`; with `old_policy` the old policy starts as their copy."""
    if old_policy:
        return OldPolicyState(params, tx.init(params), jax.tree_util.tree_map(jnp.copy, params))
    return TrainState(params, tx.init(params))


def old_params(state: TrainState):
    """The old policy's trained weights, or None for a state that keeps none."""
    return state.old_params if isinstance(state, OldPolicyState) else None


# ---------------------------------------------------------------------------------------------
# Optimizer and the train step.


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW without its learning rate: the step scales updates by the iteration's rate,
    so a schedule over iterations needs no guess of how many minibatches an iteration has.
    Equal settings give the same object (the steps built on it can then be reused)."""
    return _optimizer(
        float(train.max_grad_norm),
        float(train.adam_b1),
        float(train.adam_b2),
        float(train.adam_eps),
        float(train.weight_decay),
        int(train.grad_accumulation),
        str(train.optimizer_state_dtype),
    )


@functools.lru_cache(maxsize=16)
def _optimizer(max_grad_norm, b1, b2, eps, weight_decay, grad_accumulation, state_dtype):
    tx = optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        _adam(b1, b2, eps, state_dtype),
        optax.add_decayed_weights(weight_decay),
    )
    if grad_accumulation > 1:
        # the accumulated gradient is optimizer state too, kept in `state_dtype` (each
        # minibatch's mean is taken in float32 and rounded to it)
        tx = optax.MultiSteps(tx, every_k_schedule=grad_accumulation, accumulator_dtype=state_dtype)
    return tx


def _adam(b1, b2, eps, state_dtype: str) -> optax.GradientTransformation:
    """Adam's scaling, its two moments kept in `state_dtype` (train.optimizer_state_dtype):
    float32 is optax's own; bfloat16 halves their memory, each update computing optax's
    float32 arithmetic on them and rounding the new moments to bfloat16 to keep them."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    if state_dtype == "float32":
        return adam

    def kept(state, dtype):
        cast = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)  # noqa: E731
        return state._replace(mu=cast(state.mu), nu=cast(state.nu))

    def update(updates, state, params=None):
        updates, state = adam.update(updates, kept(state, jnp.float32), params)
        return updates, kept(state, state_dtype)

    return optax.GradientTransformation(lambda p: kept(adam.init(p), state_dtype), update)


def learning_rate(train: ml_collections.ConfigDict, iteration: int) -> float:
    warm = train.warmup_iterations
    if warm and iteration < warm:
        return train.learning_rate * (iteration + 1) / warm
    if train.lr_schedule == "cosine":
        span = max(train.iterations - warm, 1)
        progress = min(max(iteration - warm, 0) / span, 1.0)
        return train.learning_rate * 0.5 * (1.0 + np.cos(np.pi * progress))
    return train.learning_rate


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """What a train step is built around besides its optimizer and settings: the loss and,
    with `merge` (LoRA), the merge of the frozen base and the adapter and where the base
    (`frozen_shardings`) and the KL reference (`ref_shardings`, default: replicated) lie.
    Both forms of the step, `make_train_step` and `make_accumulating_step`, take one."""

    loss_fn: Any = ppo_loss
    merge: Any = None
    frozen_shardings: Any = None
    ref_shardings: Any = None


def _loss_and_grads(settings: LossSettings, layout: StepLayout):
    """(params, batch, cond, schedule, uncond, ref_params, frozen, old) -> ((loss, metrics),
    grads): the loss called as `loss_fn(weights, batch, settings, LossInputs(...))`; with
    `merge` (LoRA) the loss sees `merge(frozen, params)` (and the old policy
    `merge(frozen, old)`). `old` (None: none kept) reaches the loss as `old_params`."""
    loss_fn, merge = layout.loss_fn, layout.merge

    def weights_of(p, frozen):
        return p if merge is None else merge(frozen, p)

    def loss_and_grads(params, batch, cond, schedule, uncond, ref_params, frozen, old):
        inputs = LossInputs(
            schedule=schedule,
            cond=cond,
            uncond=uncond,
            ref_params=ref_params,
            old_params=None if old is None else weights_of(old, frozen),
        )

        def loss_of(p):
            return loss_fn(weights_of(p, frozen), batch, settings, inputs)

        return jax.value_and_grad(loss_of, has_aux=True)(params)

    return loss_and_grads


def _apply(tx, state: TrainState, grads, lr, loss=0.0, *, one_vector=False):
    """The optimizer's update from `grads` at rate `lr`. A non-finite loss or gradient leaves
    the state as it was; either, or a non-finite result, is reported: the trainer stops
    before its next checkpoint, so nothing non-finite can reach one. With `one_vector` (see
    `_one_vector_fits`) the update runs on the parameters laid end to end: the same
    arithmetic, a sixth of the program."""
    if one_vector and _one_vector_fits(state.params):
        return _apply_to_one_vector(tx, state, grads, lr, loss)
    grad_norm = optax.global_norm(grads)
    # Known before the update, so that each array is updated in place: a condition on the
    # new parameters would hold all of them and the new moments until it was known.
    finite_inputs = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    updates = jax.tree_util.tree_map(lambda u: -lr * u, updates)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite_inputs, new, old)  # noqa: E731
    params = jax.tree_util.tree_map(keep, params, state.params)
    opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
    state = state.replace(params=params, opt_state=opt_state)
    finite = finite_inputs & _all_finite(params)
    return state, {"grad_norm": grad_norm, "finite": finite}


# Up to this many trained numbers, a replicated update runs on one vector: the copies that
# laying the parameters, gradients and moments end to end takes (a few times 64 MiB at most)
# are cheap, and the program is one update instead of one per parameter, which XLA compiles
# in a third of the time (the tiny model's 208 arrays: 18.8k operations down to 2.9k).
ONE_VECTOR_MAX_ELEMENTS = 2**24


def _one_vector_fits(params) -> bool:
    leaves = jax.tree_util.tree_leaves(params)
    return (
        len(leaves) > 1
        and len({x.dtype for x in leaves}) == 1
        and sum(x.size for x in leaves) <= ONE_VECTOR_MAX_ELEMENTS
    )


def _apply_to_one_vector(tx, state: TrainState, grads, lr, loss):
    """`_apply` with the parameters, the gradients and every part of the optimizer's state
    shaped like the parameters (Adam's moments, MultiSteps' sums) each raveled to one vector,
    and unraveled after: elementwise the same numbers (the gradient's norm sums in another
    order)."""
    vector, unravel = ravel_pytree(state.params)
    treedef = jax.tree_util.tree_structure(state.params)
    shapes = [x.shape for x in jax.tree_util.tree_leaves(state.params)]

    def like_params(x) -> bool:  # (in any one dtype: Adam's moments may be kept in bfloat16)
        leaves = jax.tree_util.tree_leaves(x)
        return (
            jax.tree_util.tree_structure(x) == treedef
            and [y.shape for y in leaves] == shapes
            and len({y.dtype for y in leaves}) == 1
        )

    parts, parts_def = jax.tree_util.tree_flatten(state.opt_state, is_leaf=like_params)
    # each part raveled in its own dtype, and unraveled by its own function
    raveled = [ravel_pytree(p) if like_params(p) else None for p in parts]
    flat_parts = [p if r is None else r[0] for p, r in zip(parts, raveled, strict=True)]
    flat_state = state.replace(params=vector, opt_state=parts_def.unflatten(flat_parts))
    flat_grads = ravel_pytree(grads)[0]
    new, applied = _apply(tx, flat_state, flat_grads, lr, loss)
    new_parts = parts_def.flatten_up_to(new.opt_state)
    opt_state = [p if r is None else r[1](p) for p, r in zip(new_parts, raveled, strict=True)]
    return new.replace(
        params=unravel(new.params), opt_state=parts_def.unflatten(opt_state)
    ), applied


def _replicated(shardings) -> bool:
    return all(s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings))


def _in_shardings(mesh, state_shardings, layout: StepLayout) -> tuple:
    """(state, batch, cond, schedule, uncond, ref_params, lr[, frozen]) layouts."""
    rep = sharding.replicated(mesh)
    ref = rep if layout.ref_shardings is None else layout.ref_shardings
    shardings = (state_shardings, sharding.batch_sharding(mesh), rep, rep, rep, ref, rep)
    return shardings + ((layout.frozen_shardings,) if layout.merge is not None else ())


def make_train_step(
    tx, settings: LossSettings, mesh, state_shardings, layout: StepLayout = StepLayout()
):
    """One jitted update: loss and grads on a sharded minibatch, then the optimizer.

    settings: the settings record of `layout.loss_fn` (`ppo_loss`'s `PPOSettings`, or the
    method's own, e.g. `nft.nft_loss`'s `NFTSettings`), constants of the compiled step. A
    state that keeps an old policy (`OldPolicyState`) hands it to the loss as `old_params`.
    With `layout.merge` (LoRA), the state's params are the adapter, the step takes the
    frozen base weights as an eighth argument (laid out as `layout.frozen_shardings`) and
    the loss sees `merge(base, params)`.
    """
    loss_and_grads = _loss_and_grads(settings, layout)
    one_vector = _replicated(state_shardings)

    def step(state: TrainState, batch, cond, schedule, uncond, ref_params, lr, frozen=None):
        (loss, metrics), grads = loss_and_grads(
            state.params, batch, cond, schedule, uncond, ref_params, frozen, old_params(state)
        )
        state, applied = _apply(tx, state, grads, lr, loss, one_vector=one_vector)
        return state, {**metrics, "loss": loss, **applied}

    shardings = _in_shardings(mesh, state_shardings, layout)
    return jax.jit(
        step,
        in_shardings=shardings,
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )


@struct.dataclass
class Accumulated:
    """Gradients summed over minibatches, each weighted by its trained edges, and the count
    of those edges: their ratio is the gradient of the loss over all the minibatches' edges."""

    grads: Any
    edges: jax.Array


@dataclasses.dataclass(frozen=True)
class AccumulatingStep:
    """One optimizer update over any number of minibatches (an iteration's rows, whatever
    their count): `start(state)`, then `accumulate` per minibatch, then `apply`."""

    start: Any  # state -> Accumulated of zeros
    accumulate: Any  # (acc, state, batch, cond, schedule, uncond, ref, [frozen]) -> acc, metrics
    apply: Any  # (state, acc, lr) -> state, metrics


def make_accumulating_step(
    tx, settings: LossSettings, mesh, state_shardings, layout: StepLayout = StepLayout()
) -> AccumulatingStep:
    """The train step split in two so that one update may span any number of minibatches.

    The loss of a minibatch is a mean over its trained edges, so weighting each minibatch's
    gradient by its edge count and dividing by the total gives the gradient of the mean over
    every edge of the update (exactly for the PPO term; the KL term, a mean over rows,
    is weighted the same way).
    """
    loss_and_grads = _loss_and_grads(settings, layout)
    rep = sharding.replicated(mesh)
    grad_shardings = state_shardings.params
    acc_shardings = Accumulated(grad_shardings, rep)
    one_vector = _replicated(state_shardings)

    def start(state: TrainState) -> Accumulated:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        return Accumulated(zeros, jnp.zeros((), jnp.float32))

    def accumulate(acc, state, batch, cond, schedule, uncond, ref_params, frozen=None):
        (loss, metrics), grads = loss_and_grads(
            state.params, batch, cond, schedule, uncond, ref_params, frozen, old_params(state)
        )
        edges = jnp.sum(batch.mask).astype(jnp.float32)
        summed = jax.tree_util.tree_map(lambda a, g: a + edges * g, acc.grads, grads)
        finite = jnp.isfinite(loss)
        return Accumulated(summed, acc.edges + edges), {**metrics, "loss": loss, "finite": finite}

    def apply(state, acc: Accumulated, lr):
        grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(acc.edges, 1.0), acc.grads)
        return _apply(tx, state, grads, lr, one_vector=one_vector)

    shardings = _in_shardings(mesh, state_shardings, layout)
    state_sh, rest = shardings[0], shardings[1:6] + shardings[7:]
    return AccumulatingStep(
        start=jax.jit(start, in_shardings=(state_sh,), out_shardings=acc_shardings),
        accumulate=jax.jit(
            accumulate,
            in_shardings=(acc_shardings, state_sh, *rest),
            out_shardings=(acc_shardings, rep),
            donate_argnums=(0,),
        ),
        apply=jax.jit(
            apply,
            in_shardings=(state_sh, acc_shardings, rep),
            out_shardings=(state_sh, rep),
            # the state only: no output is shaped like the summed gradients, so donating
            # them bought nothing and JAX warned of every array
            donate_argnums=(0,),
        ),
    )
