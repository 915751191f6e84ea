"""Builds the SD3 run of a model folder on every simulated CPU device and decodes one batch of
latents as the trainer does (`Trainer.device_decode`) and on one device; prints a JSON line
with the largest difference, the images' layout, and each program's per-device FLOPs (the
trainer's, and the model's own `decode` jitted on the split latents). Run with
XLA_FLAGS=--xla_force_host_platform_device_count=N:

    python device_decode.py SD3_FOLDER [SEQUENCE]

With SEQUENCE > 1 the mesh has a 'sequence' axis of that size: its devices hold the same
rows of a batch, and the decode still gives each device its own rows.
"""

import json
import sys
import tempfile

import jax
import numpy as np

from tree_grpo_jax import sharding
from tree_grpo_jax.config import base_config
from tree_grpo_jax.plan.program_cost import program_cost
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run import scoring


def config(folder: str, sequence: int = 1):
    c = base_config()
    c.mesh.sequence = sequence
    c.model.name = "sd3"
    c.model.path = folder
    c.model.sd3.sample_size = 8
    c.model.sd3.t5_max_length = 8
    c.prompts.source = "animals"
    c.prompts.batch_size = jax.device_count() // sequence
    c.prompts.eval_count = jax.device_count()
    c.sampling.num_steps = 4
    c.tree.window = 2
    c.train.rows_per_minibatch = jax.device_count() // sequence
    c.rewards = "jpeg_compressibility"
    c.log.progress = False
    c.log.tensorboard = False
    return c


def main(folder: str, sequence: int = 1) -> None:
    trainer, _ = train.setup(config(folder, sequence), tempfile.mkdtemp())
    model, mesh = trainer.model, trainer.mesh
    rows = 8 * jax.device_count()  # two trips of the decoder loop (4 rows a trip) a device
    latents = np.random.default_rng(0).standard_normal((rows, *model.sample_shape), np.float32)
    split = jax.device_put(latents, sharding.batch_sharding(mesh))  # as the rollout leaves them
    ours = trainer.device_decode(split)
    alone = model.decode(jax.device_put(latents, jax.devices()[0]))  # one device, every row
    params = jax.device_put(model.decode.params, sharding.replicated(mesh))
    shared = jax.jit(model.decode.apply).lower(params, split).compile()
    axes = sharding.row_axes(mesh, rows)
    own = jax.device_put(latents, sharding.NamedSharding(mesh, sharding.P(axes)))
    per_device = scoring.device_decoder(model.decode.apply, mesh, axes).lower(params, own)
    per_device = per_device.compile()
    result = {
        "devices": jax.device_count(),
        "rows": rows,
        "max_diff": float(np.max(np.abs(np.asarray(ours) - np.asarray(alone)))),
        "shard_rows": sorted({s.data.shape[0] for s in ours.addressable_shards}),
        "flops_trainer": program_cost(per_device).flops,
        "flops_model_jit": program_cost(shared).flops,
        "one_device_flops": program_cost(
            jax.jit(model.decode.apply).lower(model.decode.params, latents).compile()
        ).flops,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
