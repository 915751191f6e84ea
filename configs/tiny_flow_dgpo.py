"""DGPO on the tiny rectified-flow twin: 16 deterministic (ODE) samples per prompt, each
prompt's group trained at 4 distinct steps of its first 5 (sigmas near 1), one shared
forward noise per group, beta_dpo 100, the DSM clip against the EMA copy (range 1e-2), the
initial model as the preference's reference with a KL of 0.02 to it, advantages over each
prompt's own std; one optimizer update per iteration at learning rate 3e-4 (the release's,
for LoRA; here full fine-tuning).

Every `dgpo` field is the release's SD3.5-M GenEval default (Luo-Yihong/DGPO config/dgpo.py
geneval_sd3_4gpu over config/base.py, scripts/train_sd3_dgpo.py); the twin has no
classifier-free guidance, so its rollouts are unguided (theirs: 4.5) and the release's
DPM-solver sampler is the Euler ODE step here; their evaluation EMA (decay 0.9) is left out.
A row here is one prompt's group at one step: `train.rows_per_minibatch` counts groups.

python -m tree_grpo_jax.main --config=configs/tiny_flow_dgpo.py
"""

from configs import tiny_flow


def get_config():
    c = tiny_flow.get_config()
    c.name = "tiny_flow_dgpo"
    c.tree.method = "dgpo"
    c.tree.group_size = 16
    c.train.learning_rate = 3e-4
    c.train.kl_beta = 0.02  # their train.beta: the KL to the initial model, kept as reference
    c.train.updates_per_iteration = 1
    c.train.rows_per_minibatch = 4  # groups of 16: 64 samples per train step
    return c
