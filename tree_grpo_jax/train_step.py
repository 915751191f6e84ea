"""The optimizer and the one jitted, sharded train step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from tree_grpo_jax import sharding
from tree_grpo_jax.loss import ppo_loss


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any


# ---------------------------------------------------------------------------------------------
# Optimizer and the train step.


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW without its learning rate: the step scales updates by the iteration's rate,
    so a schedule over iterations needs no guess of how many minibatches an iteration has."""
    tx = optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm),
        optax.scale_by_adam(b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps),
        optax.add_decayed_weights(train.weight_decay),
    )
    if train.grad_accumulation > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=train.grad_accumulation)
    return tx


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


def make_train_step(
    tx,
    loss_kwargs: dict,
    mesh,
    state_shardings,
    *,
    merge=None,
    frozen_shardings=None,
    ref_shardings=None,
):
    """One jitted update: loss and grads on a sharded minibatch, then the optimizer.

    loss_kwargs: the static arguments of `ppo_loss` (denoise_fn, reduce) and its scalars.
    With `merge` (LoRA), the state's params are the adapter, the step takes the frozen base
    weights as an eighth argument (laid out as `frozen_shardings`) and the loss sees
    `merge(base, params)`. `ref_shardings` lays out the KL reference (default: replicated).
    """

    def step(state: TrainState, batch, cond, schedule, uncond, ref_params, lr, frozen=None):
        def loss_fn(params):
            weights = params if merge is None else merge(frozen, params)
            return ppo_loss(
                weights,
                batch,
                schedule=schedule,
                cond=cond,
                uncond=uncond,
                ref_params=ref_params,
                **loss_kwargs,
            )

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree_util.tree_map(lambda u: -lr * u, updates)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.global_norm(grads)
        # A non-finite loss, gradient or result leaves the state as it was and is reported:
        # the trainer stops, and nothing non-finite can reach a checkpoint.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(params)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree_util.tree_map(keep, params, state.params)
        opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
        metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "finite": finite}
        return TrainState(params, opt_state), metrics

    rep = sharding.replicated(mesh)
    batch_sh = sharding.batch_sharding(mesh)
    ref = rep if ref_shardings is None else ref_shardings
    in_shardings = (state_shardings, batch_sh, rep, rep, rep, ref, rep)
    if merge is not None:
        in_shardings += (frozen_shardings,)
    return jax.jit(
        step,
        in_shardings=in_shardings,
        out_shardings=(state_shardings, rep),
        donate_argnums=(0,),
    )
