"""The remote rewards' `chat` protocol against a stub chat server on 127.0.0.1: one request
per image, as an OpenAI-compatible server expects it, with the question filled from the
prompt and its metadata; the score read from a number, a yes or no, or the first token's
yes/no log-probabilities (normalised); every malformed answer (a number outside 0 to
`scale`, a NaN log-probability among them) one sentence naming the server and the field; the
scores in image order with requests in flight; the settings checked at config time in one
sentence each."""

import base64
import io
import math
import time

import ml_collections
import numpy as np
import pytest
from PIL import Image
from remote_servers import json_answer, load, scripted

from tree_grpo_jax import config as cfg
from tree_grpo_jax import rewards
from tree_grpo_jax.rewards import chat, remote
from tree_grpo_jax.rewards.base import RewardUnavailable

IMAGES = np.random.default_rng(1).uniform(size=(5, 16, 16, 3)).astype(np.float32)
PROMPTS = [f"p{i}" for i in range(5)]
QUESTION = "Does this image show {prompt}? Answer yes or no."


def _judge(url: str, **fields):
    fields = {"protocol": "chat", "model": "judge-model", "question": QUESTION, **fields}
    return load(url, **fields)


def _said(text: str):
    """A chat answer whose message is `text`."""
    return json_answer(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    )


def _tops(*pairs):
    """A chat answer whose first token's top_logprobs are (token, probability) pairs."""
    top = [{"token": t, "logprob": math.log(p)} for t, p in pairs]
    content = [{"token": pairs[0][0], "logprob": math.log(pairs[0][1]), "top_logprobs": top}]
    message = {"role": "assistant", "content": pairs[0][0]}
    return json_answer({"choices": [{"message": message, "logprobs": {"content": content}}]})


def test_the_request_is_a_chat_completion_with_the_question_and_the_image():
    with scripted(lambda i, b: _said("yes")) as (url, record):
        scores = _judge(url, max_tokens=3)(IMAGES[:1], ["a red cube"])
    np.testing.assert_array_equal(scores, [1.0])
    ((path, headers, body),) = record.requests
    assert path == "/v1/chat/completions" and headers["Content-Type"] == "application/json"
    assert body["model"] == "judge-model" and body["max_tokens"] == 3
    assert body["temperature"] == 0 and "logprobs" not in body
    (message,) = body["messages"]
    assert message["role"] == "user"
    text, image = message["content"]
    assert text == {"type": "text", "text": "Does this image show a red cube? Answer yes or no."}
    assert image["type"] == "image_url"
    head, data = image["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64"
    sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))))
    np.testing.assert_array_equal(sent, remote.to_uint8(IMAGES[0]))  # lossless


@pytest.mark.parametrize(
    "url, path",
    [("", "/v1/chat/completions"), ("/v1", "/v1/chat/completions"), ("/judge", "/judge")],
)
def test_the_endpoint_is_the_usual_route_or_the_path_given(url, path):
    with scripted(lambda i, b: _said("no")) as (base, record):
        _judge(base + url)(IMAGES[:1], PROMPTS[:1])
    assert record.requests[0][0] == path


@pytest.mark.parametrize(
    "text, scale, score",
    [
        ("0.7", 1.0, 0.7),
        ("Score: 7/10", 10.0, 0.7),
        ("I would rate it 8.5 out of 10.", 10.0, 0.85),
        ("10", 10.0, 1.0),
        ("0", 10.0, 0.0),
        ("Yes.", 10.0, 1.0),  # yes and no are 1 and 0, whatever the scale
        (" no, there are 3 cats", 1.0, 0.0),
        ("YES", 1.0, 1.0),
    ],
)
def test_the_answer_is_read_as_a_number_or_yes_or_no(text, scale, score):
    with scripted(lambda i, b: _said(text)) as (url, _):
        result = _judge(url, scale=scale)(IMAGES[:1], PROMPTS[:1])
    np.testing.assert_allclose(result, [score], rtol=1e-6)


