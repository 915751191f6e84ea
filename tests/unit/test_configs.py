"""Every shipped config passes validation (with its reward folders set where it needs them)."""

import importlib
import pathlib

import pytest

from tree_grpo_jax import config as cfg
from tree_grpo_jax import rewards

CONFIGS = sorted(p.stem for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.py"))
CONFIGS = [name for name in CONFIGS if name not in ("__init__", "base")]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_validates(name):
    c = importlib.import_module(f"configs.{name}").get_config()
    used = [*rewards.parse_rewards(c.rewards), *c.eval.extra_rewards]
    for reward in used:
        if rewards.missing_weights(reward, c.reward_models.get(reward)):
            with pytest.raises(cfg.ConfigError, match=f"reward_models.{reward}=/path"):
                cfg.validate(c, known_rewards=rewards.available_rewards())
            c.reward_models[reward] = f"/models/{reward}"
    weights = cfg.validate(c, known_rewards=rewards.available_rewards())
    assert weights == rewards.parse_rewards(c.rewards)


@pytest.mark.parametrize(
    "field, value", [("edge_normalization", "per_level"), ("branch_normalization", "per_tree")]
)
def test_bad_advantage_normalization_is_one_sentence(field, value):
    c = importlib.import_module("configs.tiny").get_config()
    c.advantage[field] = value
    with pytest.raises(cfg.ConfigError, match=f"advantage.{field} must be one of"):
        cfg.validate(c, known_rewards=rewards.available_rewards())


# The reward each paper trains the setting on that a shipped config reproduces (its text and
# released scripts; docs/coming-from.md): TreeGRPO on SD3.5-M with HPS-v2.1 (and its GRPO
# baseline), DanceGRPO's Stable Diffusion and FLUX runs, BranchGRPO's and MixGRPO's FLUX
# scripts with HPS-v2.1; DiffusionNFT's and AWM's SD3.5-M PickScore runs.
PAPER_REWARDS = {
    "sd35m": "hpsv2",
    "sd35m_grpo": "hpsv2",
    "sd35m_branchgrpo": "hpsv2",
    "sd15_grpo": "hpsv2",
    "flux_branchgrpo": "hpsv2",
    "flux_branchgrpo_mix": "hpsv2",
    "flux_dancegrpo": "hpsv2",
    "flux_mixgrpo": "hpsv2",
    "sd35m_nft": "pickscore",
    "sd35m_awm": "pickscore",
}


@pytest.mark.parametrize("name", sorted(PAPER_REWARDS))
def test_a_papers_config_trains_on_the_papers_reward(name):
    c = importlib.import_module(f"configs.{name}").get_config()
    assert rewards.parse_rewards(c.rewards) == {PAPER_REWARDS[name]: 1.0}
    # the weightless try the model pages give: one flag, no reward folder
    c.rewards = "jpeg_compressibility"
    assert cfg.validate(c, known_rewards=rewards.available_rewards()) == {
        "jpeg_compressibility": 1.0
    }
