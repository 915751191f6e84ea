"""Wan2.1-T2V-1.3B with BranchGRPO: the tree and credit settings of BranchGRPO's released
FLUX script (configs/flux_branchgrpo.py) on a text-to-video model. The release ships no
video training script, so the video's own settings come from the public Wan2.1 RL codes:

- from BranchGRPO's FLUX script: BRANCH(2) at steps 0, 3, 6 and 9 with split noise 4.0 and
  one root per prompt (16 leaves, all from one initial noise), the released FLUX SDE
  (`flow_sde="dancegrpo"`, eta 0.3, with the score correction) elsewhere, mean reward
  fusion, depth-wise advantages clipped at 5, PPO clip 1e-3, learning rate 1e-5, weight
  decay 1e-4, gradient norm 1, an optimizer step every 3 minibatches of 4 rows, full
  fine-tuning in bf16 with gradient checkpointing, the HPS-v2.1 reward (here scored frame
  by frame and averaged over the frames);
- from the Wan2.1 GRPO script built on DanceGRPO's video trainer (Pref-GRPO's
  `finetune_prefgrpo_wan_2_1.sh`: `--h 240 --w 416 --t 33 --sampling_steps 20`): 240x416
  px, 33 frames (9 latent frames), 20 steps;
- from Flow-Factory's Wan2.1 text-to-video example (`examples/grpo/full/wan21/t2v.yaml`): a
  group of 16 videos per prompt (the tree's 16 leaves), classifier-free guidance 5.0 and
  flow_shift 3.0 (its and WanPipeline's value below 720p; DanceGRPO's `--shift 3` too).

python -m tree_grpo_jax.main --config=configs/wan_branchgrpo.py \
    --config.model.path=/path/to/Wan2.1-T2V-1.3B-Diffusers \
    --config.reward_models.hpsv2=/path/to/hpsv2.1

`python -m tree_grpo_jax.plan --config=configs/wan_branchgrpo.py
--config.model.path=builtin:wan-1.3b` plans it without the weights.
"""

from configs import flux_branchgrpo
from tree_grpo_jax.config import base_config


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c.name = "wan_branchgrpo"
    c.model.name = "wan"
    c.model.path = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    c.model.wan.resolution = (240, 416)
    c.model.wan.num_frames = 33
    c.model.wan.shift = 3.0
    c.sampling.guidance_scale = 5.0
    return c
