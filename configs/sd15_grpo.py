"""Stable Diffusion 1.5 with flat GRPO as DanceGRPO runs it: 50 DDIM steps at eta 1.0,
guidance 5.0, 16 chains per prompt sharing their initial noise, trained on HPS-v2.1 (its
Stable Diffusion run's reward; its model is SD1.4, the same UNet architecture).

python -m tree_grpo_jax.main --config=configs/sd15_grpo.py --config.model.path=/path/to/sd15 \
    --config.reward_models.hpsv2=/path/to/hpsv2.1

`--config.rewards=jpeg_compressibility` needs no reward weights."""

from configs import sd15


def get_config():
    c = sd15.get_config()
    c.name = "sd15_grpo"
    c.sampling.num_steps = 50
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.tree.shared_init_noise = True
    c.rewards = "hpsv2"
    c.train.rows_per_minibatch = 16
    return c
