"""The forward-process objectives' shared base: the zero rows it builds from each objective's
rows record match, field by field, the shape after the row axis and the dtype of the rows
that objective's own `gather_rows` makes (the precompiled programs take the zeros)."""

import jax
import numpy as np
import pytest

from tree_grpo_jax.config import base_config
from tree_grpo_jax.methods import awm, crd, dgpo, dpo, nft

PROMPTS, GROUP, SAMPLE = 2, 3, (4, 5)


def _real_rows(name, leaves, weights):
    key = jax.random.PRNGKey(0)
    times = np.full((PROMPTS * GROUP, 2), 0.5)
    if name == "nft":
        return nft.NFT, nft.gather_rows(leaves, weights, key, num_steps=4, per_sample=2)
    if name == "awm":
        return awm.AWM, awm.gather_rows(leaves, weights, times, key)
    if name == "dgpo":
        return dgpo.DGPO, dgpo.gather_rows(leaves, weights, key, 4, 2, shared_noise=True)
    if name == "dpo":
        return dpo.DPO, dpo.gather_rows(leaves, weights, times[:PROMPTS], key)
    return crd.CRD, crd.gather_rows(leaves, weights, times[:PROMPTS], key)


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo", "dpo", "crd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_zero_rows_have_the_real_rows_shapes_and_dtypes(name, dtype):
    config = base_config()
    config.tree.group_size = GROUP
    rng = np.random.default_rng(0)
    leaves = rng.normal(size=(PROMPTS, GROUP, *SAMPLE)).astype(dtype)
    weights = rng.uniform(size=(PROMPTS, GROUP)).astype(np.float32)
    objective, real = _real_rows(name, leaves, weights)
    zeros = objective.zero_rows(config, 7, SAMPLE, 2, dtype)
    shapes = objective.zero_rows(config, 7, SAMPLE, 2, dtype, make=jax.ShapeDtypeStruct)
    assert type(zeros) is type(real) and type(shapes) is type(real)
    for field, want in vars(real).items():
        got, shape = getattr(zeros, field), getattr(shapes, field)
        assert got.shape == shape.shape == (7, *want.shape[1:]), field
        assert got.dtype == shape.dtype == want.dtype, field
        assert not np.any(got), field
