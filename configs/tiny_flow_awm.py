"""Advantage Weighted Matching on the tiny rectified-flow twin: 16 deterministic (ODE)
samples per prompt, each trained at 6 times drawn one per stratum of its sampler steps
[1, 9) (time_sampling discrete_wo_init over int(10 * 0.9)), generalized-Huber weighting
(power 0.25), advantages clipped to +-5 and scaled to +-1, PPO clip range 1, the EMA copy's
KL (weight 1, decay min(0.001 * iterations, 0.3)) and no KL to the initial model; one
optimizer update per iteration at learning rate 3e-4 (the release's, for LoRA; here full
fine-tuning, as tiny_flow_nft).

Every `awm` field is the release's SD3.5-M GenEval/OCR default
(scxue/advantage_weighted_matching config/dgx_awm.py, scripts/train_sd3_awm.py); left out:
their SA-solver sampler (here the Euler ODE step), the evaluation EMA (decay 0.99) and the
KL to the base (train.kl_beta, theirs 0.003), which a tiny run does not need.

python -m tree_grpo_jax.main --config=configs/tiny_flow_awm.py
"""

from configs import tiny_flow


def get_config():
    c = tiny_flow.get_config()
    c.name = "tiny_flow_awm"
    c.tree.method = "awm"
    c.tree.group_size = 16
    c.train.learning_rate = 3e-4
    c.train.clip_range = 1.0  # their clip_range: the ratio is 1 on-policy anyway
    c.train.updates_per_iteration = 1
    c.train.rows_per_minibatch = 64
    return c