@pytest.mark.parametrize(
    "pairs, score",
    [
        ((("Yes", 0.6), ("No", 0.2), ("The", 0.1)), 0.6 / 0.8),
        # case and leading space ignored, every spelling of yes and of no summed
        (((" yes", 0.5), ("Yes", 0.2), ("no", 0.1), (" NO", 0.1)), 0.7 / 0.9),
        ((("no", 0.9), ("maybe", 0.05)), 0.0),
    ],
)
def test_logprobs_give_p_yes_normalised_over_yes_and_no(pairs, score):
    with scripted(lambda i, b: _tops(*pairs)) as (url, record):
        result = _judge(url, score_from="logprobs", top_logprobs=4)(IMAGES[:1], PROMPTS[:1])
    np.testing.assert_allclose(result, [score], rtol=1e-6)
    body = record.requests[0][2]
    assert body["logprobs"] is True and body["top_logprobs"] == 4


def test_the_question_takes_the_prompts_metadata():
    question = "Are there exactly {count} {class_name}s ({tag})? The prompt: {prompt}."
    metadata = [{"tag": "counting", "count": 2, "class_name": "cat"}, None]
    with scripted(lambda i, b: _said("yes")) as (url, record):
        _judge(url, question=question)(IMAGES[:2], ["two cats", "plain"], metadata)
    texts = sorted(r[2]["messages"][0]["content"][0]["text"] for r in record.requests)
    # an image without metadata (a plain prompt, the start's check) fills them with nothing
    assert texts == [
        "Are there exactly  s ()? The prompt: plain.",
        "Are there exactly 2 cats (counting)? The prompt: two cats.",
    ]
    with (
        scripted(lambda i, b: _said("yes")) as (url, _),
        pytest.raises(RewardUnavailable) as info,
    ):
        _judge(url, question=question)(IMAGES[:1], ["x"], [{"tag": "t", "count": 1}])
    assert str(info.value) == (
        "remote reward 'remote:r': reward_options.remote.r.question names {class_name}, "
        "which the metadata of the prompt 'x' does not hold."
    )


def test_scores_keep_the_image_order_with_requests_in_flight():
    """Each image is its own request; the earlier ones answer last."""

    def answer(index, body):
        number = int(body["messages"][0]["content"][0]["text"].split("p")[-1].split("?")[0])
        time.sleep(0.05 * (5 - number))
        return _said(f"{number}")

    with scripted(answer) as (url, record):
        scores = _judge(url, in_flight=5, scale=4.0)(IMAGES, PROMPTS)
    np.testing.assert_array_equal(scores, np.arange(5, dtype=np.float32) / 4)
    assert len(record.requests) == 5


def test_a_server_error_is_retried_as_for_the_scores_protocol():
    def answer(index, body):
        return json_answer({"error": "busy"}, 503) if index == 0 else _said("no")

    with scripted(answer) as (url, record):
        np.testing.assert_array_equal(_judge(url, backoff_s=0.01)(IMAGES[:1], PROMPTS[:1]), [0])
    assert len(record.requests) == 2


