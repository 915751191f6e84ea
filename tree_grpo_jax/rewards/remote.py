"""Rewards served over HTTP: a scorer that runs elsewhere (a PyTorch model, an object
detector, a vision-language judge) scores a run's images through one small wire format.

    --config.rewards=remote:judge
    --config.reward_options.remote.judge.url=http://127.0.0.1:8000/score

Each reward of the `remote` family is named `remote:<name>` in `rewards` (a weight after a
second colon: `remote:judge:0.5`) and set in `reward_options.remote.<name>` (`settings()`
holds the fields and their defaults). The client POSTs JSON to the server:

    {"images": [{"format": "png", "data": "<base64 PNG>"}
                or {"format": "raw", "shape": [H, W, C], "data": "<base64 uint8 bytes>"}, ...],
     "prompts": ["...", ...], "metadata": [{...} or null, ...]}

(a video reward gets `{"frames": [image, ...]}` per video) and reads

    {"scores": [float, ...], "sub_scores": {"name": [float, ...], ...}}

one score per image, in the order sent (`sub_scores` is optional and logged as the reward's
parts). A batch goes out in requests of `batch_size` images, `in_flight` of them at once,
to the URLs in turn; a request that fails to connect, times out or gets a 5xx, 408 or 429
answer is sent again after `backoff_s`, doubling, `retries` times. An answer that cannot be
scored (another content type, malformed JSON, the wrong number of scores, a non-finite one)
is one sentence naming the server and the field. A redirect is followed only to the same
host; the token read from the environment variable `token_env` goes only to the hosts of
`url`, and no config, log or model card holds it (only the variable's name is set).

With `protocol="chat"` the same client asks a vision-language judge behind an
OpenAI-compatible chat endpoint one question per image and reads its answer (`chat.py`);
the transport and its fault rules are the ones above.

Standard library only (http.client, concurrent.futures); `serve.py` is the reference server.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.client
import io
import itertools
import json
import math
import numbers
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence

import ml_collections
import numpy as np
from PIL import Image

from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.rewards import chat, registry

FAMILY = "remote"
FORMATS = ("png", "raw")
SCHEMES = ("http", "https")
RETRIED_STATUSES = (408, 429)  # and every 5xx
MAX_REDIRECTS = 3
PROBE_TIMEOUT_S = 10.0
PNG_LEVEL = 1  # zlib level of the PNGs sent: fast, and lossless whatever the level
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class RemoteRewardError(registry.RewardUnavailable):
    """A served reward that did not score; one sentence naming the server and the field."""


def settings() -> ml_collections.ConfigDict:
    """One remote reward's settings, `reward_options.remote.<name>`, at their defaults."""
    c = ml_collections.ConfigDict()
    c.url = ""  # http(s)://host:port/path; several, comma-separated, are taken in turn
    c.batch_size = 16  # images per request
    c.in_flight = 2  # requests at once
    c.timeout_s = 60.0  # per request (connecting, and each wait for the answer)
    c.retries = 3  # further tries of a request that failed to connect, timed out or got 5xx
    c.backoff_s = 0.5  # the wait before the first retry, doubled before each next one
    c.score_field = "scores"  # the answer's field holding one score per image
    c.format = "raw"  # how images travel: "raw" (uint8 bytes) or "png"
    c.media = media_kinds.IMAGE  # "image": videos go frame by frame; "video": whole
    c.header = ""  # a header carrying the token, e.g. "Authorization" ("" = none)
    c.token_env = ""  # the environment variable holding the header's value
    # the protocol: "scores" (the wire format above) or "chat" (an OpenAI-compatible chat
    # endpoint asked `question` per image; `chat.py`), whose settings follow
    c.protocol = "scores"
    c.model = ""  # chat: the served model's name
    c.question = ""  # chat: a template; {prompt} and the prompt's metadata fields
    c.score_from = "answer"  # chat: "answer" (yes/no or a number) or "logprobs" (P(yes))
    c.scale = 1.0  # chat: an answer's number is divided by it
    c.max_tokens = 8  # chat: the longest answer
    c.top_logprobs = 5  # chat: the first token's alternatives read by "logprobs"
    return c


