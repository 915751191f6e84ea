"""Stable Diffusion 3.5 Medium with the tree setting that needed the fewest images of the
trees at one learning rate on all three rewards of the per-image study (BENCHMARKS.md
section 17): BranchGRPO-Mix on sd35m_branchgrpo.py's tree (20 steps, BRANCH(2) at 0, 3, 6
and 9: 16 leaves per prompt; SDE only in a window of 4 steps and at the splits, ODE
elsewhere) with node rewards at its branch points. The x0 estimates at the 1 + 2 + 4 + 8 =
15 split parents are decoded and scored beside the 16 leaves (1.94 decodes and reward calls
per image, no extra denoiser rows); an edge's credit is 0.75 its normalized gain, 0.25
BranchGRPO's fused value.

python -m tree_grpo_jax.main --config=configs/sd35m_branchgrpo_mix_nodes.py \
    --config.model.path=/path/to/sd3.5-medium --config.reward_models.hpsv2=/path/to/hpsv2.1

Where a reward call costs several denoiser passes or more (a large served judge),
`--config.advantage.node_rewards=leaf_means` keeps the gain credit at one call per image
(docs/methods.md, "Which tree setting, by what a reward call costs").
"""

from configs import sd35m_branchgrpo


def with_node_rewards(c):
    """Node rewards at the branch points, 0.75 of an edge's credit its gain (the study's
    best mix of 0.5, 0.75 and 1; also configs/flux_branchgrpo_mix_nodes.py's)."""
    c.advantage.node_rewards = "branch_points"
    c.advantage.node_mix = 0.75
    return c


def get_config():
    c = sd35m_branchgrpo.get_config()
    c.name = "sd35m_branchgrpo_mix_nodes"
    c.tree.method = "branchgrpo_mix"
    c.tree.window = 4
    return with_node_rewards(c)
