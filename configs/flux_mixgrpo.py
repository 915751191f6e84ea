"""FLUX.1-dev with MixGRPO as its release runs it (scripts/finetune/finetune_flux_grpo_MixGRPO.sh):
25 steps with a static shift of 3 at 720x720 px, SDE (eta 0.7) only in a window of 4 steps
that slides one step every 25 iterations, ODE elsewhere, 12 chains per prompt from one shared
initial noise, PPO clip 1e-4, learning rate 1e-5. The release mixes several rewards; this
config uses HPS-v2.1 (add others as `--config.rewards=hpsv2:1,clip_score:1`)."""

from configs import flux_branchgrpo


def get_config():
    c = flux_branchgrpo.get_config()
    c.name = "flux_mixgrpo"
    c.sampling.num_steps = 25
    c.sampling.noise_level = 0.7
    c.tree.method = "mixgrpo"
    c.tree.group_size = 12
    c.tree.shared_init_noise = True
    c.tree.window = 4
    c.tree.window_start = 0
    c.tree.window_slide_every = 25
    c.train.clip_range = 1e-4
    return c
