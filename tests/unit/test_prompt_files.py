"""Prompt files with metadata and categories (.jsonl, .json, .csv, .tsv, .parquet), their
bad input, and the prompt stream carrying each prompt's metadata."""

import json

import pytest

from configs import tiny
from tree_grpo_jax import config as cfg
from tree_grpo_jax.rewards import registry as rewards
from tree_grpo_jax.run.prompts import (
    PromptIterator,
    PromptSet,
    config_prompt_set,
    leaf_metadata,
    load_prompt_set,
    load_prompts,
)

# GenEval's evaluation_metadata.jsonl, in its shape: a prompt, a tag and what the scorer checks.
GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a bench"},
    {
        "tag": "counting",
        "include": [{"class": "cat", "count": 2}],
        "exclude": [{"class": "cat", "count": 3}],
        "prompt": "a photo of two cats",
    },
    {
        "tag": "colors",
        "include": [{"class": "car", "count": 1, "color": "red"}],
        "prompt": "a photo of a red car",
    },
]
PROMPTS = ["a bench", "a photo of two cats", "a photo of a red car"]
TAGS = ["single_object", "counting", "colors"]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(tmp_path, rows=GENEVAL, name="meta.jsonl"):
    return _write(tmp_path / name, "".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_keeps_every_other_field_as_metadata(tmp_path):
    got = load_prompt_set(_jsonl(tmp_path))
    assert got.prompts == tuple(PROMPTS)
    assert got.categories == tuple(TAGS)  # "tag" is found as the category
    expected = [{k: v for k, v in row.items() if k != "prompt"} for row in GENEVAL]
    assert list(got.metadata) == expected
    assert got.metadata[1]["exclude"] == [{"class": "cat", "count": 3}]
    assert load_prompts(_jsonl(tmp_path)) == PROMPTS


def test_json_list_of_objects(tmp_path):
    source = _write(tmp_path / "meta.json", json.dumps(GENEVAL, indent=2))
    assert load_prompt_set(source) == load_prompt_set(_jsonl(tmp_path))


CSV = (
    "Prompts,Category\n"
    "a bench,Simple\n"
    '"a photo of two cats, sleeping",Counting\n'
    "a photo of a red car,Colors\n"
)


def test_csv_and_tsv_columns(tmp_path):
    got = load_prompt_set(_write(tmp_path / "drawbench.csv", CSV))
    assert got.prompts == ("a bench", "a photo of two cats, sleeping", "a photo of a red car")
    assert got.categories == ("Simple", "Counting", "Colors")
    assert got.metadata == (
        {"Category": "Simple"},
        {"Category": "Counting"},
        {"Category": "Colors"},
    )
    # PartiPrompts: a tab-separated table with "Prompt", "Category" and more columns
    tsv = (
        "Prompt\tCategory\tChallenge\tNote\na bench\tOutdoor\tBasic\t\nan owl\tAnimals\tBasic\tx\n"
    )
    parti = load_prompt_set(_write(tmp_path / "parti.tsv", tsv))
    assert parti.prompts == ("a bench", "an owl")
    assert parti.categories == ("Outdoor", "Animals")
    assert parti.metadata[1] == {"Category": "Animals", "Challenge": "Basic", "Note": "x"}


def test_same_prompts_from_every_format_give_the_same_stream(tmp_path):
    txt = _write(tmp_path / "p.txt", "\n".join(PROMPTS) + "\n")
    jsonl = _jsonl(tmp_path)
    rows = "\n".join(f'"{p}"' for p in PROMPTS)
    csv_ = _write(tmp_path / "p.csv", "prompt\n" + rows + "\n")
    tsv = _write(tmp_path / "p.tsv", "prompt\tx\n" + "\n".join(f"{p}\t1" for p in PROMPTS))
    streams = []
    for source in (txt, jsonl, csv_, tsv):
        it = PromptIterator(load_prompts(source), 2, seed=3)
        streams.append([it.next_global_batch() for _ in range(4)])
    assert all(s == streams[0] for s in streams)


def test_named_fields(tmp_path):
    rows = [{"text": "a cube", "style": "anime", "prompt": "ignored"}, {"text": "a ball"}]
    got = load_prompt_set(_jsonl(tmp_path, rows), field="text", category_field="style")
    assert got.prompts == ("a cube", "a ball")
    assert got.categories == ("anime", None)
    assert got.metadata == ({"style": "anime", "prompt": "ignored"}, {})
    csv_ = _write(tmp_path / "hpd.csv", "caption,style\na cube,photo\n")
    assert load_prompt_set(csv_, "caption", "style").categories == ("photo",)
    assert load_prompt_set(csv_, "caption").categories == (None,)  # no auto name here
    blank = _write(tmp_path / "blank.csv", "prompt,category\na,\nb,x\n")
    assert load_prompt_set(blank).categories == (None, "x")  # an empty cell: none


def test_text_files_and_built_in_sets_carry_empty_metadata(tmp_path):
    txt = load_prompt_set(_write(tmp_path / "p.txt", "a\nb\n"))
    assert txt == PromptSet(("a", "b"), ({}, {}), (None, None))
    assert load_prompt_set("digits").metadata == ({},) * 10
    no_suffix = load_prompt_set(_write(tmp_path / "prompts", "a\n"))  # read as text
    assert no_suffix.prompts == ("a",)


def test_cycled_eval_rows():
    s = PromptSet(("a", "b"), ({"i": 0}, {"i": 1}), ("x", "y"))
    assert s.cycled(5) == PromptSet(
        ("a", "b", "a", "b", "a"), ({"i": 0}, {"i": 1}) * 2 + ({"i": 0},), ("x", "y") * 2 + ("x",)
    )


# ---------------------------------------------------------------------------------------------
# Bad input: one sentence each.


def _error(source, *settings):
    with pytest.raises(ValueError) as info:
        load_prompt_set(source, *settings)
    message = str(info.value)
    assert "\n" not in message and message.endswith("."), message
    return message


def test_missing_file():
    message = _error("/no/such/prompts.jsonl")
    assert "neither a built-in set" in message and ".jsonl" in message


@pytest.mark.parametrize("name", ["e.jsonl", "e.json", "e.csv", "e.tsv", "e.txt"])
def test_empty_file(tmp_path, name):
    assert "has no prompts" in _error(_write(tmp_path / name, "\n  \n"))


@pytest.mark.parametrize("name, text", [("e.json", "[]"), ("e.csv", "prompt,category\n\n")])
def test_no_rows(tmp_path, name, text):
    assert "has no prompts" in _error(_write(tmp_path / name, text))


def test_a_row_without_the_prompt_field(tmp_path):
    rows = [GENEVAL[0], {"tag": "counting", "include": []}]
    message = _error(_jsonl(tmp_path, rows))
    assert "line 2 of" in message and "no 'prompt' field" in message
    assert "'tag', 'include'" in message
    blank = _jsonl(tmp_path, [{"prompt": "a"}, {"prompt": "  "}], "blank.jsonl")
    assert "line 2 of" in _error(blank) and "has no prompt" in _error(blank)
    not_text = _write(tmp_path / "n.json", json.dumps([{"prompt": 3}]))
    assert "entry 1 of" in _error(not_text)
    not_object = _write(tmp_path / "o.jsonl", '{"prompt": "a"}\n["b"]\n')
    assert "line 2 of" in _error(not_object) and "not an object" in _error(not_object)
    csv_ = _write(tmp_path / "c.csv", "prompt,category\na,x\n,y\n")
    assert "row 3 of" in _error(csv_)


def test_malformed_json_line_names_its_number(tmp_path):
    source = _write(tmp_path / "bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n')
    message = _error(source)
    assert message.startswith("line 3 of prompt file") and "not valid JSON" in message
    assert "is not valid JSON" in _error(_write(tmp_path / "bad.json", '[{"prompt": }]'))
    assert "not a list" in _error(_write(tmp_path / "d.json", '{"prompt": "a"}'))


def test_table_without_the_named_column_lists_its_columns(tmp_path):
    source = _write(tmp_path / "t.csv", "text,kind\na,b\n")
    message = _error(source)
    assert "no 'prompt' or 'Prompt' or 'prompts' or 'Prompts' column" in message
    assert "(its columns: 'text', 'kind')" in message
    assert "no 'caption' column (its columns: 'text', 'kind')" in _error(source, "caption")
    assert "no 'style' column" in _error(source, "text", "style")
    assert "no 'style' field in any line" in _error(_jsonl(tmp_path), "", "style")


def test_unknown_extension(tmp_path):
    message = _error(_write(tmp_path / "p.xlsx", "a\n"))
    assert "unknown extension '.xlsx'" in message and ".parquet" in message


def test_field_settings_that_conflict(tmp_path):
    assert "both name 'prompt'" in _error(_jsonl(tmp_path), "prompt", "prompt")
    both = _write(tmp_path / "two.csv", "prompt,Prompt\na,b\n")
    message = _error(both)
    assert "several prompt columns 'prompt', 'Prompt'" in message
    assert "--config.prompts.field" in message
    assert load_prompt_set(both, "Prompt").prompts == ("b",)
    tags = _jsonl(tmp_path, [{"prompt": "a", "category": "x", "tag": "y"}], "tags.jsonl")
    assert "several category fields" in _error(tags)
    assert load_prompt_set(tags, "", "tag").categories == ("y",)


@pytest.mark.parametrize("name, sep", [("twice.csv", ","), ("twice.tsv", "\t")])
def test_a_column_named_twice_is_refused_naming_it(tmp_path, name, sep):
    """csv would keep the last of two `prompt` cells of a row without a word."""
    source = _write(tmp_path / name, f"prompt{sep}tag{sep}prompt\na{sep}x{sep}b\n")
    message = _error(source)
    assert f"prompt file {source} has 2 columns named 'prompt' (columns 1 and 3)" in message
    three = _write(tmp_path / f"3{name}", f"prompt{sep}tag{sep}tag{sep}tag\na{sep}x{sep}y{sep}z\n")
    assert "has 3 columns named 'tag' (columns 2, 3 and 4)" in _error(three)
    # columns without a name (a spreadsheet's trailing delimiters) are no collision
    trailing = _write(tmp_path / f"t{name}", f"prompt{sep}tag{sep}{sep}\na{sep}x{sep}{sep}\n")
    assert load_prompt_set(trailing).categories == ("x",)


def test_a_key_given_twice_in_a_json_object_is_refused(tmp_path):
    lines = '{"prompt": "a"}\n{"prompt": "b", "tag": "x", "prompt": "c"}\n'
    message = _error(_write(tmp_path / "twice.jsonl", lines))
    assert message.startswith("line 2 of prompt file") and "the key 'prompt' twice" in message
    nested = _write(tmp_path / "twice.json", '[{"prompt": "a", "meta": {"k": 1, "k": 2}}]')
    assert "has the key 'k' twice in one object" in _error(nested)


@pytest.mark.parametrize("value", [["animals", "cats"], {"kind": "animal"}])
@pytest.mark.parametrize("name", ["c.jsonl", "c.json"])
def test_a_category_that_is_a_list_or_an_object_is_refused(tmp_path, name, value):
    rows = [{"prompt": "a", "category": "x"}, {"prompt": "b", "category": value}]
    text = "".join(json.dumps(r) + "\n" for r in rows) if name.endswith("l") else json.dumps(rows)
    source = _write(tmp_path / name, text)
    message = _error(source)
    unit = "line" if name.endswith("l") else "entry"
    assert message.startswith(f"{unit} 2 of prompt file {source} has a "), message
    assert f"{type(value).__name__} as its category 'category' ({json.dumps(value)!r})" in message
    # with another field named the category, the same value is metadata, kept as it is
    rows = [{**r, "tag": "t"} for r in rows]
    text = "".join(json.dumps(r) + "\n" for r in rows) if name.endswith("l") else json.dumps(rows)
    named = load_prompt_set(_write(tmp_path / name, text), "", "tag")
    assert named.categories == ("t", "t") and named.metadata[1]["category"] == value


def test_config_check_refuses_one_name_for_both():
    config = tiny.get_config()
    config.prompts.field = config.prompts.category_field = "text"
    with pytest.raises(cfg.ConfigError, match="both name 'text'"):
        cfg.validate(config, known_rewards=rewards.available_rewards())


def test_non_utf8_table(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(b"prompt\n\xff\n")
    assert "not UTF-8" in _error(str(path))


def test_parquet(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        source = _write(tmp_path / "p.parquet", "not parquet")
        message = _error(source)
        assert "needs pyarrow" in message and "tree_grpo_jax[parquet]" in message
        return
    table = pa.table({"Prompt": ["a", "b"], "Category": ["x", "y"], "n": [1, 2]})
    pq.write_table(table, tmp_path / "p.parquet")
    got = load_prompt_set(str(tmp_path / "p.parquet"))
    assert got.prompts == ("a", "b") and got.categories == ("x", "y")
    assert got.metadata == ({"Category": "x", "n": 1}, {"Category": "y", "n": 2})


def test_config_prompt_set_reads_the_settings(tmp_path):
    config = tiny.get_config()
    config.prompts.source = _jsonl(tmp_path, [{"text": "a", "k": 1}])
    config.prompts.field = "text"
    assert config_prompt_set(config).metadata == ({"k": 1},)
    config.prompts.eval_source = "digits"
    assert config_prompt_set(config, eval_set=True).prompts[0] == "a handwritten digit zero"


# ---------------------------------------------------------------------------------------------
# The stream carries each prompt's metadata.


def _stream(tmp_path, n=7):
    rows = [{"prompt": f"p{i}", "i": i, "objects": [i] * (i % 3)} for i in range(n)]
    got = load_prompt_set(_jsonl(tmp_path, rows, "s.jsonl"))
    return got


def test_batches_carry_their_prompts_metadata_in_order(tmp_path):
    s = _stream(tmp_path)
    it = PromptIterator(s.prompts, 3, seed=2, metadata=s.metadata)
    for _ in range(5):  # crosses epochs inside a batch
        batch = it.next_global_batch()
        assert [m["i"] for m in batch.metadata] == [int(p[1:]) for p in batch]
        assert all(m["objects"] == [m["i"]] * (m["i"] % 3) for m in batch.metadata)
    # the same prompts without metadata: the same stream, {} each
    plain = PromptIterator(s.prompts, 3, seed=2)
    again = PromptIterator(s.prompts, 3, seed=2, metadata=s.metadata)
    for _ in range(5):
        a, b = plain.next_global_batch(), again.next_global_batch()
        assert list(a) == list(b) and a.metadata == [{}] * 3


def test_resume_gives_the_same_next_batch_and_metadata(tmp_path):
    s = _stream(tmp_path)
    full = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    expected = [full.next_global_batch() for _ in range(6)]
    first = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    for _ in range(4):
        first.next_global_batch()
    state = first.state_dict()
    assert state == {"position": 12, "seed": 4, "num_prompts": 7}  # unchanged
    resumed = PromptIterator(s.prompts, 3, seed=4, metadata=s.metadata)
    resumed.load_state_dict(dict(state))
    for want in expected[4:]:
        got = resumed.next_global_batch()
        assert got == want and got.metadata == want.metadata


def test_shards_carry_their_rows_metadata(tmp_path):
    s = _stream(tmp_path, 8)
    shards = [
        PromptIterator(s.prompts, 2, seed=1, shard_index=i, num_shards=2, metadata=s.metadata)
        for i in range(2)
    ]
    single = PromptIterator(s.prompts, 2, seed=1, num_shards=2, metadata=s.metadata)
    whole = single.next_global_batch()
    parts = [sh.next_batch() for sh in shards]
    assert parts[0] + parts[1] == whole
    assert parts[0].metadata + parts[1].metadata == whole.metadata


def test_leaf_metadata_hook(tmp_path):
    s = _stream(tmp_path, 4)
    batch = PromptIterator(s.prompts, 4, seed=0, metadata=s.metadata).next_global_batch()
    leaves = leaf_metadata(batch, slice(2, 4), repeat=3)  # rows 2-3, three leaves each
    assert leaves == [batch.metadata[2]] * 3 + [batch.metadata[3]] * 3
    assert leaf_metadata(["a", "b"], repeat=2) == [{}] * 4
    with pytest.raises(ValueError):
        PromptIterator(["a", "b"], 1, seed=0, metadata=[{}])
