"""The small configs the tests train: the tiny architecture with random weights, a few steps,
two prompts, every iteration evaluated and checkpointed. One place, so that every test that
trains a tiny run starts from the same settings."""

from tree_grpo_jax.config import base_config


def small_config(method: str):
    """A two-iteration run of `method` that a 2-core CPU trains in seconds."""
    c = base_config()
    c.name = f"test_{method}"
    c.model.name = "random_tiny"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 4
    c.sampling.num_steps = 4
    c.sampling.guidance_scale = 2.0
    c.tree.method = method
    c.tree.group_size = 4
    c.tree.window = 2
    c.tree.k = 2
    c.tree.split_steps = (0, 2)
    c.train.iterations = 2
    c.train.learning_rate = 1e-3
    c.train.clip_range = 0.2
    c.train.rows_per_minibatch = 8
    c.rewards = "jpeg_compressibility"
    c.eval.every = 1
    c.checkpoint.every = 1
    c.log.progress = False
    c.log.tensorboard = False
    return c
