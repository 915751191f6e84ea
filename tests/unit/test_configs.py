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
    used = [*cfg.parse_rewards(c.rewards), *c.eval.extra_rewards]
    for reward in used:
        if rewards.missing_weights(reward, c.reward_models.get(reward)):
            with pytest.raises(cfg.ConfigError, match=f"reward_models.{reward}=/path"):
                cfg.validate(c, known_rewards=rewards.available_rewards())
            c.reward_models[reward] = f"/models/{reward}"
    weights = cfg.validate(c, known_rewards=rewards.available_rewards())
    assert weights == cfg.parse_rewards(c.rewards)


@pytest.mark.parametrize(
    "field, value", [("edge_normalization", "per_level"), ("branch_normalization", "per_tree")]
)
def test_bad_advantage_normalization_is_one_sentence(field, value):
    c = importlib.import_module("configs.tiny").get_config()
    c.advantage[field] = value
    with pytest.raises(cfg.ConfigError, match=f"advantage.{field} must be one of"):
        cfg.validate(c, known_rewards=rewards.available_rewards())
