"""Prompt sets, prompt files and the resumable, shardable prompt stream."""

import collections

import pytest

from tree_grpo_jax.models.tiny.grammar import DIGIT_PROMPTS
from tree_grpo_jax.run.prompts import ANIMALS, PromptIterator, load_prompts, prompt_sets

PROMPTS = [f"prompt {i}" for i in range(12)]


def test_built_in_sets():
    assert set(prompt_sets()) == {"animals", "simple_animals", "digits"}
    animals = load_prompts("animals")
    assert 40 <= len(animals) <= 50 and len(set(animals)) == len(animals)
    assert "cat" in animals and animals == list(ANIMALS)
    digits = load_prompts("digits")
    assert digits[0] == "a handwritten digit zero" and digits[-1] == "a handwritten digit nine"
    assert len(digits) == 10 and digits == list(DIGIT_PROMPTS)  # the tiny model's prompts
    assert set(load_prompts("simple_animals")) <= set(animals) | {"bird"}
    # Callers get a copy they may change.
    load_prompts("digits").append("x")
    assert len(load_prompts("digits")) == 10


def test_file_strips_and_skips_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("  a red cube \n\n\t\nblue sphere\n   \n")
    assert load_prompts(str(path)) == ["a red cube", "blue sphere"]


def test_empty_file_is_one_sentence(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="has no prompts"):
        load_prompts(str(path))


@pytest.mark.parametrize("source", ["no_such_set", "/no/such/file.txt"])
def test_unknown_source_is_one_sentence(source):
    with pytest.raises(ValueError, match="neither a built-in set .* nor an existing text file"):
        load_prompts(source)


def _draw(iterator, n):
    return [iterator.next_batch() for _ in range(n)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    it = PromptIterator(PROMPTS, batch_size=4, seed=0)
    epoch0 = sum(_draw(it, 3), [])
    epoch1 = sum(_draw(it, 3), [])
    assert sorted(epoch0) == sorted(PROMPTS) == sorted(epoch1)
    assert epoch0 != epoch1 and it.epoch == 2 and it.position == 24


def test_same_seed_same_stream_other_seed_other_stream():
    a = _draw(PromptIterator(PROMPTS, 5, seed=3), 6)
    b = _draw(PromptIterator(PROMPTS, 5, seed=3), 6)
    c = _draw(PromptIterator(PROMPTS, 5, seed=4), 6)
    assert a == b and a != c


def test_resume_from_saved_state_is_exact():
    # Batches of 5 over 12 prompts cross epoch boundaries inside a batch.
    full = PromptIterator(PROMPTS, 5, seed=1)
    expected = _draw(full, 9)

    first = PromptIterator(PROMPTS, 5, seed=1)
    head = _draw(first, 4)
    state = first.state_dict()
    assert state == {"position": 20, "seed": 1, "num_prompts": 12}
    assert all(isinstance(v, int) for v in state.values())

    resumed = PromptIterator(PROMPTS, 5, seed=1)
    resumed.load_state_dict(dict(state))
    assert head + _draw(resumed, 5) == expected
    # The constructor's `position` does the same.
    assert _draw(PromptIterator(PROMPTS, 5, seed=1, position=20), 5) == expected[4:]


def test_resume_with_other_prompts_or_seed_is_refused():
    state = PromptIterator(PROMPTS, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this one has seed=2"):
        PromptIterator(PROMPTS, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptIterator(PROMPTS[:5], 4, seed=1).load_state_dict(state)


def test_shards_are_disjoint_and_cover_the_global_stream():
    shards = [PromptIterator(PROMPTS, 2, seed=5, shard_index=i, num_shards=3) for i in range(3)]
    single = PromptIterator(PROMPTS, 6, seed=5)
    for _ in range(4):  # two epochs
        batches = [s.next_batch() for s in shards]
        flat = sum(batches, [])
        assert len(set(flat)) == len(flat)  # disjoint across hosts
        assert flat == single.next_batch()  # together they are the one-host stream
    assert {s.position for s in shards} == {single.position}
    counts = collections.Counter()
    for s in shards:
        s.position = 0
        counts.update(sum(_draw(s, 2), []))
    assert counts == collections.Counter(PROMPTS)  # one epoch: each prompt exactly once


@pytest.mark.parametrize(
    "kwargs",
    [dict(batch_size=0), dict(shard_index=2, num_shards=2), dict(position=-1), dict(prompts=[])],
)
def test_bad_arguments(kwargs):
    args = dict(prompts=PROMPTS, batch_size=2, seed=0) | kwargs
    with pytest.raises(ValueError):
        PromptIterator(**args)
