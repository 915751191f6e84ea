"""Z-Image-Turbo with BranchGRPO: the tree, SDE, credit and optimizer settings of BranchGRPO's
released FLUX script (configs/flux_branchgrpo.py, from its
`scripts/finetune/finetune_flux_branchgrpo_8gpus.sh`: BRANCH(2) four times with split noise
4.0, one root per prompt, 16 leaves; its FLUX SDE at eta 0.3; mean reward fusion, depth-wise
advantages clipped at 5; PPO clip 1e-3; full fine-tuning at learning rate 1e-5; HPS-v2.1) on
Flow-Factory's Z-Image-Turbo model and sampling settings (configs/zimage_grpo.py, from
X-GenGroup/Flow-Factory `examples/grpo/lora/z_image_turbo/default.yaml`): 512 px, 6 steps on
the folder's static shift 3, 10 evaluation steps, no classifier-free guidance.

BranchGRPO releases no Z-Image run. Its FLUX splits (steps 0, 3, 6, 9 of 20) do not fit 6
steps; the four splits here are steps 0-3 (this package's choice, not a released value),
leaving the last 2 steps SDE.

python -m tree_grpo_jax.main --config=configs/zimage_branchgrpo.py \
    --config.model.path=/path/to/Z-Image-Turbo --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo, zimage_grpo
from tree_grpo_jax.config import base_config


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c = zimage_grpo.release_model_settings(c)
    c.name = "zimage_branchgrpo"
    c.tree.split_steps = (0, 1, 2, 3)
    return c
