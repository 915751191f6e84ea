"""FLUX.1-dev with TreeGRPO's tree on BranchGRPO's FLUX settings (flux_branchgrpo.py: 720 px,
20 steps, static shift 3, the released FLUX SDE at eta 0.3): a window of 4 BRANCH(2) SDE
steps (16 leaves per prompt) that slides one step every iteration, ODE elsewhere, leaf
advantages averaged up the tree, PPO clip 1e-3. TreeGRPO's paper runs SD3.5 Medium
(configs/sd35m.py); this puts the two tree methods side by side on one model."""

from configs import flux_branchgrpo


def get_config():
    c = flux_branchgrpo.get_config()
    c.name = "flux_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
