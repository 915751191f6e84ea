"""Stable Diffusion 1.5 with TreeGRPO trained on HPS-v2.1, evaluated on HPS-v2.1, PickScore,
the LAION aesthetic score and CLIP score side by side (the papers' table columns).

Needs the four reward folders (docs/prompts-and-rewards.md: where the weights come from and how
the pickled releases are converted):

python -m tree_grpo_jax.main --config=configs/sd15_hps.py \
    --config.model.path=/models/sd15 \
    --config.reward_models.hpsv2=/models/hpsv2.1 \
    --config.reward_models.pickscore=/models/PickScore_v1 \
    --config.reward_models.aesthetic=/models/aesthetic \
    --config.reward_models.clip_score=/models/clip-vit-large-patch14

HPDv2's training prompts (what HPS was fit on) go in with --config.prompts.source=FILE.txt.
"""

from configs import sd15


def get_config():
    c = sd15.get_config()
    c.name = "sd15_hps"
    c.rewards = "hpsv2"
    c.eval.extra_rewards = ("pickscore", "aesthetic", "clip_score")
    c.reward_options.dtype = "bfloat16"  # the ViT-H scorers beside the UNet on one GPU
    c.reward_options.chunk_size = 16
    return c
