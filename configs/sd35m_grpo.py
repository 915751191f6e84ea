"""Stable Diffusion 3.5 Medium with flat GRPO as Flow-GRPO runs it: 10 steps, every step an
SDE step at noise level 0.7, 16 chains per prompt, guidance 4.5, KL to the initial model
(beta 0.04; the reference is a second copy of the transformer's weights)."""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_grpo"
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.train.kl_beta = 0.04
    c.train.rows_per_minibatch = 16
    return c
