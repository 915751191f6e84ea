"""A reward model's parameters sharded over a 4-way fsdp mesh give the same scores as on one
device. Run with XLA_FLAGS=--xla_force_host_platform_device_count=4; prints one JSON line."""

import json
import sys

import jax
import numpy as np

from tree_grpo_jax import rewards, sharding


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (8, 40, 48, 3)).astype(np.float32)
    prompts = ["a photo of a cat", "a dog"] * 4
    plain = rewards.load_reward("pickscore", folder)
    mesh = sharding.make_mesh(data=1, fsdp=4)
    sharded = rewards.load_reward("pickscore", folder, mesh=mesh)
    leaves = jax.tree_util.tree_leaves(sharded.fn.scorer.params)
    split = sum(1 for x in leaves if len(x.sharding.device_set) == 4 and not x.is_fully_replicated)
    expected = np.asarray(plain(images, prompts))
    got = np.asarray(sharded(sharding.shard_batch(mesh, images), prompts))
    print(
        json.dumps(
            {
                "devices": jax.device_count(),
                "sharded_leaves": split,
                "leaves": len(leaves),
                "max_abs_diff": float(np.abs(got - expected).max()),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