FIELDS = tuple(settings().keys())
CHAT_FIELDS = ("model", "question", "score_from", "scale", "max_tokens", "top_logprobs")


def urls_of(text: str) -> list[str]:
    return [u.strip() for u in str(text).split(",") if u.strip()]


def _where(instance: str) -> str:
    return f"reward_options.{FAMILY}.{instance}"


def check_settings(instance: str, s) -> str | None:
    """One sentence for the first bad setting of `reward_options.remote.<instance>`."""
    where = _where(instance)
    if not hasattr(s, "keys"):
        return f"{where} must be a section of settings (url, batch_size, ...)."
    for field in s:
        if field not in FIELDS:
            return (
                f"{where} sets {field!r}, which is not a setting; the settings are: "
                f"{', '.join(FIELDS)}."
            )
    s = {**settings().to_dict(), **dict(s.items())}
    for field in FIELDS:
        default, value = settings()[field], s[field]
        if isinstance(default, str) and not isinstance(value, str):
            return f"{where}.{field} must be a string, got {value!r}."
        if isinstance(default, int) and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral)
        ):
            return f"{where}.{field} must be a whole number, got {value!r}."
        if isinstance(default, float) and (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
        ):
            return f"{where}.{field} must be a finite number, got {value!r}."
    urls = urls_of(s["url"])
    if not urls:
        return f"{where}.url is missing: set --config.{where}.url=http://host:port/path."
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            return f"{where}.url {url!r} is not an http:// or https:// URL with a host."
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            return f"{where}.url {url!r} has a bad port."
    for field in ("batch_size", "in_flight"):
        if s[field] < 1:
            return f"{where}.{field} must be at least 1, got {s[field]}."
    if s["timeout_s"] <= 0:
        return f"{where}.timeout_s must be positive, got {s['timeout_s']}."
    for field in ("retries", "backoff_s"):
        if s[field] < 0:
            return f"{where}.{field} must be >= 0, got {s[field]}."
    if s["format"] not in FORMATS:
        return f"{where}.format must be one of {FORMATS}, got {s['format']!r}."
    if s["media"] not in media_kinds.RANKS:
        return f"{where}.media must be one of {tuple(media_kinds.RANKS)}, got {s['media']!r}."
    if not s["score_field"]:
        return f"{where}.score_field must name the answer's field of scores."
    if bool(s["header"]) != bool(s["token_env"]):
        return (
            f"{where} sets one of header and token_env; set both (the header and the "
            "environment variable holding its value) or neither."
        )
    if s["header"] and not _HEADER_NAME.match(s["header"]):
        return f"{where}.header {s['header']!r} is not a header name."
    if s["protocol"] not in chat.PROTOCOLS:
        return f"{where}.protocol must be one of {chat.PROTOCOLS}, got {s['protocol']!r}."
    if s["protocol"] == "chat":
        return _check_chat(where, s)
    unread = [f for f in CHAT_FIELDS if s[f] != settings()[f]]
    if unread:
        return (
            f"{where} sets {unread[0]!r}, which only protocol 'chat' reads; set "
            f"--config.{where}.protocol=chat or leave it out."
        )
    return None


def _check_chat(where: str, s: dict) -> str | None:
    if not s["model"]:
        return f"{where}.model is missing: set the name the chat server serves its model under."
    sentence = chat.check_question(where, s["question"])
    if sentence:
        return sentence
    if s["score_from"] not in chat.SCORE_FROM:
        return f"{where}.score_from must be one of {chat.SCORE_FROM}, got {s['score_from']!r}."
    if s["scale"] <= 0:
        return f"{where}.scale must be positive, got {s['scale']}."
    for field in ("max_tokens", "top_logprobs"):
        if s[field] < 1:
            return f"{where}.{field} must be at least 1, got {s[field]}."
    if s["media"] != media_kinds.IMAGE:
        return f"{where}.media must be 'image' with protocol 'chat' (one image per question)."
    return None


