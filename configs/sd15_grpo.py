"""Stable Diffusion 1.5 with flat GRPO as DanceGRPO runs it: 50 DDIM steps at eta 1.0,
guidance 5.0, 16 chains per prompt sharing their initial noise."""

from configs import sd15


def get_config():
    c = sd15.get_config()
    c.name = "sd15_grpo"
    c.sampling.num_steps = 50
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.tree.shared_init_noise = True
    c.train.rows_per_minibatch = 16
    return c
