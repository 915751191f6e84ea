"""Runs one train step on a 1-device mesh and on a data=2 x fsdp=4 mesh of 8 simulated CPU
devices (there with the denoiser's rows, and its activations between layers, constrained over
the mesh as the run lays them out); prints a JSON line with the losses, the largest parameter
difference and how the parameters are laid out. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=8."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax import sharding
from tree_grpo_jax.core import sampling
from tree_grpo_jax.core.loss import PPOSettings
from tree_grpo_jax.core.transitions import Transitions
from tree_grpo_jax.models.base import constrain_rows
from tree_grpo_jax.run import denoiser
from tree_grpo_jax.run.train_step import TrainState, make_optimizer, make_train_step

SAMPLE_SHAPE = (1, 4, 4)


class MLPDenoiser(nn.Module):
    @nn.compact
    def __call__(self, x, t, cond):
        h = jnp.concatenate([x.reshape(x.shape[0], -1), cond.mean(axis=1), t[:, None] / 1000.0], -1)
        h = constrain_rows(nn.gelu(nn.Dense(64)(h)))  # the run's row layout, where it sets one
        h = constrain_rows(nn.gelu(nn.Dense(64)(h)))
        return nn.Dense(16)(h).reshape(x.shape)


MODULE = MLPDenoiser()


def denoise(params, x, t, cond):
    return MODULE.apply({"params": params}, x, t, cond)


def batch_and_params(rows=16, k=2, num_prompts=4):
    rng = np.random.default_rng(0)
    cond = rng.normal(size=(num_prompts, 3, 8)).astype(np.float32)
    params = MODULE.init(
        jax.random.PRNGKey(0), jnp.zeros((1, *SAMPLE_SHAPE)), jnp.zeros((1,)), cond[:1]
    )["params"]
    schedule = sampling.make_ddim_schedule(10, eta=1.0)
    x = rng.normal(size=(rows, *SAMPLE_SHAPE)).astype(np.float32)
    step = rng.integers(0, 10, size=rows).astype(np.int32)
    prompt = rng.integers(0, num_prompts, size=rows).astype(np.int32)
    t = np.asarray(schedule.timesteps)[step]
    pred = denoise(params, x, t, cond[prompt])
    mean, std = schedule.transition(step.reshape(-1, 1, 1, 1), x, pred)
    actions = np.asarray(mean)[:, None] + np.asarray(std)[:, None] * rng.normal(
        size=(rows, k, *SAMPLE_SHAPE)
    )
    old = sampling.gaussian_log_prob(
        actions, np.asarray(mean)[:, None], np.asarray(std)[:, None], 3
    )
    batch = Transitions(
        x=x,
        step=step,
        prompt=prompt,
        noise_scale=np.ones(rows, np.float32),
        actions=actions.astype(np.float32),
        old_log_probs=np.asarray(old, np.float32)
        - 0.01 * rng.normal(size=(rows, k)).astype(np.float32),
        advantages=rng.normal(size=(rows, k)).astype(np.float32),
        mask=np.ones((rows, k), bool),
    )
    return params, batch, jnp.asarray(cond), schedule


def one_step(mesh, params, batch, cond, schedule):
    train_cfg = ml_collections.ConfigDict(
        dict(
            max_grad_norm=1.0,
            adam_b1=0.9,
            adam_b2=0.999,
            adam_eps=1e-8,
            weight_decay=1e-4,
            grad_accumulation=1,
            optimizer_state_dtype="float32",
        )
    )
    tx = make_optimizer(train_cfg)
    init = lambda p: TrainState(p, tx.init(p))
    shardings = sharding.param_shardings(mesh, jax.eval_shape(init, params))
    state = jax.jit(init, out_shardings=shardings)(params)
    settings = PPOSettings(
        denoise_fn=denoiser.laid_out(denoise, mesh),  # rows over the mesh where fsdp > 1
        reduce="mean",
        guidance_scale=1.0,
        clip_range=0.2,
        kl_beta=0.0,
    )
    step = make_train_step(tx, settings, mesh, shardings)
    state, metrics = step(
        state, sharding.shard_batch(mesh, batch), cond, schedule, None, None, jnp.float32(1e-2)
    )
    return state, metrics


def main():
    assert jax.device_count() == 8, jax.device_count()
    params, batch, cond, schedule = batch_and_params()
    single, m1 = one_step(
        sharding.make_mesh(1, 1, jax.devices()[:1]), params, batch, cond, schedule
    )
    sharded, m8 = one_step(sharding.make_mesh(2, 4), params, batch, cond, schedule)
    diffs = jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
        single.params,
        sharded.params,
    )
    kernel = sharded.params["Dense_1"]["kernel"]
    print(
        json.dumps(
            {
                "loss_1": float(m1["loss"]),
                "loss_8": float(m8["loss"]),
                "max_param_diff": max(jax.tree_util.tree_leaves(diffs)),
                "param_change": float(
                    np.max(
                        np.abs(
                            np.asarray(single.params["Dense_1"]["kernel"])
                            - np.asarray(params["Dense_1"]["kernel"])
                        )
                    )
                ),
                "kernel_spec": str(kernel.sharding.spec),
                "kernel_shard_shape": list(kernel.addressable_shards[0].data.shape),
                "kernel_shape": list(kernel.shape),
                "adam_mu_spec": str(jax.tree_util.tree_leaves(sharded.opt_state)[1].sharding.spec),
                "devices": len(kernel.sharding.device_set),
            }
        )
    )


if __name__ == "__main__":
    main()
