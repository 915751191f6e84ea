"""mesh.sequence's all-to-alls in the time plan: the bytes a device sends, worked out by hand
for made-up shapes, the attention arrays read off a traced denoiser (scanned layers counted
with their length), and nothing at sequence 1."""

import types

import jax
import jax.numpy as jnp
import pytest
from small_configs import small_config

from tree_grpo_jax.models import attention
from tree_grpo_jax.plan import accelerators, sequence_traffic, time_plan
from tree_grpo_jax.plan.program_cost import ProgramCost

H100 = accelerators.ACCELERATORS["h100"]


def test_bytes_a_device_sends_by_hand():
    # 3 layers of one self-attention over 10 tokens, 2 heads of 4 (width 8), bfloat16 (2 bytes)
    to_heads = 3 * 3 * 10 * 8 * 2  # q, k, v of each layer: 1440 bytes a row
    to_tokens = 3 * 1 * 10 * 8 * 2  # each layer's output: 480
    ex = sequence_traffic.Exchange(
        sequence=4, batch_shards=2, to_heads=to_heads, to_tokens=to_tokens, attention_calls=3
    )
    # a device holds a quarter of a row's array and keeps a quarter of that: sends 3/16 of it
    assert sequence_traffic.sent_bytes(1920, 4) == 1920 * 3 / 16
    # 6 rows forward over 2 shards of rows: 3 rows of 1920 bytes each, 3/16 sent
    assert sequence_traffic.bytes_per_device(ex, 6) == pytest.approx(3 * 1920 * 3 / 16)
    # 6 rows forward of which 4 are differentiated (the backward moves as much again)
    expected = (2 * 1920 + 4 * 2 * 1920) / 2 * 3 / 16
    assert sequence_traffic.bytes_per_device(ex, 6, 4) == pytest.approx(expected)
    # remat recomputes the forward: a third pass; keeping attention's output, q, k, v only
    expected = (2 * 1920 + 4 * 3 * 1920) / 2 * 3 / 16
    assert sequence_traffic.bytes_per_device(ex, 6, 4, "block") == pytest.approx(expected)
    expected = (2 * 1920 + 4 * (3 * 1440 + 2 * 480)) / 2 * 3 / 16
    assert sequence_traffic.bytes_per_device(ex, 6, 4, "block_save_attention") == pytest.approx(
        expected
    )


def _tiny_model(layers=3, tokens=10, text=4, heads=2, head_dim=4):
    """A stand-in denoiser: `layers` scanned self-attentions over the sample's tokens and one
    cross-attention to the text, through the run's attention function, in bfloat16."""
    width = heads * head_dim

    def denoise(params, x, t, cond):
        h = (x.reshape(x.shape[0], tokens, width) * t[:, None, None]).astype(jnp.bfloat16)
        split = lambda a: a.reshape(*a.shape[:2], heads, head_dim)  # noqa: E731

        def layer(h, w):
            q, k, v = (split(h @ w[i]) for i in range(3))
            return h + attention.attention(q, k, v, backend="xla").reshape(h.shape), None

        h, _ = jax.lax.scan(layer, h, params["layers"])
        context = split(cond.astype(jnp.bfloat16) @ params["text"])
        out = attention.attention(split(h), context, context, backend="xla")
        return out.reshape(x.shape).astype(x.dtype)

    params = {
        "layers": jax.ShapeDtypeStruct((layers, 3, width, width), jnp.bfloat16),
        "text": jax.ShapeDtypeStruct((width, width), jnp.bfloat16),
    }
    return types.SimpleNamespace(
        denoise=denoise, params=params, sample_shape=(tokens, width), cond_shape=(text, width)
    )


def test_attention_arrays_are_read_off_the_traced_denoiser():
    arrays = sequence_traffic.row_arrays(_tiny_model())
    # 3 scanned layers: q, k, v of 10 tokens x 8 wide in bfloat16; then the cross-attention's
    # q over the 10 tokens and k, v over the 4 text tokens
    to_heads = 3 * 3 * 10 * 8 * 2 + 10 * 8 * 2 + 2 * 4 * 8 * 2
    to_tokens = 3 * 10 * 8 * 2 + 10 * 8 * 2  # every attention's output over the tokens
    assert arrays == {
        sequence_traffic.HEADS: to_heads,
        sequence_traffic.TOKENS: to_tokens,
        "calls": 4,
    }
    ex = sequence_traffic.exchange(_tiny_model(), 2, 1)
    assert (ex.to_heads, ex.to_tokens, ex.attention_calls) == (to_heads, to_tokens, 4)


def test_sequence_1_exchanges_nothing():
    assert sequence_traffic.exchange(_tiny_model(), 1, 4) is None
    assert sequence_traffic.sent_bytes(1e9, 1) == 0
    config = small_config("grpo")
    costs = {"rollout": ProgramCost(989e12, 0.0, 0.0, 989e12, ())}
    plan = time_plan.plan_time(config, costs, 1, H100, efficiency=0.5)
    (rollout,) = plan.programs
    assert plan.sequence == 1 and plan.communication_per_iteration == (0, 0)
    assert (rollout.communication_bytes, rollout.communication_s) == (0, 0)
    assert rollout.estimate_s == pytest.approx(2.0)
    assert "communication between devices" in plan.not_counted


def test_the_plan_adds_the_all_to_alls_at_the_interconnect():
    config = small_config("grpo")  # 4 chains of 4 steps, guidance: 32 rows a prompt, 2 prompts
    config.model.remat = False
    ex = sequence_traffic.Exchange(
        sequence=2, batch_shards=2, to_heads=600, to_tokens=200, attention_calls=1
    )
    costs = {
        "rollout": ProgramCost(989e12, 0.0, 0.0, 989e12, ()),
        "train_step": ProgramCost(989e12, 0.0, 0.0, 989e12, ()),
    }
    plan = time_plan.plan_time(config, costs, 4, H100, efficiency=0.5, exchange=ex)
    by_name = {p.name: p for p in plan.programs}
    # the rollout: 64 rows forward, 32 on each shard of rows, a quarter of 800 bytes each sent
    assert by_name["rollout"].communication_bytes == pytest.approx(64 / 2 * 800 / 4)
    assert by_name["rollout"].communication_s == pytest.approx(6400 / 450e9)
    assert by_name["rollout"].estimate_s == pytest.approx(2.0 + 6400 / 450e9)
    # a minibatch of 8 rows, each a guided pair: 16 rows forward and back
    assert by_name["train_step"].communication_bytes == pytest.approx(16 * 2 * 800 / 2 / 4)
    assert plan.sequence == 2
    assert not any(line == "communication between devices" for line in plan.not_counted)
    # an accelerator without an interconnect figure: bytes without seconds, and said so
    custom = accelerators.accelerator("custom", 989.0, 3.35)
    plan = time_plan.plan_time(config, costs, 4, custom, efficiency=0.5, exchange=ex)
    assert {p.name: p for p in plan.programs}["rollout"].communication_s == 0
    assert any("give --interconnect" in line for line in plan.not_counted)


def test_interconnect_figures():
    assert accelerators.accelerator("h100").interconnect == 450e9
    assert accelerators.accelerator("h100", interconnect_gb=100.0).interconnect == 100e9
    custom = accelerators.accelerator("custom", 100.0, 2.0, 50.0)
    assert custom.interconnect == 50e9
    for bad in (0.0, -1.0, 1e7):
        with pytest.raises(ValueError, match="--interconnect=.* must be a finite positive"):
            accelerators.accelerator("h100", interconnect_gb=bad)
