"""`dit_layers.run_stack` under a run's row layout (`base.row_layout`, set where the mesh
splits rows or tokens): every array a block passes on is laid out, and a stream a block
ends (SD3's last block returns its text stream as None) passes through as None."""

import jax.numpy as jnp

from tree_grpo_jax.models import base
from tree_grpo_jax.models.dit_layers import run_stack


def test_the_row_layout_skips_a_stream_the_last_block_ends():
    def joint(tokens, text, temb):
        return tokens + temb, text * 2.0

    def last(tokens, text, temb):  # context_pre_only: no text after it
        return tokens + text.sum() + temb, None

    laid_out = []

    def record(x):
        laid_out.append(x.shape)
        return x

    tokens, text = jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4))
    with base.row_layout(record):
        out, ended = run_stack({"0": joint, "1": last}, (tokens, text), 1.0)
    assert ended is None
    assert jnp.allclose(out, 1.0 + 1.0 + 2.0 * 40 + 1.0)
    assert laid_out == [(2, 3, 4), (2, 5, 4), (2, 3, 4)]  # both streams, then the tokens
