"""Diversity against a brute-force loop over sample pairs, and the embedding a run picks."""

import itertools

import numpy as np
import pytest

from tree_grpo_jax.config import base_config
from tree_grpo_jax.evaluation import diversity


def _brute_force(embeddings):
    """Mean over prompts of each prompt's mean distance over its unordered sample pairs."""
    means = []
    for samples in embeddings:
        pairs = itertools.combinations(range(len(samples)), 2)
        means.append(np.mean([np.linalg.norm(samples[i] - samples[j]) for i, j in pairs]))
    return np.asarray(means)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_per_prompt_matches_brute_force(k):
    e = np.random.default_rng(k).normal(size=(4, k, 7)) * 3.0
    np.testing.assert_allclose(diversity.per_prompt(e), _brute_force(e), rtol=1e-10)


def test_collapsed_samples_have_no_diversity():
    one = np.random.default_rng(0).normal(size=(3, 1, 16)) * 100.0
    collapsed = np.repeat(one, 4, axis=1)
    np.testing.assert_allclose(diversity.per_prompt(collapsed), 0.0, atol=1e-5)
    # one sample moved away by a known distance d: 3 of the 6 pairs are d apart
    moved = collapsed.copy()
    moved[:, 0, 0] += 2.0
    np.testing.assert_allclose(diversity.per_prompt(moved), 1.0, rtol=1e-6)


def test_pairwise_distances_match_norms():
    e = np.random.default_rng(1).normal(size=(5, 6))
    expected = np.linalg.norm(e[:, None] - e[None], axis=-1)
    np.testing.assert_allclose(diversity.pairwise_distances(e), expected, atol=1e-6)


def test_sample_major_rows_go_back_to_their_prompts():
    p, k = 3, 2
    rows = [f"prompt {r % p} noise {r // p}" for r in range(p * k)]  # row k * P + p
    grouped = diversity.by_prompt(np.asarray(rows), p, k)
    assert grouped.shape == (p, k)
    assert grouped[2, 1] == "prompt 2 noise 1" and grouped[0, 0] == "prompt 0 noise 0"


def test_rows_are_grouped_by_their_prompts_text():
    """Uneven groups (a prompt repeated in the eval list, another once): each prompt with two
    samples or more against a brute-force pair loop over its rows."""
    rng = np.random.default_rng(4)
    prompts = ["one", "two", "one", "three", "two", "one"]
    e = rng.normal(size=(len(prompts), 3))
    groups = diversity.groups_by_text(prompts)
    assert [list(g) for g in groups] == [[0, 2, 5], [1, 4]]  # "three" has nothing to compare
    expected = []
    for text in ("one", "two"):
        rows = [r for r, p in enumerate(prompts) if p == text]
        pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]
        expected.append(np.mean([np.linalg.norm(e[a] - e[b]) for a, b in pairs]))
    np.testing.assert_allclose(diversity.per_group(e, groups), expected, rtol=1e-12)
    assert diversity.groups_by_text(prompts[:2]) == []
    assert diversity.repeats(prompts) and not diversity.repeats(["one", "two"])


def test_a_groups_value_does_not_depend_on_the_others_in_the_call():
    """The evaluate command measures its prompts in chunks: a prompt's diversity is the same
    whichever prompts share its chunk."""
    e = np.random.default_rng(5).normal(size=(40, 9)) * 7.0
    groups = [np.arange(8 * g, 8 * g + 8) for g in range(5)]
    alone = [diversity.per_group(e, [g])[0] for g in groups]
    np.testing.assert_array_equal(diversity.per_group(e, groups), alone)
    np.testing.assert_allclose(alone, _brute_force(e.reshape(5, 8, 9)), rtol=1e-10)


def test_one_sample_per_prompt_is_refused():
    with pytest.raises(ValueError, match="K >= 2"):
        diversity.per_prompt(np.zeros((3, 1, 4)))


def test_the_embedding_a_run_uses():
    c = base_config()
    c.model.name = "random_tiny"
    _, kind = diversity.make_embed(c)
    assert kind == "features"  # the tiny family brings its classifier's features
    c.model.name = "sd"
    embed, kind = diversity.make_embed(c)
    assert kind == "pixels"
    images = np.random.default_rng(2).uniform(size=(2, 4, 4, 3))
    np.testing.assert_array_equal(embed(images), images.reshape(2, -1).astype(np.float32))


def test_tiny_features_are_the_classifier_hidden_layer():
    """The hidden layer computed by hand from the classifier's weights."""
    from tree_grpo_jax.models.tiny import classifier

    params = classifier.load_classifier()
    images = np.random.default_rng(3).uniform(size=(2, 8, 8, 1)).astype(np.float32)

    def conv(x, p):  # 3x3 SAME convolution, written as a sum over the kernel's taps
        w, b = np.asarray(p["kernel"]), np.asarray(p["bias"])
        padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        out = np.zeros((*x.shape[:3], w.shape[-1]))
        for dy in range(3):
            for dx in range(3):
                out += padded[:, dy : dy + 8, dx : dx + 8] @ w[dy, dx]
        return np.maximum(out + b, 0.0)

    x = conv(conv(images.astype(np.float64), params["Conv_0"]), params["Conv_1"])
    x = x.reshape(2, 4, 2, 4, 2, -1).mean(axis=(2, 4)).reshape(2, -1)
    dense = params["Dense_0"]
    hidden = np.maximum(x @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"]), 0.0)
    np.testing.assert_allclose(classifier.digit_features(images), hidden, rtol=1e-4, atol=1e-4)
