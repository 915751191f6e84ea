"""Qwen-Image with TreeGRPO: configs/qwenimage_branchgrpo.py (BranchGRPO's released FLUX
tree, SDE, credit and optimizer settings on the released Qwen-Image GRPO runs' model and
sampling settings: 512 px, 256 text tokens, 10 steps on the folder's dynamic-shift schedule,
guidance 4, 50 evaluation steps) with TreeGRPO's tree: a window of 4 BRANCH(2) SDE steps (16
leaves per prompt) sliding one step every iteration, ODE elsewhere, leaf advantages averaged
up the tree. Qwen-Image's pipeline guides with true CFG against a negative prompt and
rescales the guided prediction to the conditional one's norm; here guidance is the package's
classifier-free guidance against the empty prompt, without that rescaling. No released code
trains Qwen-Image with a tree method; these are a starting point, not a paper's recipe.

python -m tree_grpo_jax.main --config=configs/qwenimage_treegrpo.py \
    --config.model.path=/path/to/Qwen-Image --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import qwenimage_branchgrpo


def get_config():
    c = qwenimage_branchgrpo.get_config()
    c.name = "qwenimage_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
