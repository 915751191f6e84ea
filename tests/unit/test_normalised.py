"""TreeGRPO's normalised score (r - r_base) / (r_max - r_base), against hand computations."""

import pytest

from tree_grpo_jax.evaluation import normalised
from tree_grpo_jax.rewards import registry


def test_r_max_as_treegrpo_states_it():
    assert normalised.R_MAX == {
        "hpsv2": 1.0,
        "imagereward": 2.0,
        "aesthetic": 10.0,
        "clip_score": 100.0,  # TreeGRPO's 1 on the cosine scale; clip_score is 100 * cosine
    }
    assert set(normalised.R_MAX) <= set(registry.available_rewards())


def test_scores_by_hand():
    rows = [
        {"label": "base", "hpsv2": {"mean": 0.28}, "imagereward": {"mean": 0.5}},
        {"label": "step 100", "hpsv2": {"mean": 0.37}, "imagereward": {"mean": 1.1}},
    ]
    got = normalised.scores(rows, ["hpsv2", "imagereward", "pickscore"])
    assert got["r_max"] == {"hpsv2": 1.0, "imagereward": 2.0, "pickscore": None}
    step = got["rows"]["step 100"]
    assert step["hpsv2"] == pytest.approx(0.09 / 0.72)  # (0.37 - 0.28) / (1 - 0.28)
    assert step["imagereward"] == pytest.approx(0.4)  # (1.1 - 0.5) / (2 - 0.5)
    assert step["pickscore"] is None  # no r_max stated
    text = normalised.table(got, "base")
    assert "| r_max | 1 | 2 | — |" in text
    assert "| step 100 | 0.125 | 0.4 | — |" in text


def test_a_fall_is_negative_and_a_base_at_the_ceiling_has_none():
    assert normalised.score(6.0, 7.0, 10.0) == pytest.approx(-1 / 3)
    assert normalised.score(10.0, 7.0, 10.0) == pytest.approx(1.0)
    assert normalised.score(1.0, 1.0, 1.0) is None
