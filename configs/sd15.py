"""Stable Diffusion 1.5 with TreeGRPO: 10 DDIM steps, a window of 4 BRANCH(2) steps (16
leaves per prompt), eta 1.0, guidance 5.0, bf16 compute with fp32 master weights, on DDPO's
compressibility task (its animal prompts, JPEG size as the reward: no reward weights).
No paper runs TreeGRPO on SD1.5; configs/sd15_hps.py trains this on HPS-v2.1, the reward of
TreeGRPO's and DanceGRPO's runs, and configs/sd15_grpo.py is DanceGRPO's SD setting.

python -m tree_grpo_jax.main --config=configs/sd15.py --config.model.path=/path/to/sd15
(a diffusers-layout folder; a hub id works where the machine reaches the hub).
"""

from tree_grpo_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "sd15"
    c.model.name = "sd"
    c.model.path = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.prompts.source = "animals"  # DDPO's prompt set
    c.prompts.batch_size = 4
    c.prompts.eval_count = 8
    c.sampling.num_steps = 10
    c.sampling.eta = 1.0
    c.sampling.guidance_scale = 5.0
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_slide_every = 0
    c.rewards = "jpeg_compressibility"  # DDPO's; needs no reward-model weights
    c.train.iterations = 200
    c.train.learning_rate = 1e-5
    c.train.rows_per_minibatch = 8
    c.train.grad_accumulation = 4
    c.eval.every = 20
    c.checkpoint.every = 20
    return c
