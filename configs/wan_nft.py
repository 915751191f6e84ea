"""Wan2.1-T2V-1.3B with DiffusionNFT: the released SD3.5-M settings of the method
(configs/sd35m_nft.py: LoRA rank 32, learning rate 3e-4, one update per iteration, beta 1,
KL 1e-4, deterministic unguided samples) on wan_branchgrpo.py's model, video size (240x416
px, 33 frames), 20 shifted steps and frame-averaged HPS-v2.1 reward, 16 videos per prompt.
The release has no video run.

python -m tree_grpo_jax.main --config=configs/wan_nft.py \
    --config.model.path=/path/to/Wan2.1-T2V-1.3B-Diffusers \
    --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import sd35m_nft, wan_branchgrpo


def get_config():
    c = sd35m_nft.released_method(wan_branchgrpo.get_config())
    c.name = "wan_nft"
    c.tree.group_size = 16
    return c
