"""DiffusionNFT on the tiny rectified-flow twin: 16 deterministic (ODE) samples per prompt,
each trained at 9 of its 10 sigmas, one optimizer update per iteration as the method's
release makes per sampling round, at the release's learning rate 3e-4 (theirs for LoRA; here
full fine-tuning, which BENCHMARKS.md section 11 compares at 1e-4 and 3e-4).

python -m tree_grpo_jax.main --config=configs/tiny_flow_nft.py
"""

from configs import tiny_flow


def get_config():
    c = tiny_flow.get_config()
    c.name = "tiny_flow_nft"
    c.tree.method = "diffusion_nft"
    c.tree.group_size = 16
    c.train.learning_rate = 3e-4
    c.train.updates_per_iteration = 1
    c.train.rows_per_minibatch = 64
    return c
