"""The `chat` protocol of the `remote` family: a vision-language judge behind an
OpenAI-compatible chat endpoint (what vLLM and sglang serve) is asked one question per
image, and its answer is read as the score.

    --config.reward_options.remote.judge.protocol=chat
    --config.reward_options.remote.judge.url=http://127.0.0.1:8000
    --config.reward_options.remote.judge.model=Qwen/Qwen2.5-VL-7B-Instruct
    --config.reward_options.remote.judge.question="Does this image show {prompt}? Answer yes or no."

Each image is one request, `POST {url}/v1/chat/completions` (a url whose path is empty; one
ending in `/v1` gets `/chat/completions`; any other path is taken as given):

    {"model": ..., "messages": [{"role": "user", "content": [
        {"type": "text", "text": <the question, its placeholders filled>},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}],
     "max_tokens": ..., "temperature": 0}

plus `"logprobs": true, "top_logprobs": N` when the score is read from them. The question
is a `str.format` template: `{prompt}` is the image's prompt and any other name a field of
its prompt's metadata. `score_from="answer"` reads a leading yes (1) or no (0), else the
first number of `choices[0].message.content` divided by `scale` (a number outside 0 to
`scale` is refused: the question and the scale disagree); `score_from="logprobs"` reads
P(yes) from `choices[0].logprobs.content[0].top_logprobs`, normalised over the yes and no
tokens there (case and surrounding spaces ignored; a yes or no token's NaN is refused).

The transport (retries, timeout, redirects, token, `in_flight`) is `remote.py`'s; this module
builds the request and reads the answer, each fault one sentence through `bad(what)`.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import string
import urllib.parse

import numpy as np
from PIL import Image

from tree_grpo_jax.errors import echo

PROTOCOLS = ("scores", "chat")
SCORE_FROM = ("answer", "logprobs")
ENDPOINT = "/v1/chat/completions"
PNG_LEVEL = 1
CONTENT = "choices[0].message.content"
TOP_LOGPROBS = "choices[0].logprobs.content[0].top_logprobs"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FIRST_WORD = re.compile(r"^\W*([A-Za-z]+)")


def endpoint(url: str) -> str:
    """The chat completions URL of `url`: its path if it names one, else the usual route."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if not path:
        path = ENDPOINT
    elif path.endswith("/v1"):
        path += "/chat/completions"
    else:
        path = parts.path
    return urllib.parse.urlunsplit(parts._replace(path=path))


def placeholders(question: str) -> list[str]:
    """The names of the question's placeholders; ValueError with one clause for a bad one."""
    names = []
    try:
        parsed = list(string.Formatter().parse(question))
    except ValueError as e:
        raise ValueError(
            f"is not a template ({str(e).rstrip('.')}; write {{{{ or }}}} for a literal brace)"
        ) from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(
                f"has the placeholder {{{name}}}; use {{prompt}} or a metadata field's name "
                "(and {{ or }} for a literal brace)"
            )
        names.append(name)
    return names


def check_question(where: str, question: str) -> str | None:
    """One sentence for a question that is not a usable template, else None."""
    if not question.strip():
        return (
            f"{where}.question is missing: set the question the judge answers per image, "
            'e.g. "Does this image show {prompt}? Answer yes or no."'
        )
    try:
        placeholders(question)
    except ValueError as e:
        return f"{where}.question {echo(question)} {e}."
    return None


def ask(question: str, prompt: str, metadata) -> str:
    """The question with `{prompt}` and the metadata's fields filled; KeyError(name) for a
    field the image's metadata lacks. An image without metadata (a prompt from a text file or
    a built-in set) fills the metadata fields with nothing."""
    fields = dict(metadata) if metadata else {}
    if not metadata:
        fields.update({n: "" for n in placeholders(question)})
    fields["prompt"] = prompt
    missing = [n for n in placeholders(question) if n not in fields]
    if missing:
        raise KeyError(missing[0])
    return question.format_map(fields)


