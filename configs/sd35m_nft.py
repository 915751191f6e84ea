"""Stable Diffusion 3.5 Medium with DiffusionNFT as its release trains it (NVlabs/DiffusionNFT,
config/nft.py, the PickScore run): 10 deterministic flow steps per sample without guidance,
24 samples per prompt, LoRA rank 32 (alpha 64) on the attention projections, learning rate
3e-4, one optimizer update per iteration, beta 1, KL 1e-4 to the base, the old policy's
decay rising 0.001 per iteration up to 0.5, each sample trained at 9 of its 10 sigmas.

python -m tree_grpo_jax.main --config=configs/sd35m_nft.py --config.model.path=/path/to/sd3.5-medium
The release samples with a second-order (DPM-2) solver and evaluates an EMA of the weights
with 40 steps; here the sampler is the flow's Euler step and the eval uses the trained weights
(docs/methods.md, "DiffusionNFT"). Its prompts are 48 per iteration over 8 GPUs; here
`prompts.batch_size` per host, 4 by default.
"""

from configs import sd35m


def released_method(c):
    """The release's DiffusionNFT settings on config `c` (the diffusion_nft section's defaults
    are the release's too): ODE samples without guidance, LoRA, its optimizer and KL."""
    c.tree.method = "diffusion_nft"
    c.tree.window_slide_every = 0
    c.sampling.guidance_scale = 1.0
    c.lora.rank = 32
    c.lora.alpha = 64.0
    c.train.learning_rate = 3e-4
    c.train.kl_beta = 1e-4
    c.train.updates_per_iteration = 1
    c.train.grad_accumulation = 1
    return c


def get_config():
    c = released_method(sd35m.get_config())
    c.name = "sd35m_nft"
    c.tree.group_size = 24
    c.train.rows_per_minibatch = 8
    c.rewards = "pickscore"
    c.eval.num_steps = 40
    return c
