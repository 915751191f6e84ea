"""Advantages of a method by name, through the method table, for tests."""

import ml_collections

from tree_grpo_jax import methods
from tree_grpo_jax.methods.ppo import PPOObjective

# the methods whose credit is per edge, the PPO ones (DiffusionNFT's is per leaf: test_nft.py)
METHOD_NAMES = tuple(n for n, m in methods.METHODS.items() if isinstance(m.objective, PPOObjective))


def advantages_of(
    method,
    spec,
    tree,
    rewards,
    clip=5.0,
    fusion="mean",
    alpha=1.0,
    ddof=0,
    edge_norm="none",
    branch_norm="depthwise",
):
    """The table entry's advantages, clipped to +-clip, as the trainer computes them."""
    config = ml_collections.ConfigDict(
        {
            "tree": {"method": method},
            "advantage": {
                "clip": clip,
                "fusion": fusion,
                "fusion_alpha": alpha,
                "std_ddof": ddof,
                "edge_normalization": edge_norm,
                "branch_normalization": branch_norm,
            },
        }
    )
    return methods.get(config.tree.method).clipped_advantages(config, spec, tree, rewards)
