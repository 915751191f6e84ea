"""FLUX.1-dev with DiffusionNFT: the released SD3.5-M settings of the method (configs/sd35m_nft.py:
LoRA rank 32, learning rate 3e-4, one update per iteration, beta 1, KL 1e-4, each sample
trained at 99% of its sigmas) on flux_branchgrpo's model, resolution, 20 shifted steps and
HPS-v2.1 reward. The release has no FLUX run; its samples are deterministic (ODE) and
unguided, which FLUX.1-dev is anyway (its distilled guidance 3.5 is embedded).

python -m tree_grpo_jax.main --config=configs/flux_nft.py \
    --config.model.path=/path/to/FLUX.1-dev --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo, sd35m_nft


def get_config():
    c = sd35m_nft.released_method(flux_branchgrpo.get_config())
    c.name = "flux_nft"
    c.tree.group_size = 16
    return c
