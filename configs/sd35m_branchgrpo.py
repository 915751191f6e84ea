"""Stable Diffusion 3.5 Medium with BranchGRPO: 20 flow-matching steps, BRANCH(2) at steps
0, 3, 6 and 9 (16 leaves), SDE elsewhere, mean reward fusion and depth-wise advantages; the
rest, HPS-v2.1 included (BranchGRPO's reward too), as configs/sd35m.py."""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_branchgrpo"
    c.sampling.num_steps = 20
    c.tree.method = "branchgrpo"
    c.tree.window_slide_every = 0
    c.tree.split_steps = (0, 3, 6, 9)
    c.advantage.fusion = "mean"
    return c
