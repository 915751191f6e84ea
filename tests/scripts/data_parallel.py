"""Trains the random tiny model for two iterations on every mesh named on the command line,
over all of this process's devices (simulate several with
XLA_FLAGS=--xla_force_host_platform_device_count=N), and writes what the comparison with one
device needs: the parameters before and after, the evaluation before and after, and where
the rollout's leaves and the weights live.

    python data_parallel.py OUT.npz full:8:1 lora:2:4   (kind:data:fsdp)
"""

import json
import sys
import tempfile

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from tree_grpo_jax.config import base_config
from tree_grpo_jax.run import loop as train


def config(kind: str, data: int, fsdp: int):
    c = base_config()
    c.model.name = "random_tiny"
    c.prompts.source = "digits"
    c.prompts.batch_size = 8
    c.prompts.eval_count = 5  # not a multiple of the devices: topped up and cut
    c.sampling.num_steps = 4
    c.sampling.guidance_scale = 2.0
    c.tree.method = "treegrpo"
    c.tree.window = 2
    c.train.iterations = 2
    # Large steps, so a float32 rounding of the weights is far below what training moved;
    # Adam's eps of 1 makes the update follow the gradient, not only its sign.
    c.train.learning_rate = 5e-2 if kind == "lora" else 1e-2
    c.train.adam_eps = 1.0
    c.train.clip_range = 0.2
    c.train.rows_per_minibatch = 16
    c.rewards = "digit_alignment"
    c.eval.extra_rewards = ("digit_accuracy",)
    c.mesh.data, c.mesh.fsdp = data, fsdp
    c.lora.rank = 4 if kind == "lora" else 0
    c.log.progress = False
    c.log.tensorboard = False
    return c


def flat(params) -> dict:
    return {"/".join(k): np.asarray(v) for k, v in flatten_dict(jax.device_get(params)).items()}


def run(kind: str, data: int, fsdp: int, arrays: dict) -> dict:
    name = f"{kind}:{data}:{fsdp}"
    trainer, state = train.setup(config(kind, data, fsdp), tempfile.mkdtemp())
    sampled = trainer.rollout(
        state.params, trainer.host_state.prompts.prompts[:8], jax.random.key(0)
    )
    leaves = sampled.tree.leaves
    before, _ = trainer.evaluator.evaluate(state.params)
    arrays.update({f"{name}/before/{k}": v for k, v in flat(state.params).items()})
    for iteration in range(2):
        state, _ = trainer.iteration(state, iteration)
    after, _ = trainer.evaluator.evaluate(state.params)
    arrays.update({f"{name}/after/{k}": v for k, v in flat(state.params).items()})
    weights = state.params if trainer.adapter is None else trainer.adapter.base
    specs = [str(x.sharding.spec) for x in jax.tree_util.tree_leaves(weights)]
    moments = [str(x.sharding.spec) for x in jax.tree_util.tree_leaves(state.opt_state)]
    return {
        "eval_before": before,
        "eval_after": after,
        "leaf_devices": len(leaves.sharding.device_set),
        "leaf_shard_prompts": int(leaves.addressable_shards[0].data.shape[0]),
        "weights_fsdp_sharded": sum("fsdp" in s for s in specs),
        "moments_fsdp_sharded": sum("fsdp" in s for s in moments),
    }


def refusal(batch_size: int) -> str:
    """The sentence for a prompt batch the devices do not divide."""
    from tree_grpo_jax.config import ConfigError

    c = config("full", -1, 1)
    c.prompts.batch_size = batch_size
    try:
        train.setup(c, tempfile.mkdtemp())
    except ConfigError as e:
        return str(e)
    return ""


def main(out: str, runs: list[str]) -> None:
    arrays, report = {}, {"devices": jax.device_count()}
    report["refusal"] = refusal(6)
    for spec in runs:
        kind, data, fsdp = spec.split(":")
        report[spec] = run(kind, int(data), int(fsdp), arrays)
    np.savez(out, **arrays)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
