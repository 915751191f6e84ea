"""Rewards: a registry of functions from decoded images (and prompts) to scores.

Importing this package registers the built-in rewards: `jpeg_compressibility`,
`jpeg_incompressibility` (host, PIL) and the preference models `hpsv2`, `pickscore`,
`aesthetic`, `clip_score` and `imagereward` (JAX-native, each read from its folder:
`load_reward("hpsv2", "/models/hpsv2.1")`). Model families bring the rewards of their own
world on first look-up: the tiny family's `digit_alignment`, `digit_probability`,
`digit_accuracy` (its digit classifier, in `models/tiny/rewards.py`).

A new reward is one `register` (or `register_model`, for one that reads a folder, with its
own settings as `options`) in its own module, imported here.

registry    the registry, `load_reward`, `load_rewards`, `combined_reward`
jpeg        JPEG (in)compressibility
clip        a frozen CLIP embedding images and prompts (transformers' Flax towers)
preprocess  the official scorers' image preprocessing, bit-exact, in JAX
preference  the four CLIP-based preference rewards
imagereward ImageReward (BLIP's ViT and cross-attending BERT, an MLP head) in Flax
convert     the pickled HPS-v2.1, aesthetic and ImageReward releases -> folders these load
"""

from tree_grpo_jax.rewards import imagereward, jpeg, preference
from tree_grpo_jax.rewards.registry import (
    CombinedReward,
    Reward,
    available_rewards,
    combined_reward,
    get_reward,
    load_reward,
    load_rewards,
    missing_weights,
    needs_weights,
    register,
    register_model,
)

register("jpeg_compressibility", jpeg.jpeg_compressibility, on_host=True)
register("jpeg_incompressibility", jpeg.jpeg_incompressibility, on_host=True)
preference.register_all()
imagereward.register()

__all__ = [
    "CombinedReward",
    "Reward",
    "available_rewards",
    "combined_reward",
    "get_reward",
    "load_reward",
    "load_rewards",
    "missing_weights",
    "needs_weights",
    "register",
    "register_model",
]
