"""Stable Diffusion 3.5 Medium with Advantage Weighted Matching as its release trains it on
PickScore (scxue/advantage_weighted_matching config/dgx_awm.py pickscore_sd3_no_cfg_1node,
scripts/train_sd3_awm.py): 14 deterministic flow steps without guidance, 24 samples per
prompt, each trained at 6 times, one per stratum of its steps [0, 12) (time_type discrete,
timestep_fraction 0.9), generalized-Huber weighting (power 0.25), advantages clipped to +-5
and scaled to +-1 (advantage_max 1), PPO clip range 1, KL 1e-4 to the base and 1 to the EMA
copy (its decay min(0.001 * step, 0.3)), on-policy, learning rate 3e-4, one optimizer update
per iteration, advantages per prompt over the batch's std (global_std), LoRA on the
attention projections (rank 32, alpha 64).

python -m tree_grpo_jax.main --config=configs/sd35m_awm.py --config.model.path=/path/to/sd3.5-medium
Left out: their SA-solver sampler (here the Euler ODE step), their evaluation EMA (decay
0.99), their 40-step evaluation and GenEval / OCR rewards (the GenEval/OCR runs differ by
time_type discrete_wo_init, the awm section's default, and a KL of 0.003). Their prompts are
24 images x 6 prompts per GPU batch over 8 GPUs; here `prompts.batch_size` per host.
"""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_awm"
    c.tree.method = "awm"
    c.tree.window_slide_every = 0
    c.tree.group_size = 24
    c.sampling.num_steps = 14
    c.sampling.guidance_scale = 1.0
    c.awm.time_sampling = "discrete"
    c.lora.rank = 32
    c.lora.alpha = 64.0
    c.train.learning_rate = 3e-4
    c.train.clip_range = 1.0
    c.train.kl_beta = 1e-4
    c.train.updates_per_iteration = 1
    c.train.grad_accumulation = 1
    c.train.rows_per_minibatch = 8
    c.rewards = "pickscore"
    c.eval.num_steps = 40
    return c
