"""Ring attention (`models.attention.ring_attention`) as a run reaches it: `attention` under
the run's `SequenceLayout` (`run.denoiser.attention_layout`) on a mesh whose 'sequence' axis
does not divide the heads, against `jax.nn.dot_product_attention` on one device: the output
of one call and the gradients (query, key, value) of a loss through it. Prints one JSON line
per case: the largest differences, the scale of what was compared, and the collectives in
the compiled programs. Run with XLA_FLAGS=--xla_force_host_platform_device_count=4.

Argument "unit" (the default): random arrays. "wan": a 3-head Wan transformer of the tiny
folder's width with random weights, its denoiser as the run lays it out with sequence 2
against one device (argument 2: the tiny Wan folder)."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_grpo_jax import sharding
from tree_grpo_jax.models import attention as attention_backends
from tree_grpo_jax.models import base
from tree_grpo_jax.run import denoiser


def collectives(compiled_text):
    return {
        "collective_permutes": compiled_text.count("collective-permute-start")
        + compiled_text.count(" collective-permute("),
        "all_to_alls": compiled_text.count("all-to-all-start")
        + compiled_text.count(" all-to-all("),
    }


def one_device(q, k, v, mask, weights):
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def split(mesh, q, k, v, mask, weights, block_size):
    layout = denoiser.attention_layout(mesh)
    rows = sharding.BATCH_AXES if q.shape[0] % sharding.num_batch_shards(mesh) == 0 else None
    tokens = NamedSharding(mesh, P(rows, sharding.SEQUENCE_AXIS))
    q, k, v, weights = (jax.device_put(x, tokens) for x in (q, k, v, weights))

    def loss(q, k, v):
        with base.sequence_layout(layout):
            out = attention_backends.attention(
                q, k, v, backend="xla", mask=mask, block_size=block_size
            )
        return jnp.sum(out * weights), out

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    text = fn.lower(q, k, v).compile().as_text()
    (_, out), grads = fn(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads], collectives(text)


def report(case, mesh_sizes, out, grads, out_1, grads_1, counts):
    print(
        json.dumps(
            {
                "case": case,
                "mesh": mesh_sizes,
                "out_diff": float(np.max(np.abs(out - out_1))),
                "out_scale": float(np.max(np.abs(out_1))),
                "grad_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(grads, grads_1)),
                "grad_scale": max(float(np.max(np.abs(g))) for g in grads_1),
                **counts,
            }
        ),
        flush=True,
    )


def unit():
    rng = np.random.default_rng(0)
    heads, dim, batch = 3, 8, 2
    cases = [
        # name, mesh (data, fsdp, sequence), query and key lengths, mask, keys per block
        ("self", (1, 1, 4), 16, 16, None, 512),
        ("self_small_blocks", (1, 1, 4), 24, 24, None, 4),  # 6 keys a device: padded blocks
        ("cross", (1, 1, 2), 8, 12, None, 512),
        ("key_mask", (1, 1, 4), 16, 16, "key", 512),
        ("key_mask_rows_over_fsdp", (1, 2, 2), 16, 16, "key", 4),
        ("full_mask", (2, 1, 2), 12, 16, "full", 512),
    ]
    for name, (data, fsdp, sequence), q_len, k_len, mask_kind, block in cases:
        q = rng.normal(size=(batch, q_len, heads, dim)).astype(np.float32)
        k = rng.normal(size=(batch, k_len, heads, dim)).astype(np.float32)
        v = rng.normal(size=(batch, k_len, heads, dim)).astype(np.float32)
        weights = rng.normal(size=q.shape).astype(np.float32)
        mask = None
        if mask_kind == "key":  # as Qwen-Image and Z-Image pass theirs: [B, 1, 1, Lk]
            valid = rng.random((batch, k_len)) < 0.6
            valid[:, 0] = True  # every row attends something
            mask = valid[:, None, None, :]
        elif mask_kind == "full":  # [B, H, Lq, Lk]: the query dim split too
            mask = rng.random((batch, heads, q_len, k_len)) < 0.6
            mask[..., 0] = True
        out_1, grads_1 = one_device(q, k, v, mask, weights)
        devices = jax.devices()[: data * fsdp * sequence]
        mesh = sharding.make_mesh(data, fsdp, devices, sequence)
        out, grads, counts = split(mesh, q, k, v, mask, weights, block)
        report(name, [data, fsdp, sequence], out, grads, out_1, grads_1, counts)


def wan(folder):
    sys.path.insert(0, "tests/scripts")
    import sequence_parallel

    model = sequence_parallel.tiny_model("wan", folder)
    three = dataclasses.replace(model.transformer, num_attention_heads=3, attention_head_dim=8)
    params = three.init_weights(jax.random.PRNGKey(2))
    from tree_grpo_jax.models.wan import load as wan_load

    denoise = wan_load.make_denoise(three)
    data = sequence_parallel.inputs(model)
    one = sharding.make_mesh(1, 1, jax.devices()[:1])
    out_1, grads_1, _, _ = sequence_parallel.compute(denoise, params, *data, one)
    grads_1 = jax.tree_util.tree_leaves(grads_1)
    for data_size, fsdp, sequence in [(1, 1, 2), (1, 2, 2)]:
        devices = jax.devices()[: data_size * fsdp * sequence]
        mesh = sharding.make_mesh(data_size, fsdp, devices, sequence)
        fn = denoiser.laid_out(denoise, mesh)
        placed = jax.device_put(params, sharding.param_shardings(mesh, params))
        x, t, cond, weights = sharding.shard_batch(mesh, data)

        def loss(p, fn=fn, x=x, t=t, cond=cond, weights=weights):
            return jnp.sum(fn(p, x, t, cond) * weights)

        gradient = jax.jit(jax.grad(loss))
        text = gradient.lower(placed).compile().as_text()
        out = np.asarray(jax.jit(fn)(placed, x, t, cond))
        grads = jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, gradient(placed)))
        counts = collectives(text)
        report("wan_three_heads", [data_size, fsdp, sequence], out, grads, out_1, grads_1, counts)


if __name__ == "__main__":
    assert jax.device_count() == 4, jax.device_count()
    if len(sys.argv) > 1 and sys.argv[1] == "wan":
        wan(sys.argv[2])
    else:
        unit()
