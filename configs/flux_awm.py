"""FLUX.1-dev with Advantage Weighted Matching as Flow-Factory's FLUX.1 example trains it
(X-GenGroup/Flow-Factory examples/awm/lora/flux1/default.yaml, src/flow_factory/trainers/
awm.py): 10 deterministic flow steps, 16 samples per prompt, each trained at 4 times drawn
one per stratum of its first 70% of steps (time_sampling discrete, timestep_range 0.7),
generalized-Huber weighting (power 0.25), advantages clipped to +-1 unscaled
(adv_clip_range 1), PPO clip range 1, KL 0.1 to the EMA copy (decay min(0.001 * step, 0.3))
and none to the base, on-policy, learning rate 3e-4, one update per iteration, LoRA rank 64
(alpha 128), on flux_branchgrpo's model, resolution and HPS-v2.1 reward (theirs PickScore).
FLUX.1-dev's distilled guidance (3.5) is embedded: the samples are unguided otherwise.

python -m tree_grpo_jax.main --config=configs/flux_awm.py \
    --config.model.path=/path/to/FLUX.1-dev --config.reward_models.hpsv2=/path/to/hpsv2.1
Left out: their EMA warm-up (300 steps) and evaluation at 1024 px / 20 steps. The AWM
release itself has no FLUX config.
"""

from configs import flux_branchgrpo


def get_config():
    c = flux_branchgrpo.get_config()
    c.name = "flux_awm"
    c.tree.method = "awm"
    c.tree.window_slide_every = 0
    c.tree.group_size = 16
    c.sampling.num_steps = 10
    c.awm.train_timesteps = 4
    c.awm.time_sampling = "discrete"
    c.awm.timestep_fraction = 0.7
    c.awm.ema_beta = 0.1
    c.advantage.clip = 1.0
    c.awm.advantage_max = 1.0
    c.lora.rank = 64
    c.lora.alpha = 128.0
    c.train.learning_rate = 3e-4
    c.train.clip_range = 1.0
    c.train.kl_beta = 0.0
    c.train.updates_per_iteration = 1
    c.train.grad_accumulation = 1
    c.train.rows_per_minibatch = 8
    return c