# ---------------------------------------------------------------------------------------------
# The wire format.


def to_uint8(images) -> np.ndarray:
    """Floats in [0, 1] -> uint8, rounded (as the JPEG rewards round)."""
    images = np.asarray(images, np.float32)
    return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


def encode_image(image: np.ndarray, fmt: str) -> dict:
    """One uint8 image [H, W, C] as the wire carries it."""
    if fmt == "raw":
        data = base64.b64encode(np.ascontiguousarray(image).tobytes()).decode("ascii")
        return {"format": "raw", "shape": list(image.shape), "data": data}
    pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG", compress_level=PNG_LEVEL)
    return {"format": "png", "data": base64.b64encode(buffer.getvalue()).decode("ascii")}


def encode_item(item: np.ndarray, fmt: str) -> dict:
    """An image [H, W, C], or a video [T, H, W, C] as `{"frames": [image, ...]}`."""
    if item.ndim == 4:
        return {"frames": [encode_image(frame, fmt) for frame in item]}
    return encode_image(item, fmt)


def decode_image(entry) -> np.ndarray:
    """A wire image -> uint8 [H, W, C]; ValueError with one sentence for a bad one."""
    if not isinstance(entry, dict) or "data" not in entry:
        raise ValueError("an image must be an object with 'format' and 'data'")
    try:
        data = base64.b64decode(entry["data"], validate=True)
    except (TypeError, ValueError):
        raise ValueError("an image's 'data' is not base64") from None
    if entry.get("format") == "raw":
        shape = entry.get("shape")
        if not (
            isinstance(shape, list)
            and len(shape) == 3
            and all(isinstance(n, int) and n > 0 for n in shape)
        ):
            raise ValueError("a raw image needs 'shape': [H, W, C]")
        if len(data) != math.prod(shape):
            raise ValueError(
                f"a raw image of shape {shape} needs {math.prod(shape)} bytes, got {len(data)}"
            )
        return np.frombuffer(data, np.uint8).reshape(shape)
    if entry.get("format") == "png":
        try:
            image = np.asarray(Image.open(io.BytesIO(data)))
        except OSError:
            raise ValueError("an image's 'data' is not a PNG") from None
        return image[..., None] if image.ndim == 2 else image
    raise ValueError(f"an image's 'format' must be one of {FORMATS}, got {entry.get('format')!r}")


def decode_item(entry) -> np.ndarray:
    """An image [H, W, C] or a video [T, H, W, C] (an object with 'frames')."""
    if isinstance(entry, dict) and "frames" in entry:
        frames = entry["frames"]
        if not isinstance(frames, list) or not frames:
            raise ValueError("a video's 'frames' must be a list of images")
        return np.stack([decode_image(f) for f in frames])
    return decode_image(entry)


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metadata holds a {type(value).__name__}, which JSON cannot carry")


def request_body(images_u8: np.ndarray, prompts, metadata, fmt: str) -> bytes:
    """The JSON of one request."""
    body = {
        "images": [encode_item(item, fmt) for item in images_u8],
        "prompts": list(prompts),
        "metadata": [None if m is None else dict(m) for m in metadata],
    }
    return json.dumps(body, default=_jsonable).encode()


# ---------------------------------------------------------------------------------------------
# The client.


class _Retry(Exception):
    """A failure worth another try (the sentence's middle)."""


