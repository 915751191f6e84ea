"""Stable Diffusion 3.5 Medium with DGPO on JPEG compressibility, as its release's
`compressibility` setting (config/dgpo.py) runs it: the initial model as the preference's
reference with no KL term (train.kl_beta 0: the initial weights are kept for the
preference alone), the DSM clip at 5e-2, each group trained at steps drawn from the first 7
(trunc_steps 6), sampling with the EMA copy after 200 iterations; the rest as
configs/sd35m_dgpo.py (LoRA rank 64, learning rate 3e-4, one update per iteration).

python -m tree_grpo_jax.main --config=configs/sd35m_dgpo_jpeg.py \
    --config.model.path=/path/to/sd3.5-medium
"""

from configs import sd35m_dgpo


def get_config():
    c = sd35m_dgpo.get_config()
    c.name = "sd35m_dgpo_jpeg"
    c.rewards = "jpeg_compressibility"
    c.train.kl_beta = 0.0
    c.dgpo.reference = "initial"
    c.dgpo.clip_range = 5e-2
    c.dgpo.trunc_steps = 6
    c.dgpo.switch_ema_ref = 200
    return c
