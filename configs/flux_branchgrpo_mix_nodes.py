"""FLUX.1-dev with the tree setting of configs/sd35m_branchgrpo_mix_nodes.py (node rewards
at BranchGRPO-Mix's branch points; BENCHMARKS.md section 17) on flux_branchgrpo_mix.py's
released FLUX settings: 15 split parents' x0 estimates scored beside 16 leaves per prompt.

python -m tree_grpo_jax.main --config=configs/flux_branchgrpo_mix_nodes.py \
    --config.model.path=/path/to/FLUX.1-dev --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo_mix, sd35m_branchgrpo_mix_nodes


def get_config():
    c = flux_branchgrpo_mix.get_config()
    c.name = "flux_branchgrpo_mix_nodes"
    return sd35m_branchgrpo_mix_nodes.with_node_rewards(c)