@pytest.mark.parametrize(
    "answer, score_from, said",
    [
        (json_answer({"id": "x"}), "answer", "answered no 'choices' field"),
        (json_answer({"choices": []}), "answer", "answered an empty 'choices' field"),
        (
            json_answer({"choices": [{"message": {"content": None}}]}),
            "answer",
            r"answered no 'choices\[0\].message.content' field",
        ),
        (
            _said("a lovely picture"),
            "answer",
            r"answered 'a lovely picture' in its 'choices\[0\].message.content' field: no "
            "number and no yes or no",
        ),
        (
            _said("yes"),  # logprobs asked for, none answered
            "logprobs",
            r"answered no 'choices\[0\].logprobs.content\[0\].top_logprobs' field",
        ),
        (
            _tops(("The", 0.5), ("A", 0.2)),
            "logprobs",
            r"answered no yes or no token among its 'choices\[0\].logprobs.content\[0\]"
            r".top_logprobs' field \(tokens \['The', 'A'\]\)",
        ),
        (json_answer({"choices": [{}]}, kind="text/plain"), "answer", "content type"),
        (
            _said("15"),  # scale=10 below
            "answer",
            r"answered 15 in its 'choices\[0\].message.content' field, outside 0 to scale=10; ask "
            "for a number from 0 to 10 or set scale to the top of the range the judge answers in",
        ),
        (_said("Score: -1"), "answer", "answered -1 in its .* field, outside 0 to scale=10"),
        (
            _said("9" * 300),
            "answer",
            r"answered 9{77}\.\.\. in its .* field, outside 0 to scale=10",
        ),
        (
            _tops(("Yes", float("nan")), ("No", 0.2)),
            "logprobs",
            r"answered the logprob nan for the token 'Yes' in its 'choices\[0\].logprobs"
            r".content\[0\].top_logprobs' field, not a log-probability",
        ),
    ],
)
def test_a_malformed_answer_is_one_sentence_naming_the_server_and_field(answer, score_from, said):
    with (
        scripted(lambda i, b: answer) as (url, record),
        pytest.raises(RewardUnavailable, match=said) as info,
    ):
        _judge(url, score_from=score_from, scale=10.0)(IMAGES[:1], PROMPTS[:1])
    message = str(info.value)
    assert message.startswith(f"remote reward 'remote:r': the server at {url}/v1/chat/")
    assert "\n" not in message
    assert len(record.requests) == 1  # not retried: the server would answer the same


def test_endpoint_and_placeholders():
    assert chat.endpoint("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat.endpoint("https://h/api/v1/") == "https://h/api/v1/chat/completions"
    assert chat.endpoint("http://h/x?y=1") == "http://h/x?y=1"
    assert chat.placeholders("{prompt} {{literal}} {tag!r:>4}") == ["prompt", "tag"]


# ---------------------------------------------------------------------------------------------
# The config.


def _config(**fields):
    c = cfg.base_config()
    c.rewards = "remote:judge"
    section = {
        **remote.settings().to_dict(),
        "url": "http://127.0.0.1:8000",
        "protocol": "chat",
        "model": "m",
        "question": QUESTION,
        **fields,
    }
    c.reward_options.remote = ml_collections.ConfigDict({"judge": section})
    return c


def test_a_chat_judge_config_passes():
    assert cfg.validate(_config(), rewards.available_rewards()) == {"remote:judge": 1.0}
    assert cfg.validate(_config(score_from="logprobs"), rewards.available_rewards())


def test_a_chat_setting_without_the_chat_protocol_is_one_sentence():
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(_config(protocol="scores"), rewards.available_rewards())
    assert str(info.value) == (
        "reward_options.remote.judge sets 'model', which only protocol 'chat' reads; set "
        "--config.reward_options.remote.judge.protocol=chat or leave it out."
    )


@pytest.mark.parametrize(
    "fields, said",
    [
        (dict(protocol="grpc"), "protocol must be one of scores, chat, got 'grpc'"),
        (dict(model=""), "reward_options.remote.judge.model is missing"),
        (dict(question=""), "reward_options.remote.judge.question is missing"),
        (dict(question="Is it {0}?"), "has the placeholder {0}; use {prompt}"),
        (dict(question="Is it {}?"), "has the placeholder {}; use {prompt}"),
        (dict(question="Is it {prompt.upper}?"), "has the placeholder {prompt.upper}"),
        (
            dict(question="Is it {prompt?"),
            "question 'Is it {prompt?' is not a template (expected '}' before end of string; write "
            "{{ or }} for a literal brace).",
        ),
        (dict(question="Is it }?"), "is not a template (Single '}' encountered in format string"),
        (dict(score_from="tokens"), "score_from must be one of answer, logprobs, got 'tokens'"),
        (dict(scale=0.0), "scale must be positive, got 0.0"),
        (dict(scale=float("inf")), "scale must be a finite number, got inf"),
        (dict(question="{" * 4999), "question '{{{{{"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(top_logprobs=0), "top_logprobs must be at least 1"),
        (dict(media="video"), "media must be 'image' with protocol 'chat'"),
    ],
)
def test_a_bad_chat_setting_is_one_sentence(fields, said):
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate(_config(**fields), rewards.available_rewards())
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert len(str(info.value)) < 400  # a value quoted is cut short
