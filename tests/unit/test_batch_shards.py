"""`build.check_batches` on a mesh of 4 data x 2 fsdp batch shards (an abstract one: no
devices needed): the batches the devices split, each refused in one sentence that names
values that would work."""

import pytest
from jax.sharding import AbstractMesh

from tree_grpo_jax import config as cfg
from tree_grpo_jax.config import base_config
from tree_grpo_jax.run import build

MESH = AbstractMesh((4, 2, 1), ("data", "fsdp", "sequence"))  # 8 batch shards


def _config(denoise_rows: int):
    c = base_config()
    c.prompts.batch_size = 8
    c.train.rows_per_minibatch = 8
    c.sampling.denoise_rows = denoise_rows
    return c


@pytest.mark.parametrize("rows", [0, 8, 24])
def test_denoise_rows_the_shards_divide_pass(rows):
    build.check_batches(_config(rows), MESH)


@pytest.mark.parametrize("rows, works", [(1, "8"), (4, "8"), (12, "8 or 16"), (20, "16 or 24")])
def test_denoise_rows_the_shards_do_not_divide_is_one_sentence(rows, works):
    # such a chunk's rows would not split over the devices: each would compute them all
    with pytest.raises(cfg.ConfigError) as refused:
        build.check_batches(_config(rows), MESH)
    assert str(refused.value) == (
        f"sampling.denoise_rows ({rows}) must be 0 or a multiple of the 8 devices the batch "
        f"is split over (mesh data x fsdp); {works} would work."
    )


def test_the_prompt_batch_is_checked_first():
    c = _config(3)
    c.prompts.batch_size = 6
    with pytest.raises(cfg.ConfigError, match=r"^prompts.batch_size \(6\) .* 8 would work.$"):
        build.check_batches(c, MESH)
