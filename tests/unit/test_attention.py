"""Attention backends against a float64 numpy softmax attention, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models import attention as attn

jax.config.update("jax_enable_x64", False)


def _numpy_attention(q, k, v, mask=None):
    """Softmax attention written out in float64, [B, L, H, D] layout."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(np.broadcast_to(mask, scores.shape), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def _inputs(seed, q_len, k_len, heads=3, dim=8, batch=2, value_dim=None):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, q_len, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, k_len, heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, k_len, heads, value_dim or dim)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _causal_ish_mask(batch, heads, q_len, k_len, seed=0):
    """Random True/False with at least one True per row (every query attends something)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, 1, q_len, k_len)) < 0.6
    mask[..., 0] = True
    return jnp.asarray(mask)


@pytest.mark.parametrize(
    "q_len, k_len, block, masked",
    [(16, 16, 4, False), (37, 53, 16, False), (37, 53, 16, True), (5, 70, 64, True)],
)
def test_blockwise_values_match_a_float64_softmax(q_len, k_len, block, masked):
    q, k, v = _inputs(q_len + k_len, q_len, k_len)
    mask = _causal_ish_mask(2, 3, q_len, k_len) if masked else None
    want = _numpy_attention(q, k, v, None if mask is None else np.asarray(mask))
    got = attn.attention(q, k, v, backend="blockwise", mask=mask, block_size=block)
    xla = attn.attention(q, k, v, backend="xla", mask=mask)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xla), want, atol=1e-5, rtol=1e-5)
    # The reference is no constant: the queries' rows attend differently.
    assert np.std(want[:, 0] - want[:, 1]) > 0.05


@pytest.mark.parametrize("masked", [False, True])
def test_blockwise_gradients_match_xla(masked):
    q_len, k_len = 23, 41
    q, k, v = _inputs(7, q_len, k_len)
    mask = _causal_ish_mask(2, 3, q_len, k_len, seed=3) if masked else None
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(2, q_len, 3, 8)), jnp.float32)

    def loss(backend):
        def f(q, k, v):
            out = attn.attention(q, k, v, backend=backend, mask=mask, block_size=8)
            return jnp.sum(out * cotangent)

        return f

    got = jax.grad(loss("blockwise"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
        assert float(jnp.abs(w).max()) > 1e-2  # gradients that say something


def test_blockwise_under_jit_and_bfloat16():
    q, k, v = _inputs(11, 64, 96, heads=2, dim=16)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    run = jax.jit(lambda q, k, v: attn.attention(q, k, v, backend="blockwise", block_size=32))
    out = run(q16, k16, v16)
    assert out.dtype == jnp.bfloat16
    want = _numpy_attention(q16.astype(jnp.float32), k16.astype(jnp.float32), v16)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)


def test_a_fully_masked_row_stays_finite():
    q, k, v = _inputs(2, 4, 12)
    mask = np.ones((2, 1, 4, 12), bool)
    mask[:, :, 1] = False
    out = attn.attention(q, k, v, backend="blockwise", mask=jnp.asarray(mask), block_size=5)
    grads = jax.grad(lambda q: attn.blockwise_attention(q, k, v, mask=jnp.asarray(mask)).sum())(q)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(grads)).all()


def test_auto_and_planning_choose_by_platform():
    assert attn.resolve("auto", "gpu") == "cudnn"
    assert attn.resolve("auto", "tpu") == "pallas"
    assert attn.resolve("auto", "cpu", 64, 64) == "xla"
    assert attn.resolve("auto", "cpu", 8192, 8192) == "blockwise"
    assert attn.resolve("xla", "gpu") == "xla"
    assert attn.plan_backend("auto", "cpu")[0] == "blockwise"
    assert attn.plan_backend("auto", "gpu") == ("auto", "")  # a GPU plan compiles cuDNN's
    assert "cudnn" in attn.plan_backend("cudnn", "cpu")[1]
    assert attn.plan_backend("xla", "cpu") == ("xla", "")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        attn.resolve("flash", "cpu")


def test_pallas_kernel_in_interpret_mode_where_jax_allows_it():
    q, k, v = _inputs(5, 128, 128, heads=2, dim=128, batch=1)
    from jax.experimental.pallas import tpu as pltpu

    try:
        with pltpu.force_tpu_interpret_mode():
            out = attn.attention(q, k, v, backend="pallas")
    except Exception as e:  # the TPU kernel's lowering may need a TPU even when interpreted
        pytest.skip(f"the TPU flash kernel does not run interpreted here: {type(e).__name__}")
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v), atol=1e-4)


def test_a_run_is_refused_a_kernel_its_platform_lacks():
    # a run on a GPU may ask for cuDNN's kernel, one on a TPU for Pallas'; not the other way
    assert attn.check_platform("cudnn", "gpu") is None
    assert attn.check_platform("pallas", "tpu") is None
    for backend in ("xla", "blockwise", "auto"):
        assert attn.check_platform(backend, "cpu") is None
    assert attn.check_platform("cudnn", "tpu").startswith(
        "model.attention=cudnn is the fused kernel of NVIDIA GPUs, but this run's devices are TPUs"
    )
    assert "fused kernel of TPUs" in attn.check_platform("pallas", "gpu")
