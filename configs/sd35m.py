"""Stable Diffusion 3.5 Medium with TreeGRPO as its paper runs it: 10 flow-matching steps,
a window of 4 BRANCH(2) SDE steps (16 leaves per prompt) that slides each iteration, ODE
steps elsewhere, SDE noise level 0.7, guidance 4.5, 512 px (64x64 latents), fp32 master
weights with bf16 compute and gradient checkpointing.

The reward is the paper's, HPS-v2.1, from a converted folder (docs/models/sd35.md has the
whole recipe: download, convert, train, evaluate):

python -m tree_grpo_jax.main --config=configs/sd35m.py --config.model.path=/path/to/sd3.5-medium \
    --config.reward_models.hpsv2=/path/to/hpsv2.1

(`model.path`: a diffusers-layout folder of stabilityai/stable-diffusion-3.5-medium).
`--config.rewards=jpeg_compressibility` trains on JPEG size instead, which needs no reward
weights. `--config.model.sd3.use_t5=False` runs without the 4.7B T5 encoder (its tokens are
zeros).
"""

from tree_grpo_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "sd35m"
    c.model.name = "sd3"
    c.model.path = "stabilityai/stable-diffusion-3.5-medium"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.model.sd3.sample_size = 64  # latents; 8x VAE -> 512 px (the folder's own is 128: 1024 px)
    c.prompts.source = "animals"
    c.prompts.batch_size = 4
    c.prompts.eval_count = 8
    c.sampling.num_steps = 10
    c.sampling.noise_level = 0.7
    c.sampling.guidance_scale = 4.5
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_slide_every = 1
    c.rewards = "hpsv2"  # the paper's; jpeg_compressibility needs no weights
    c.train.iterations = 200
    c.train.learning_rate = 1e-5
    c.train.rows_per_minibatch = 8
    c.train.grad_accumulation = 4
    c.eval.every = 20
    c.checkpoint.every = 20
    return c
