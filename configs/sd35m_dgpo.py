"""Stable Diffusion 3.5 Medium with DGPO as its release trains it on GenEval
(Luo-Yihong/DGPO config/dgpo.py geneval_sd3_4gpu over config/base.py,
scripts/train_sd3_dgpo.py): 10 deterministic flow steps (the folder's shift 3) with guidance 4.5, 16
samples per prompt, each group trained at 4 distinct steps of its first 5, one shared
forward noise per group, beta_dpo 100, the DSM clip against the EMA copy (range 1e-2; its
decay min(0.001 * step, 0.3), sampling with it after 500 iterations), the initial model as
the preference's reference, KL 0.02 to it, advantages over each prompt's std, learning rate
3e-4, one optimizer update per iteration, LoRA rank 64 (alpha 128) on the attention
projections. The trained velocity is the conditional one, as theirs.

python -m tree_grpo_jax.main --config=configs/sd35m_dgpo.py \
    --config.model.path=/path/to/sd3.5-medium
Left out: their DPM-solver sampler (here the Euler ODE step), their evaluation EMA (decay
0.9), the GenEval reward (PickScore here; their PickScore run sets beta_dpo 10, KL 1e-3 and
global_std). Their groups are 8 prompts x 16 images per update over 4 GPUs; here
`prompts.batch_size` per host, and a train row is one group at one step.
"""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_dgpo"
    c.tree.method = "dgpo"
    c.tree.window_slide_every = 0
    c.tree.group_size = 16
    c.sampling.guidance_scale = 4.5
    c.lora.rank = 64
    c.lora.alpha = 128.0
    c.train.learning_rate = 3e-4
    c.train.kl_beta = 0.02
    c.train.updates_per_iteration = 1
    c.train.grad_accumulation = 1
    c.train.rows_per_minibatch = 1  # one group of 16 per train step
    c.rewards = "pickscore"
    c.eval.num_steps = 14
    return c
