"""A run with the program store computes what a run without it does: the first run of a
config traces, exports and stores its programs, the next one runs them stored, and both log
the numbers, bit for bit, of a run that traces them."""

import json

import pytest
from small_configs import small_config

from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run import precompile, program_store


def _numbers(workdir) -> list[dict]:
    """Every row of metrics.jsonl but its timings."""
    with open(workdir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if "time" not in k} for line in f]


@pytest.mark.slow  # three trainings, two of them compiling the exported programs
def test_stored_programs_change_no_number(tmp_path, monkeypatch, capsys):
    c = small_config("treegrpo")
    c.train.iterations = 1
    c.checkpoint.every = 0
    c.log.progress = True
    store = tmp_path / "programs"
    monkeypatch.setattr(program_store, "folder", lambda: store)

    with monkeypatch.context() as off:
        off.setattr(precompile, "stores_programs", lambda trainer: False)
        train.train(c, str(tmp_path / "traced"))
    assert not store.exists()
    capsys.readouterr()

    train.train(c, str(tmp_path / "first"))  # traces, exports and stores them
    first = capsys.readouterr().out
    assert "traced the rollout, the evaluation and the train step in" in first
    assert len(list(store.glob(f"*{program_store.SUFFIX}"))) == 1

    train.train(c, str(tmp_path / "second"))  # runs them stored
    second = capsys.readouterr().out
    assert "lowered the rollout, the evaluation and the train step in" in second
    assert "(traced by an earlier run)" in second and "traced the" not in second

    expected = _numbers(tmp_path / "traced")
    assert len(expected) == 3  # two evaluations and an iteration
    assert _numbers(tmp_path / "first") == expected
    assert _numbers(tmp_path / "second") == expected


def test_a_truncated_store_file_is_one_line_and_traced_again(tmp_path, monkeypatch, capsys):
    c = small_config("treegrpo")
    c.train.iterations = 1
    c.eval.every = 0
    c.checkpoint.every = 0
    store = tmp_path / "programs"
    monkeypatch.setattr(program_store, "folder", lambda: store)
    train.train(c, str(tmp_path / "first"))
    (path,) = store.glob(f"*{program_store.SUFFIX}")
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    capsys.readouterr()

    train.train(c, str(tmp_path / "again"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "stored programs" in line]
    assert len(notes) == 1 and "damaged" in notes[0] and str(path) in notes[0], notes
    assert path.read_bytes() == whole  # written anew, whole
    assert _numbers(tmp_path / "again") == _numbers(tmp_path / "first")
