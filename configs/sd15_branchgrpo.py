"""Stable Diffusion 1.5 with BranchGRPO: 20 DDIM steps, BRANCH(2) at steps 0, 3, 6 and 9 (16
leaves), SDE elsewhere, mean reward fusion and depth-wise advantages."""

from configs import sd15


def get_config():
    c = sd15.get_config()
    c.name = "sd15_branchgrpo"
    c.sampling.num_steps = 20
    c.tree.method = "branchgrpo"
    c.tree.split_steps = (0, 3, 6, 9)
    c.tree.k = 2
    c.advantage.fusion = "mean"
    return c