def image_url(image: np.ndarray) -> str:
    """One uint8 image [H, W, C] as a PNG data URL."""
    pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG", compress_level=PNG_LEVEL)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def request_body(s: dict, image: np.ndarray, text: str) -> bytes:
    """The JSON of one chat request: the filled question and one image."""
    body = {
        "model": s["model"],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": image_url(image)}},
                ],
            }
        ],
        "max_tokens": s["max_tokens"],
        "temperature": 0,
    }
    if s["score_from"] == "logprobs":
        body.update(logprobs=True, top_logprobs=s["top_logprobs"])
    return json.dumps(body).encode()


def _path(value, steps, bad, field: str):
    """value[steps[0]][steps[1]]...; `bad` names `field` when a step is missing."""
    for step in steps:
        if isinstance(step, int):
            if not isinstance(value, list) or len(value) <= step:
                raise bad(f"answered no {field!r} field")
        elif not isinstance(value, dict) or value.get(step) is None:
            raise bad(f"answered no {field!r} field")
        value = value[step]
    return value


def read_score(answer, s: dict, bad) -> float:
    """The score of one chat answer (parsed JSON) by `s["score_from"]`."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise bad("answered no 'choices' field")
    if not answer["choices"]:
        raise bad("answered an empty 'choices' field")
    if s["score_from"] == "logprobs":
        return _from_logprobs(answer, bad)
    text = _path(answer, ["choices", 0, "message", "content"], bad, CONTENT)
    if not isinstance(text, str):
        raise bad(f"answered a {CONTENT!r} field that is not text")
    word = _FIRST_WORD.match(text)
    if word and word.group(1).lower() in ("yes", "no"):
        return 1.0 if word.group(1).lower() == "yes" else 0.0
    number = _NUMBER.search(text)
    if number is None:
        raise bad(f"answered {_cut(text)!r} in its {CONTENT!r} field: no number and no yes or no")
    value = float(number.group())
    if not math.isfinite(value):
        raise bad(f"answered a non-finite number ({_cut(number.group())}) in its {CONTENT!r} field")
    if not 0 <= value <= s["scale"]:  # the question asks for another range than `scale`
        raise bad(
            f"answered {_cut(number.group())} in its {CONTENT!r} field, outside 0 to "
            f"scale={s['scale']:g}; ask for a number from 0 to {s['scale']:g} or set scale to "
            "the top of the range the judge answers in"
        )
    return value / s["scale"]


def _from_logprobs(answer, bad) -> float:
    tops = _path(
        answer, ["choices", 0, "logprobs", "content", 0, "top_logprobs"], bad, TOP_LOGPROBS
    )
    if not isinstance(tops, list):
        raise bad(f"answered a {TOP_LOGPROBS!r} field that is not a list")
    mass = {"yes": 0.0, "no": 0.0}
    seen = []
    for entry in tops:
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise bad(f"answered an entry of {TOP_LOGPROBS!r} without a 'token'")
        logprob = entry.get("logprob")
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise bad(f"answered an entry of {TOP_LOGPROBS!r} without a numeric 'logprob'")
        token = entry["token"].strip().lower()
        seen.append(entry["token"])
        if token in mass and (math.isnan(logprob) or logprob == math.inf):
            raise bad(
                f"answered the logprob {logprob} for the token {_cut(repr(entry['token']))} "
                f"in its {TOP_LOGPROBS!r} field, not a log-probability"
            )
        if token in mass:
            mass[token] += math.exp(min(logprob, 0.0))
    total = mass["yes"] + mass["no"]
    if total <= 0:
        raise bad(
            f"answered no yes or no token among its {TOP_LOGPROBS!r} field "
            f"(tokens {_cut(repr(seen))}); ask a yes-or-no question or raise top_logprobs"
        )
    return mass["yes"] / total


def _cut(text: str, at: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= at else text[: at - 3] + "..."
