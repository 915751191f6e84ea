"""FLUX.1-dev with flat GRPO as DanceGRPO runs it (scripts/finetune/finetune_flux_grpo_8gpus.sh):
720x720 px, 16 steps with a static shift of 3, the released FLUX SDE at eta 0.3, 12 chains per
prompt from one shared initial noise, advantages normalised per prompt with the sample std,
clipped at 5, PPO clip 1e-4, learning rate 1e-5, gradient norm clipped at 0.01, HPS-v2.1.

DanceGRPO also trains a random 60% of each chain's steps (`--timestep_fraction 0.6`) and
keeps an EMA of the weights; this config trains every step and keeps no EMA.
"""

from configs import flux_branchgrpo


def get_config():
    c = flux_branchgrpo.get_config()
    c.name = "flux_dancegrpo"
    c.sampling.num_steps = 16
    c.tree.method = "grpo"
    c.tree.group_size = 12
    c.tree.shared_init_noise = True
    c.advantage.std_ddof = 1  # torch's std
    c.train.clip_range = 1e-4
    c.train.max_grad_norm = 0.01
    return c
