"""Wan2.1-T2V-1.3B with TreeGRPO's tree on wan_branchgrpo.py's video settings (240x416 px,
33 frames, 20 steps, flow_shift 3, guidance 5, the released FLUX SDE at eta 0.3): a window
of 4 BRANCH(2) SDE steps (16 leaves per prompt) that slides one step every iteration, ODE
elsewhere, leaf advantages averaged up the tree, PPO clip 1e-3, as configs/flux_treegrpo.py
puts it on FLUX."""

from configs import wan_branchgrpo


def get_config():
    c = wan_branchgrpo.get_config()
    c.name = "wan_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