class RemoteReward:
    """The scoring function of `remote:<instance>`: (images, prompts, metadata) -> Scores."""

    def __init__(self, instance: str, s):
        s = {**settings().to_dict(), **dict(s.items())}
        self.name = f"{FAMILY}:{instance}"
        self.where = _where(instance)
        self.urls = urls_of(s["url"])
        self.hosts = {_origin(u) for u in self.urls}
        self.chat = s["protocol"] == "chat"
        if self.chat:
            self.urls = [chat.endpoint(u) for u in self.urls]
        self.s = s
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, images, prompts: Sequence[str], metadata=None):
        images = to_uint8(images)
        count = len(images)
        metadata = [None] * count if metadata is None else list(metadata)
        size = 1 if self.chat else self.s["batch_size"]  # a chat request asks of one image
        starts = list(range(0, count, size))
        if not starts:
            return registry.Scores.of(np.zeros(0, np.float32))
        with self._lock:
            first = next(self._turn)
            for _ in starts[1:]:
                next(self._turn)
        jobs = [
            (self.urls[(first + i) % len(self.urls)], slice(a, a + size))
            for i, a in enumerate(starts)
        ]
        workers = min(self.s["in_flight"], len(jobs))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [
                pool.submit(self._score, url, images[part], prompts[part], metadata[part])
                for url, part in jobs
            ]
            answers = [f.result() for f in futures]  # in the order sent
        scores = np.concatenate([a[0] for a in answers])
        names = set.intersection(*(set(a[1]) for a in answers))
        parts = {n: np.concatenate([a[1][n] for a in answers]) for n in sorted(names)}
        return registry.Scores.of(scores, parts)

    def _headers(self, url: str) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.s["header"] and _origin(url) in self.hosts:  # the token goes nowhere else
            token = os.environ.get(self.s["token_env"])
            if token is None:
                raise RemoteRewardError(_missing_token(self.name, self.s["token_env"]))
            headers[self.s["header"]] = token
        return headers

    def _score(self, url: str, images, prompts, metadata):
        if self.chat:
            body = chat.request_body(self.s, images[0], self._ask(prompts[0], metadata[0]))
        else:
            body = request_body(images, prompts, metadata, self.s["format"])
        tries = self.s["retries"] + 1
        for attempt in range(tries):
            try:
                return self._post(url, body, len(images))
            except _Retry as e:
                why = str(e)
            if attempt + 1 < tries:
                time.sleep(self.s["backoff_s"] * 2**attempt)
        raise RemoteRewardError(
            f"remote reward {self.name!r}: the server at {url} failed {tries} time(s), the "
            f"last with {why}; check that it is up and answers within {self.where}.timeout_s "
            f"({self.s['timeout_s']:g}s)."
        )

    def _ask(self, prompt: str, metadata) -> str:
        try:
            return chat.ask(self.s["question"], prompt, metadata)
        except KeyError as e:
            raise RemoteRewardError(
                f"remote reward {self.name!r}: {self.where}.question names {{{e.args[0]}}}, "
                f"which the metadata of the prompt {prompt!r} does not hold."
            ) from None

    def _post(self, url: str, body: bytes, count: int):
        target = url
        for _ in range(MAX_REDIRECTS + 1):
            status, headers, data = self._exchange(target, body)
            if status in (301, 302, 303, 307, 308):
                location = urllib.parse.urljoin(target, headers.get("location", ""))
                if _origin(location) != _origin(target):
                    raise RemoteRewardError(
                        f"remote reward {self.name!r}: the server at {url} redirected to "
                        f"another host ({location}); the client follows no redirect off the "
                        f"hosts named in {self.where}.url."
                    )
                target = location
                continue
            if status >= 500 or status in RETRIED_STATUSES:
                raise _Retry(f"HTTP status {status}{_said(data)}")
            if status != 200:
                raise RemoteRewardError(
                    f"remote reward {self.name!r}: the server at {url} answered HTTP status "
                    f"{status}{_said(data)}."
                )
            return self._parse(url, headers, data, count)
        raise RemoteRewardError(
            f"remote reward {self.name!r}: the server at {url} redirected more than "
            f"{MAX_REDIRECTS} times."
        )

    def _exchange(self, url: str, body: bytes):
        parts = urllib.parse.urlsplit(url)
        kind = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = kind(parts.hostname, parts.port, timeout=self.s["timeout_s"])
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            connection.request("POST", path, body, self._headers(url))
            response = connection.getresponse()
            data = response.read()
            headers = {k.lower(): v for k, v in response.getheaders()}
            return response.status, headers, data
        except TimeoutError:
            raise _Retry(f"no answer within {self.s['timeout_s']:g}s") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Retry(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        finally:
            connection.close()

    def _parse(self, url: str, headers: dict, data: bytes, count: int):
        def bad(what: str) -> RemoteRewardError:
            return RemoteRewardError(f"remote reward {self.name!r}: the server at {url} {what}.")

        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise bad(f"answered with content type {kind or 'none'!r}, not application/json")
        try:
            answer = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"answered malformed JSON ({str(e).split(':')[0]})") from None
        if not isinstance(answer, dict):
            raise bad("answered JSON that is not an object")
        if self.chat:
            return np.asarray([chat.read_score(answer, self.s, bad)], np.float32), {}
        field = self.s["score_field"]
        if field not in answer:
            raise bad(f"answered no {field!r} field")
        scores = _numbers(answer[field], count, f"{field!r}", bad)
        parts = {}
        subs = answer.get("sub_scores")
        if subs is not None:
            if not isinstance(subs, dict):
                raise bad("answered a 'sub_scores' field that is not an object of lists")
            for name, values in subs.items():
                parts[str(name)] = _numbers(values, count, f"'sub_scores.{name}'", bad)
        return scores, parts


