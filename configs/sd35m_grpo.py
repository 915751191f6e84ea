"""Stable Diffusion 3.5 Medium with flat GRPO at TreeGRPO's settings (configs/sd35m.py: full
fine-tuning at learning rate 1e-5, HPS-v2.1, 512 px, guidance 4.5), the baseline TreeGRPO
is compared with: 10 steps, every step an SDE step with Flow-GRPO's SDE at noise level 0.7,
16 chains per prompt (the tree's 16 leaves), KL to the initial model at Flow-GRPO's GenEval
and OCR beta 0.04 (the reference is a second copy of the transformer's weights).

Flow-GRPO's own runs differ: LoRA rank 32 (alpha 64) at learning rate 3e-4, 24 images per
prompt, and GenEval, OCR or PickScore as the reward (PickScore with beta 0.01);
docs/coming-from.md maps them to flags.
"""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_grpo"
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.train.kl_beta = 0.04
    c.train.rows_per_minibatch = 16
    return c
