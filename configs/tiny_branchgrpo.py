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
    # one pass at the clip of 1e-4 (tiny.py's two updates were measured on the tree's rows)
    c.train.inner_epochs = 1
    c.train.clip_range = 1e-4
    return c
