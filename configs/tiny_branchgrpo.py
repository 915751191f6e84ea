"""BranchGRPO on the tiny digits model: BRANCH(2) at steps 0, 2, 4 and 6 of 10 (16 leaves),
SDE elsewhere, depth-wise advantages."""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "tiny_branchgrpo"
    c.tree.method = "branchgrpo"
    c.tree.split_steps = (0, 2, 4, 6)
    c.tree.k = 2
    c.train.rows_per_minibatch = 60
    # the base learning rate: tiny.py's 2e-4 was measured on the window presets only
    c.train.learning_rate = 1e-4
    return c
