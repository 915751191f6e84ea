"""Flat GRPO on the tiny digits model: 16 SDE chains per prompt, the baseline of the demo."""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "tiny_grpo"
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.train.rows_per_minibatch = 80
    # one pass at the clip of 1e-4 (tiny.py's two updates were measured on the tree's rows)
    c.train.inner_epochs = 1
    c.train.clip_range = 1e-4
    return c
