"""Flat GRPO on the tiny digits model: 16 SDE chains per prompt, the baseline of the demo."""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "tiny_grpo"
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.train.rows_per_minibatch = 80
    # the base learning rate: tiny.py's 2e-4 was measured on the window presets only
    c.train.learning_rate = 1e-4
    return c
