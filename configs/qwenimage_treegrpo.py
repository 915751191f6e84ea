"""Qwen-Image with TreeGRPO: the tree, credit, precision and optimizer settings of
configs/zimage_treegrpo.py (configs/flux_branchgrpo.py's released BranchGRPO FLUX settings
with TreeGRPO's sliding window of 4 BRANCH(2) SDE steps, 16 leaves per prompt: 20 steps) on
Qwen-Image at 512 px with the folder's own schedule (dynamic shift, terminal sigma 0.02).
Qwen-Image is not guidance-distilled: its pipeline's example samples with `true_cfg_scale` 4
against a negative prompt and rescales the guided prediction to the conditional one's norm;
here guidance is the package's classifier-free guidance, scale 4 against the empty prompt,
without that rescaling. No released GRPO code's Qwen-Image recipe is reproduced; these are a
starting point, not a paper's recipe.

python -m tree_grpo_jax.main --config=configs/qwenimage_treegrpo.py \
    --config.model.path=/path/to/Qwen-Image --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo
from tree_grpo_jax.config import base_config


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c.name = "qwenimage_treegrpo"
    c.model.name = "qwenimage"
    c.model.path = "Qwen/Qwen-Image"
    c.model.qwenimage.resolution = 512
    c.sampling.guidance_scale = 4.0  # plain CFG (the pipeline rescales its true CFG)
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
