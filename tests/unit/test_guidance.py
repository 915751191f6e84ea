"""Classifier-free guidance's batch of conditional and unconditional rows
(core/guidance.py)."""

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.core.guidance import guided_prediction


def _echo(params, x, t, cond):
    """A denoiser whose prediction is the conditioning it was handed, flattened."""
    return cond.reshape(cond.shape[0], -1)


def test_a_shorter_empty_prompt_keeps_each_prompts_own_rows():
    """An unconditional embedding of L' < L rows: each unconditional row is the empty
    prompt's rows then its own prompt's rows past L' (a first frame to animate)."""
    rng = np.random.default_rng(0)
    cond = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32)
    uncond = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)
    x, t = jnp.zeros((2, 15)), jnp.zeros((2,))
    got = guided_prediction(_echo, None, x, t, cond, uncond, 3.0)
    rows = jnp.concatenate([jnp.broadcast_to(uncond, (2, 3, 3)), cond[:, 3:]], axis=1)
    expected = rows + 3.0 * (cond - rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected).reshape(2, -1), rtol=1e-6)
    # Past L' the two passes agree, so guidance leaves those rows as they are.
    np.testing.assert_allclose(
        np.asarray(got).reshape(2, 5, 3)[:, 3:], np.asarray(cond[:, 3:]), rtol=1e-6
    )
    # A full-length empty prompt is broadcast as it is.
    full = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    got = guided_prediction(_echo, None, x, t, cond, full, 2.0)
    expected = full[None] + 2.0 * (cond - full[None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected).reshape(2, -1), rtol=1e-6)
