"""Z-Image-Turbo with TreeGRPO: the tree, credit, precision and optimizer settings of
configs/flux_treegrpo.py (BranchGRPO's released FLUX settings with TreeGRPO's sliding window
of 4 BRANCH(2) SDE steps, 16 leaves per prompt) on the distilled Z-Image-Turbo at 512 px with
the release's own sampling: 8 steps, the folder's static shift 3 and no classifier-free
guidance (ZImagePipeline's guidance_scale 0; here 1.0, the package's "off"). No released
GRPO code trains Z-Image; these are a starting point, not a paper's recipe.

python -m tree_grpo_jax.main --config=configs/zimage_treegrpo.py \
    --config.model.path=/path/to/Z-Image-Turbo --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo
from tree_grpo_jax.config import base_config


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c.name = "zimage_treegrpo"
    c.model.name = "zimage"
    c.model.path = "Tongyi-MAI/Z-Image-Turbo"
    c.model.zimage.resolution = 512
    c.sampling.num_steps = 8
    c.sampling.guidance_scale = 1.0  # distilled: no classifier-free guidance
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
