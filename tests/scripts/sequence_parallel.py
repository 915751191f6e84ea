"""A DiT denoiser with each sample's tokens split over a 'sequence' mesh axis, as the run
lays it out (`run.denoiser.laid_out`), against the same denoiser on one device: the output of
one call and the gradient of a loss through it, for one family's tiny folder (launch/
tiny_folders.py; 2 heads each: sequence 2, alone and beside fsdp 2, and Wan beside data 2
too). Wan adds a 4-head transformer of the same width with random weights (sequence 4).
Prints one JSON line per case: the largest differences, the scale of what was compared, the
all-to-alls in the compiled programs, a device's share of the FLOPs and the seconds the case
took. Run with XLA_FLAGS=--xla_force_host_platform_device_count=4; arguments: the family
(a key of FAMILIES), then its tiny folder."""

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import (
    flux2_klein_treegrpo,
    flux_branchgrpo,
    qwenimage_grpo,
    sd35m,
    wan_branchgrpo,
    zimage_grpo,
)
from tree_grpo_jax import sharding
from tree_grpo_jax.models import registry
from tree_grpo_jax.models.base import attention_heads
from tree_grpo_jax.models.wan import load as wan_load
from tree_grpo_jax.run import denoiser

ROWS = 4


PROMPTS = ["a red cube", "two cats on a sofa", "a lighthouse at night", "a bowl of soup"]

# family -> (its config, its settings section, settings that keep the tokens few)
FAMILIES = {
    "wan": (wan_branchgrpo, "wan", dict(resolution=(16, 32), num_frames=9, t5_max_length=8)),
    "flux": (flux_branchgrpo, "flux", dict(resolution=64, t5_max_length=8)),  # 16 + 8 tokens
    "sd3": (sd35m, "sd3", dict(sample_size=8, t5_max_length=8)),  # 16 + 77 + 8 tokens
    "flux2": (flux2_klein_treegrpo, "flux2", dict(resolution=32, text_max_length=40)),
    "qwenimage": (qwenimage_grpo, "qwenimage", dict(resolution=64, text_max_length=40)),
    "zimage": (zimage_grpo, "zimage", dict(resolution=32, text_max_length=40)),
}
# (data, fsdp, sequence): the tiny transformers' 2 heads split over sequence 2
MESHES = [(1, 1, 2), (1, 2, 2)]


def tiny_model(family: str, folder: str):
    """The tiny folder's model at a size with few tokens, float32."""
    module, section, settings = FAMILIES[family]
    config = module.get_config()
    config.model[section].update(settings)
    config.model.path = folder
    config.model.compute_dtype = "float32"
    config.model.remat = False
    return registry.load_model(config.model, seed=0)


def inputs(model):
    """Rows whose outputs differ: distinct noise, timesteps and prompts per row."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, *model.sample_shape)).astype(np.float32)
    t = np.asarray([900.0, 600.0, 300.0, 50.0], np.float32)
    if model.prepare_prompts is not None:  # the flow families encode ahead
        model.prepare_prompts(PROMPTS)
    cond = np.asarray(model.encode_prompts(PROMPTS), np.float32)
    weights = rng.normal(size=x.shape).astype(np.float32)
    return x, t, cond, weights


def compute(denoise, params, x, t, cond, weights, mesh):
    """(output, gradient, all-to-alls in the two compiled programs) with params sharded as
    the run shards them and the rows split over the mesh."""
    fn = denoiser.laid_out(denoise, mesh)
    placed = jax.device_put(params, sharding.param_shardings(mesh, params))
    x, t, cond, weights = sharding.shard_batch(mesh, (x, t, cond, weights))

    def loss(p):
        return jnp.sum(fn(p, x, t, cond) * weights)

    forward = jax.jit(fn)
    gradient = jax.jit(jax.grad(loss))
    compiled = [forward.lower(placed, x, t, cond).compile(), gradient.lower(placed).compile()]
    texts = [c.as_text() for c in compiled]
    cost = compiled[0].cost_analysis()
    flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])  # one device's
    out = np.asarray(forward(placed, x, t, cond))
    grads = jax.tree_util.tree_map(np.asarray, gradient(placed))
    all_to_alls = [text.count("all-to-all-start") + text.count(" all-to-all(") for text in texts]
    return out, grads, all_to_alls, flops


def compare(name, denoise, params, model, meshes):
    data = inputs(model)
    one = sharding.make_mesh(1, 1, jax.devices()[:1])
    out_1, grads_1, _, flops_1 = compute(denoise, params, *data, one)
    grad_scale = max(float(np.max(np.abs(g))) for g in jax.tree_util.tree_leaves(grads_1))
    for data_size, fsdp, sequence in meshes:
        start = time.perf_counter()
        devices = jax.devices()[: data_size * fsdp * sequence]
        mesh = sharding.make_mesh(data_size, fsdp, devices, sequence)
        out, grads, all_to_alls, flops = compute(denoise, params, *data, mesh)
        grad_diff = jax.tree_util.tree_map(
            lambda a, b: float(np.max(np.abs(a - b))), grads, grads_1
        )
        print(
            json.dumps(
                {
                    "case": name,
                    "mesh": [data_size, fsdp, sequence],
                    "out_diff": float(np.max(np.abs(out - out_1))),
                    "out_scale": float(np.max(np.abs(out_1))),
                    "grad_diff": max(jax.tree_util.tree_leaves(grad_diff)),
                    "grad_scale": grad_scale,
                    "all_to_alls": all_to_alls,
                    # a device's share of the forward's FLOPs (one device's: 1)
                    "flops_share": flops / flops_1,
                    "rows_differ": bool(np.max(np.abs(out_1[0] - out_1[1])) > 1e-3),
                    "seconds": time.perf_counter() - start,
                }
            ),
            flush=True,
        )


def main(family: str, folder: str):
    assert jax.device_count() == 4, jax.device_count()
    model = tiny_model(family, folder)
    heads = attention_heads(model)
    assert heads == 2, heads
    meshes = [*MESHES, (2, 1, 2)] if family == "wan" else MESHES
    compare(f"{family}_tiny_folder", model.denoise, model.params, model, meshes)
    if family == "wan":  # 4 heads of the same width: mesh.sequence=4 gives each device one
        four = dataclasses.replace(model.transformer, num_attention_heads=4, attention_head_dim=8)
        params = four.init_weights(jax.random.PRNGKey(1))
        compare(
            "wan_four_heads", wan_load.make_denoise(four), params, model, [(1, 1, 4), (1, 2, 2)]
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
