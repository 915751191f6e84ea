"""Rewards served over HTTP through the command line: the tiny run trained and evaluated on
the reference server's jpeg_compressibility (the same scores as the package's own) and on a
tiny PyTorch scorer behind `--callable`; a server down at start is one sentence before
anything is written; a server failing mid-run stops the run with its iterations saved and
the resume command; the token is in no file the run writes, nor a URL's password in any
line; a token a header cannot carry, settings past their bounds, a server that trickles its
answer and a judge answering outside its scale are each one sentence before anything is
written; a VLM judge behind a chat endpoint scores a run through the same family; the
reference server, stopped by SIGTERM or Ctrl-C, answers the request in flight first."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from in_process import one_error_line, run_in_process, run_main
from remote_servers import (
    ROOT,
    json_answer,
    load,
    reference,
    reference_process,
    scripted,
    start_process,
    trickling,
)

from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.rewards import remote
from tree_grpo_jax.rewards.base import RewardUnavailable
from tree_grpo_jax.run import reporting
from tree_grpo_jax.run.checkpoint import Checkpointer

SMALL = (
    "--config=configs/tiny.py",
    "--config.model.name=random_tiny",
    "--config.sampling.num_steps=4",
    "--config.tree.window=2",
    "--config.train.iterations=2",
    "--config.train.rows_per_minibatch=16",
    "--config.prompts.eval_count=4",
    "--config.eval.every=1",
    "--config.checkpoint.every=1",
    "--config.log.tensorboard=False",
)


def _remote(url: str, *extra: str, name: str = "r") -> tuple[str, ...]:
    """SMALL on the remote reward `remote:<name>` at `url`; `extra` replaces SMALL's flags
    of the same fields."""
    given = {e.split("=")[0] for e in extra}
    return (
        *(f for f in SMALL if f.split("=")[0] not in given),
        f"--config.rewards=remote:{name}",
        f"--config.reward_options.remote.{name}.url={url}",
        *extra,
    )


def _every_file(folder) -> str:
    text = []
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as handle:
                text.append(handle.read().decode("latin-1"))
    return "".join(text)


def test_train_and_evaluate_on_the_reference_server(tmp_path, monkeypatch):
    secret = "Bearer not-in-any-file-7d1c"
    monkeypatch.setenv("TEST_REMOTE_TOKEN", secret)
    workdir = tmp_path / "run"
    with reference("--reward=jpeg_compressibility") as url:
        flags = _remote(
            f"{url}/score",
            "--config.reward_options.remote.r.header=Authorization",
            "--config.reward_options.remote.r.token_env=TEST_REMOTE_TOKEN",
            "--config.reward_options.remote.r.batch_size=5",
        )
        result = run_main(*flags, f"--workdir={workdir}")
        assert result.returncode == 0, result.stderr[-3000:]
        from tree_grpo_jax.cli import evaluate

        out = tmp_path / "eval"
        evaluated = run_in_process(evaluate, f"--workdir={workdir}", f"--out={out}")
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    evals = {m["step"]: m for m in reporting.read_metrics(str(workdir)) if "eval/reward_mean" in m}
    assert sorted(evals) == [0, 1, 2]
    assert all(-5 < e["eval/reward_mean"] < 0 for e in evals.values())  # minus the JPEG's kB
    table = json.loads((out / "evaluation.json").read_text())
    assert table["metrics"][0] == "remote:r"
    row = table["rows"][-1]
    assert -5 < row["remote:r"]["mean"] < 0  # scored by the server as the run's were
    with open(workdir / "config.json") as f:
        saved = json.load(f)
    assert saved["reward_options"]["remote"]["r"]["token_env"] == "TEST_REMOTE_TOKEN"
    assert secret not in _every_file(workdir) and secret not in _every_file(out)
    assert secret not in result.stdout + result.stderr


def test_train_on_a_pytorch_scorer_behind_callable(tmp_path):
    with reference_process("--callable=torch_scorer:score") as url:
        assert url.endswith("/score")  # the URL printed is the one a run names
        result = run_main(*_remote(url, "--config.train.iterations=1"), f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    train = [m for m in reporting.read_metrics(str(tmp_path)) if "train/reward_mean" in m]
    assert len(train) == 1 and np.isfinite(train[0]["train/reward_mean"])
    # the server's sub-score is logged as a part of the reward
    assert "train/reward_remote:r/brightness" in train[0]


def test_a_server_down_at_start_is_one_sentence_and_nothing_is_written(tmp_path):
    workdir = tmp_path / "run"
    line = one_error_line(run_main(*_remote("http://127.0.0.1:9/score"), f"--workdir={workdir}"))
    assert line.startswith("error: remote reward 'remote:r': nothing answers at http://127.0.0.1:9")
    assert not workdir.exists()


def test_a_server_failing_mid_run_stops_with_the_iteration_saved(tmp_path):
    """The server answers three batches (and the start's check on blank images), then 500
    on every retry: the run stops (exit 1) with the iterations it trained saved and the
    command that resumes it."""
    answered = []

    def answer(index, body):
        blank = not any(remote.decode_item(item).any() for item in body["images"])
        if not blank and len(answered) < 3:
            answered.append(index)
        if blank or len(answered) < 3 or answered[-1] == index:
            return json_answer({"scores": [0.5] * len(body["images"])})
        return json_answer({"error": "scorer crashed"}, 500)

    with scripted(answer) as (url, _):
        flags = _remote(
            f"{url}/score",
            "--config.reward_options.remote.r.retries=1",
            "--config.reward_options.remote.r.backoff_s=0.01",
            "--config.reward_options.remote.r.batch_size=1024",
            "--config.reward_options.decode_chunks=1",  # one request per batch, as counted
            "--config.train.iterations=4",
            "--config.eval.every=0",
        )
        result = run_main(*flags, f"--workdir={tmp_path}")
    line = one_error_line(result, status=1)
    assert "failed 2 time(s), the last with HTTP status 500 (scorer crashed)" in line
    saved = Checkpointer(str(tmp_path / "checkpoints"), read_only=True).latest_step
    trained = [m for m in reporting.read_metrics(str(tmp_path)) if "train/reward_mean" in m]
    assert saved >= 1 and len(trained) == saved  # every iteration trained is kept
    assert f"To resume from the checkpoint after iteration {saved}:" in line
    assert f"--workdir={tmp_path}" in line


def test_each_images_prompt_metadata_reaches_the_server_in_training_and_evaluation(tmp_path):
    """A GenEval-like prompt file: every image the server scores comes with its own prompt's
    metadata, unchanged, in training (each leaf of a prompt's tree), in evaluation and in the
    start's check of every prompt on blank images."""
    words = ["zero", "one", "two", "three"]
    source = tmp_path / "prompts.jsonl"
    with open(source, "w") as f:
        for i, word in enumerate(words):
            meta = {"tag": "counting", "include": [{"class": word, "count": i}]}
            f.write(json.dumps({"prompt": f"a handwritten digit {word}", **meta}) + "\n")
    expected = {
        f"a handwritten digit {w}": {"tag": "counting", "include": [{"class": w, "count": i}]}
        for i, w in enumerate(words)
    }

    def answer(index, body):
        return json_answer({"scores": [0.5] * len(body["images"])})

    with scripted(answer) as (url, record):
        flags = _remote(
            url,
            f"--config.prompts.source={source}",
            "--config.prompts.eval_source=",
            "--config.train.iterations=1",
        )
        result = run_main(*flags, f"--workdir={tmp_path / 'run'}")
        assert result.returncode == 0, result.stderr[-3000:]
        trained = len(record.requests)
        from tree_grpo_jax.cli import evaluate  # the command's chunks carry it too

        evaluated = run_in_process(
            evaluate, f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'eval'}"
        )
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert len(record.requests) > trained
    # the start's check on blank images carries each prompt's metadata too
    blanks = [
        body
        for _, _, body in record.requests
        if not any(remote.decode_item(item).any() for item in body["images"])
    ]
    assert blanks and {p for b in blanks for p in b["prompts"]} == set(expected)
    images = 0
    for _, _, body in record.requests:
        assert len(body["metadata"]) == len(body["prompts"]) == len(body["images"])
        for prompt, meta in zip(body["prompts"], body["metadata"]):
            assert meta == expected[prompt], (prompt, meta)
            images += 1
    # the training batch's leaves (2 prompts x 4 leaves), the run's two evaluations of 4
    # prompts, the command's base and checkpoint
    assert images >= 2 * 4 + 2 * 4 + 2 * 4


def test_train_on_a_vlm_judge_behind_a_chat_endpoint(tmp_path):
    """`protocol=chat`: a stub OpenAI-compatible server answers every question with the
    first token's log-probabilities of yes (0.6) and no (0.2), so every image scores
    0.6 / (0.6 + 0.2) = 0.75; each request carries one image and the question with its
    prompt."""

    def answer(index, body):
        top = [
            {"token": "Yes", "logprob": math.log(0.6)},
            {"token": " no", "logprob": math.log(0.2)},
            {"token": "The", "logprob": math.log(0.1)},
        ]
        logprobs = {"content": [{"token": "Yes", "logprob": math.log(0.6), "top_logprobs": top}]}
        choice = {"message": {"role": "assistant", "content": "Yes"}, "logprobs": logprobs}
        return json_answer({"choices": [choice]})

    judge = "--config.reward_options.remote.judge"
    with scripted(answer) as (url, record):
        flags = _remote(
            url,
            f"{judge}.protocol=chat",
            f"{judge}.model=judge-model",
            f"{judge}.question=Does this image show {{prompt}}? Answer yes or no.",
            f"{judge}.score_from=logprobs",
            f"{judge}.in_flight=4",
            "--config.train.iterations=1",
            "--config.eval.every=0",
            name="judge",
        )
        result = run_main(*flags, f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    train = [m for m in reporting.read_metrics(str(tmp_path)) if "train/reward_mean" in m]
    assert len(train) == 1
    np.testing.assert_allclose(train[0]["train/reward_mean"], 0.75, rtol=1e-5)
    assert record.requests and all(path == "/v1/chat/completions" for path, _, _ in record.requests)
    for _, _, body in record.requests:
        text, image = body["messages"][0]["content"]
        asked = re.fullmatch(r"Does this image show (.+)\? Answer yes or no\.", text["text"])
        assert asked and asked.group(1).strip(), text["text"]  # the prompt filled in
        assert image["image_url"]["url"].startswith("data:image/png;base64,")
        assert body["model"] == "judge-model" and body["top_logprobs"] == 5


# ---------------------------------------------------------------------------------------------
# Bad input at the start: one sentence, nothing written, no secret.


@pytest.mark.parametrize("ending", ["\n", "\r\n"], ids=["LF", "CRLF"])
def test_a_token_ending_in_a_line_break_is_one_sentence_naming_its_variable(
    tmp_path, monkeypatch, ending
):
    secret = "Bearer tok-5e1b9"
    monkeypatch.setenv("TEST_REMOTE_TOKEN", secret + ending)
    workdir = tmp_path / "run"
    flags = _remote(
        "http://127.0.0.1:9/score",
        "--config.reward_options.remote.r.header=Authorization",
        "--config.reward_options.remote.r.token_env=TEST_REMOTE_TOKEN",
    )
    result = run_main(*flags, f"--workdir={workdir}")
    line = one_error_line(result)
    assert "the value of the environment variable TEST_REMOTE_TOKEN ends with a line break" in line
    assert "prompts.source" not in line
    assert "tok-5e1b9" not in result.stdout + result.stderr
    assert not workdir.exists()


@pytest.fixture
def failing_reward():
    """A reward raising a ValueError that has nothing to do with its prompts."""
    name = "failing_for_test"

    def fn(images, prompts):
        raise ValueError("index 7 is out of bounds for axis 0 with size 4")

    reward_registry.register(name, fn, True)
    yield name
    reward_registry.unregister(name)


def test_a_rewards_own_error_at_the_start_is_the_rewards_not_the_prompts(tmp_path, failing_reward):
    workdir = tmp_path / "run"
    flags = (*SMALL, f"--config.rewards={failing_reward}")
    line = one_error_line(run_main(*flags, f"--workdir={workdir}"))
    assert line == (
        f"error: reward {failing_reward!r} failed when the start's check scored it on blank "
        "images (ValueError: index 7 is out of bounds for axis 0 with size 4)."
    )
    assert not workdir.exists()


@pytest.mark.parametrize(
    "flag, said",
    [
        ("timeout_s=1e300", "timeout_s must be in (0, 3600] (seconds for one whole request)"),
        ("backoff_s=1e300", "backoff_s must be in [0, 600] (seconds), got 1e+300."),
        ("retries=1000000", "retries must be in [0, 20] (further tries), got 1000000."),
        ("timeout_s=nan", "timeout_s must be a finite number, got nan."),
    ],
)
def test_settings_past_their_bounds_are_one_sentence_and_nothing_is_written(tmp_path, flag, said):
    workdir = tmp_path / "run"
    flags = _remote("http://127.0.0.1:9/score", f"--config.reward_options.remote.r.{flag}")
    line = one_error_line(run_main(*flags, f"--workdir={workdir}"))
    assert said in line and len(line) < 200, line
    assert not workdir.exists()


def test_a_urls_password_is_in_no_line_and_no_file(tmp_path):
    """Refused in one sentence that shows the URL without it; the flag's other sentences
    (a field given twice) and --print_config hide it too."""
    password = "pw-9d2e41"
    url = f"http://bob:{password}@127.0.0.1:9/score"
    workdir = tmp_path / "run"
    refused = run_main(*_remote(url), f"--workdir={workdir}")
    line = one_error_line(refused)
    assert "url 'http://***@127.0.0.1:9/score' carries a user name or password" in line
    twice = run_main(*_remote(url), f"--config.reward_options.remote.r.url={url}")
    assert "http://***@127.0.0.1:9/score" in one_error_line(twice)
    printed = run_main(*_remote(url), "--print_config")
    assert printed.returncode == 0 and "url: 'http://***@127.0.0.1:9/score'" in printed.stdout
    for result in (refused, twice, printed):
        assert password not in result.stdout + result.stderr
    assert not workdir.exists()


def test_a_trickling_server_is_cut_off_at_the_start_within_timeout_s(tmp_path):
    """Headers, then a byte every 0.05 s: the start's check gives up 0.5 s after the
    request began (no retry), where a timeout per read would wait as long as it trickles."""
    workdir = tmp_path / "run"
    with trickling(0.05) as (url, lasted):
        flags = _remote(
            url,
            "--config.reward_options.remote.r.timeout_s=0.5",
            "--config.reward_options.remote.r.retries=0",
        )
        line = one_error_line(run_main(*flags, f"--workdir={workdir}"))
        deadline = time.monotonic() + 2
        while not lasted and time.monotonic() < deadline:
            time.sleep(0.02)  # the server's side notices at its next write
    assert "failed 1 time(s), the last with no full answer within 0.5s" in line, line
    assert len(lasted) == 1 and lasted[0] < 0.5 + 0.3, lasted
    assert not workdir.exists()


def test_a_judge_answering_above_its_scale_is_one_sentence(tmp_path):
    def answer(index, body):
        return json_answer({"choices": [{"message": {"role": "assistant", "content": "15"}}]})

    judge = "--config.reward_options.remote.judge"
    workdir = tmp_path / "run"
    with scripted(answer) as (url, _):
        flags = _remote(
            url,
            f"{judge}.protocol=chat",
            f"{judge}.model=judge-model",
            f"{judge}.question=Rate from 0 to 10 how well this shows {{prompt}}.",
            f"{judge}.scale=10",
            name="judge",
        )
        line = one_error_line(run_main(*flags, f"--workdir={workdir}"))
    assert "answered 15 in its 'choices[0].message.content' field, outside 0 to scale=10" in line
    assert not workdir.exists()


# ---------------------------------------------------------------------------------------------
# The reference server stopped by a signal.


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, sleep_s, grace, said",
    [
        ("SIGTERM", 0.0, [], "SIGTERM received: the reward server stopped (no request was in "),
        ("SIGTERM", 1.0, [], "SIGTERM received: the reward server answered the 1 request(s) in "),
        ("SIGINT", 1.0, [], "SIGINT received: the reward server answered the 1 request(s) in "),
        (
            "SIGTERM",
            30.0,
            ["--grace_s=0.5"],
            "SIGTERM received: the reward server stopped after --grace_s=0.5s with 1 of 1 ",
        ),
    ],
)
def test_a_signal_lets_the_request_in_flight_finish_then_one_line(
    tmp_path, name, sleep_s, grace, said
):
    """A scorer that marks its start and sleeps: the signal comes while it works (or while
    nothing is asked); the client gets its scores (unless the grace runs out), the server
    one line on stdout and exit 0."""
    (tmp_path / "slow_scorer_for_test.py").write_text(
        "import pathlib, time\n"
        "def score(images, prompts, metadata):\n"
        f"    pathlib.Path({str(tmp_path / 'started')!r}).touch()\n"
        f"    time.sleep({sleep_s})\n"
        "    return [0.5] * len(images)\n"
    )
    process, url = start_process(
        "--callable=slow_scorer_for_test:score", *grace, path=str(tmp_path)
    )
    assert url.endswith("/score")
    got = {}

    def ask():
        try:
            got["scores"] = load(url, retries=0)(np.zeros((2, 8, 8, 3), np.float32), ["a", "b"])
        except RewardUnavailable as e:
            got["error"] = str(e)

    client = threading.Thread(target=ask)
    if sleep_s:
        client.start()
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    started = time.monotonic()
    process.send_signal(getattr(signal, name))
    out, err = process.communicate(timeout=60)
    if sleep_s:
        client.join(60)
    assert process.returncode == 0, err
    assert out.startswith(said) and out.count("\n") == 1, (out, err)
    assert err == "tree_grpo_jax.rewards.serve: starting...\n", err  # no other line
    if grace:
        assert time.monotonic() - started < 5  # the grace, not the scorer's 30 s
        assert "RemoteDisconnected" in got["error"]
    elif sleep_s:
        np.testing.assert_array_equal(got["scores"], [0.5, 0.5])


@pytest.mark.slow
def test_a_signal_while_the_server_starts_is_one_line():
    process = subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.rewards.serve", "--reward=jpeg_compressibility"],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr.readline().endswith("starting...\n")  # then loading for seconds
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 143 and out == ""
    assert err == (
        "error: SIGTERM stopped python -m tree_grpo_jax.rewards.serve while it was starting; "
        "nothing was served.\n"
    )