def _numbers(values, count: int, field: str, bad) -> np.ndarray:
    if not isinstance(values, list):
        raise bad(f"answered a {field} field that is not a list")
    if len(values) != count:
        raise bad(f"answered {len(values)} value(s) in its {field} field for {count} images sent")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(f"answered {v!r} at position {i} of its {field} field, not a number")
        if not math.isfinite(v):
            raise bad(f"answered a non-finite value ({v}) at position {i} of its {field} field")
    return np.asarray(values, np.float32)


def _said(data: bytes) -> str:
    text = data[:200].decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("error", text))
    text = text.splitlines()[0] if text else ""
    return f" ({text.rstrip('.')})" if text else ""


def _origin(url: str) -> tuple:
    parts = urllib.parse.urlsplit(url)
    default = 443 if parts.scheme == "https" else 80
    return (parts.scheme, (parts.hostname or "").lower(), parts.port or default)


def _missing_token(name: str, variable: str) -> str:
    return (
        f"remote reward {name!r} reads its token from the environment variable {variable}, "
        "which is not set; export it before the run."
    )


def probe(instance: str, s) -> str | None:
    """One sentence when a server of `remote:<instance>` takes no connection (or its token's
    variable is unset), else None; nothing is scored."""
    s = {**settings().to_dict(), **dict(s.items())}
    name = f"{FAMILY}:{instance}"
    if s["token_env"] and os.environ.get(s["token_env"]) is None:
        return _missing_token(name, s["token_env"])
    for url in urls_of(s["url"]):
        _, host, port = _origin(url)
        try:
            socket.create_connection(
                (host, port), timeout=min(s["timeout_s"], PROBE_TIMEOUT_S)
            ).close()
        except OSError as e:
            why = e.strerror or type(e).__name__
            return (
                f"remote reward {name!r}: nothing answers at {url} ({why.lower()}); start its "
                f"server or fix --config.{_where(instance)}.url."
            )
    return None


def register() -> None:
    registry.register_family(
        FAMILY,
        RemoteReward,
        options=settings,
        check_options=check_settings,
        probe=probe,
        on_host=True,
        takes_metadata=True,
        media_of=lambda s: s.get("media", media_kinds.IMAGE),
        describe="url=http://host:port/path",
    )
