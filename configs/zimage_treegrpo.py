"""Z-Image-Turbo with TreeGRPO: configs/zimage_branchgrpo.py (BranchGRPO's released FLUX SDE,
credit and optimizer settings on Flow-Factory's Z-Image-Turbo model and sampling settings:
512 px, 6 steps on the folder's static shift 3, 10 evaluation steps, no classifier-free
guidance) with TreeGRPO's tree: a window of 4 BRANCH(2) SDE steps (16 leaves per prompt)
sliding one step every iteration, ODE elsewhere, leaf advantages averaged up the tree. No
released code trains Z-Image with a tree method; these are a starting point, not a paper's
recipe.

python -m tree_grpo_jax.main --config=configs/zimage_treegrpo.py \
    --config.model.path=/path/to/Z-Image-Turbo --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import zimage_branchgrpo


def get_config():
    c = zimage_branchgrpo.get_config()
    c.name = "zimage_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
