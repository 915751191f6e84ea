"""Rewards served over HTTP: a scorer that runs elsewhere (a PyTorch model, an object
detector, a vision-language judge) scores a run's images through one small wire format.

    --config.rewards=remote:judge
    --config.reward_options.remote.judge.url=http://127.0.0.1:8000/score

Each reward of the `remote` family is named `remote:<name>` in `rewards` (a weight after a
second colon: `remote:judge:0.5`) and set in `reward_options.remote.<name>`
(`remote_settings.py` holds the fields, their defaults and their checks). The client POSTs
JSON to the server:

    {"images": [{"format": "png", "data": "<base64 PNG>"}
                or {"format": "raw", "shape": [H, W, C], "data": "<base64 uint8 bytes>"}, ...],
     "prompts": ["...", ...], "metadata": [{...} or null, ...],
     "input_images": [[image, ...], ...]}

(a video reward gets `{"frames": [image, ...]}` per video; `input_images`, each image's
prompt's input images in the same encoding, only when `input_images` is set: an older
server never sees the field) and reads

    {"scores": [float, ...], "sub_scores": {"name": [float, ...], ...}}

one score per image, in the order sent (`sub_scores` is optional and logged as the reward's
parts). A batch goes out in requests of `batch_size` images, `in_flight` of them at once,
to the URLs in turn. `timeout_s` is a deadline for a whole request (connecting, sending,
and the answer to its last byte, redirects included): a server that trickles its answer is
cut off there. A request that fails to connect, passes its deadline or gets a 5xx, 408 or
429 answer is sent again after `backoff_s`, doubling (at most MAX_BACKOFF_S), `retries`
times; a `Retry-After` the server sends lengthens that wait, up to `timeout_s`. An answer
that cannot be scored (another content type, malformed JSON, the wrong number of scores, a
non-finite one) is one sentence naming the server and the field. A redirect is followed only
to the same host; the token read from the environment variable `token_env` goes only to the
hosts of `url`, and no config, log or model card holds it (only the variable's name is set).
A URL carrying a user name or password is refused (it would be written into config.json and
the printed commands): credentials go in the header.

With `protocol="chat"` the same client asks a vision-language judge behind an
OpenAI-compatible chat endpoint one question per image and reads its answer (`chat.py`);
the transport and its fault rules are the ones above.

Standard library only (http.client, concurrent.futures); `serve.py` is the reference server.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import email.utils
import http.client
import io
import itertools
import json
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence

import numpy as np
from PIL import Image

from tree_grpo_jax.errors import echo
from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.rewards import base, chat, registry
from tree_grpo_jax.rewards.remote_settings import (  # noqa: F401 - re-exported
    CHAT_FIELDS,
    FIELDS,
    FORMATS,
    MAX_BACKOFF_S,
    MAX_IN_FLIGHT,
    MAX_RETRIES,
    MAX_TIMEOUT_S,
    SCHEMES,
    check_settings,
    redacted,
    settings,
    shown,
    urls_of,
    where_of,
)

FAMILY = "remote"
RETRIED_STATUSES = (408, 429)  # and every 5xx
MAX_REDIRECTS = 3
PROBE_TIMEOUT_S = 10.0
PNG_LEVEL = 1  # zlib level of the PNGs sent: fast, and lossless whatever the level
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # what a header value cannot carry


class RemoteRewardError(base.RewardUnavailable):
    """A served reward that did not score; one sentence naming the server and the field."""


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


def request_body(images_u8: np.ndarray, prompts, metadata, fmt: str, inputs=None) -> bytes:
    """The JSON of one request; `inputs` (one list of uint8 [H, W, 3] per image, or None)
    goes as `input_images` only when given."""
    body = {
        "images": [encode_item(item, fmt) for item in images_u8],
        "prompts": list(prompts),
        "metadata": [None if m is None else dict(m) for m in metadata],
    }
    if inputs is not None:
        body["input_images"] = [[encode_image(image, fmt) for image in row] for row in inputs]
    return json.dumps(body, default=_jsonable).encode()


# ---------------------------------------------------------------------------------------------
# The client.


class _Retry(Exception):
    """A failure worth another try (the sentence's middle); `wait`: the seconds the server
    asked for (its Retry-After), if it did."""

    def __init__(self, why: str, wait: float | None = None):
        super().__init__(why)
        self.wait = wait


class RemoteReward:
    """The scoring function of `remote:<instance>`: (images, prompts, metadata) -> Scores."""

    def __init__(self, instance: str, s):
        s = {**settings().to_dict(), **dict(s.items())}
        self.name = f"{FAMILY}:{instance}"
        self.where = where_of(instance)
        self.urls = urls_of(s["url"])
        self.hosts = {_origin(u) for u in self.urls}
        self.chat = s["protocol"] == "chat"
        if self.chat:
            self.urls = [chat.endpoint(u) for u in self.urls]
        self.s = s
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, images, prompts: Sequence[str], metadata=None, input_images=None):
        images = to_uint8(images)
        count = len(images)
        metadata = [None] * count if metadata is None else list(metadata)
        inputs = [None] * count if input_images is None else list(input_images)
        size = 1 if self.chat else self.s["batch_size"]  # a chat request asks of one image
        starts = list(range(0, count, size))
        if not starts:
            return base.Scores.of(np.zeros(0, np.float32))
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
                pool.submit(
                    self._score,
                    url,
                    images[part],
                    prompts[part],
                    metadata[part],
                    None if input_images is None else inputs[part],
                )
                for url, part in jobs
            ]
            answers = [f.result() for f in futures]  # in the order sent
        scores = np.concatenate([a[0] for a in answers])
        names = set.intersection(*(set(a[1]) for a in answers))
        parts = {n: np.concatenate([a[1][n] for a in answers]) for n in sorted(names)}
        return base.Scores.of(scores, parts)

    def _headers(self, url: str) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.s["header"] and _origin(url) in self.hosts:  # the token goes nowhere else
            sentence = token_problem(self.name, self.s["token_env"])
            if sentence:
                raise RemoteRewardError(sentence)
            headers[self.s["header"]] = os.environ[self.s["token_env"]]
        return headers

    def _score(self, url: str, images, prompts, metadata, inputs=None):
        if self.chat:
            body = chat.request_body(self.s, images[0], self._ask(prompts[0], metadata[0]))
        else:
            body = request_body(images, prompts, metadata, self.s["format"], inputs)
        tries = self.s["retries"] + 1
        for attempt in range(tries):
            try:
                return self._post(url, body, len(images))
            except _Retry as e:
                why, asked = str(e), e.wait
            if attempt + 1 < tries:
                time.sleep(self._wait(attempt, asked))
        raise RemoteRewardError(
            f"remote reward {self.name!r}: the server at {_site(url)} failed {tries} time(s), the "
            f"last with {why}; check that it is up and answers within {self.where}.timeout_s "
            f"({self.s['timeout_s']:g}s)."
        )

    def _wait(self, attempt: int, asked: float | None) -> float:
        """The wait before retry `attempt + 1`: the backoff, doubled each time (at most
        MAX_BACKOFF_S), or the server's Retry-After when longer, up to one request's
        deadline (so a server cannot hold the run longer than a request may take)."""
        wait = min(self.s["backoff_s"] * 2**attempt, MAX_BACKOFF_S)
        if asked is not None:
            wait = max(wait, min(asked, self.s["timeout_s"]))
        return wait

    def _ask(self, prompt: str, metadata) -> str:
        try:
            return chat.ask(self.s["question"], prompt, metadata)
        except KeyError as e:
            raise RemoteRewardError(
                f"remote reward {self.name!r}: {self.where}.question names {{{e.args[0]}}}, "
                f"which the metadata of the prompt {echo(prompt)} does not hold."
            ) from None

    def _post(self, url: str, body: bytes, count: int):
        target = url
        deadline = time.monotonic() + self.s["timeout_s"]  # redirects included
        for _ in range(MAX_REDIRECTS + 1):
            status, headers, data = self._exchange(target, body, deadline)
            if status in (301, 302, 303, 307, 308):
                location = urllib.parse.urljoin(target, headers.get("location", ""))
                if _origin(location) != _origin(target):
                    raise RemoteRewardError(
                        f"remote reward {self.name!r}: the server at {_site(url)} redirected to "
                        f"another host ({echo(redacted(location))}); the client follows no "
                        f"redirect off the hosts named in {self.where}.url."
                    )
                target = location
                continue
            if status >= 500 or status in RETRIED_STATUSES:
                raise _Retry(f"HTTP status {status}{_said(data)}", retry_after(headers))
            if status != 200:
                raise RemoteRewardError(
                    f"remote reward {self.name!r}: the server at {_site(url)} answered HTTP status "
                    f"{status}{_said(data)}."
                )
            return self._parse(url, headers, data, count)
        raise RemoteRewardError(
            f"remote reward {self.name!r}: the server at {_site(url)} redirected more than "
            f"{MAX_REDIRECTS} times."
        )

    def _exchange(self, url: str, body: bytes, deadline: float):
        """(status, headers, body) of one POST, all of it by `deadline` (time.monotonic()):
        a timer shuts the socket down there, which ends a read or write that a server
        keeps alive byte by byte (a socket timeout bounds each read only)."""
        limit = f"no full answer within {self.s['timeout_s']:g}s"
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Retry(limit)
        parts = urllib.parse.urlsplit(url)
        kind = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = kind(parts.hostname, parts.port, timeout=left)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = self._headers(url)
        expired, held = threading.Event(), []

        def cut():
            expired.set()
            # the socket as connected: `connection.sock` is None once an answer that ends
            # with its connection is under way, and the answer reads on from the same socket
            sock = held[0] if held else connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(left, cut)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()  # a connect the timer found unfinished ends by its timeout
            held.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            data = response.read()
            if expired.is_set():  # an answer read to its close may look whole when cut
                raise TimeoutError
            headers = {k.lower(): v for k, v in response.getheaders()}
            return response.status, headers, data
        except TimeoutError:
            raise _Retry(limit) from None
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set():
                raise _Retry(limit) from None
            raise _Retry(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        except ValueError as e:  # http.client refusing what it was given: not its message,
            # which may quote a header's value
            raise RemoteRewardError(
                f"remote reward {self.name!r}: the request to {_site(url)} could not be sent "
                f"(http.client refused it with a {type(e).__name__}); check "
                f"{self.where}.url and the header's value."
            ) from None
        finally:
            timer.cancel()
            connection.close()

    def _parse(self, url: str, headers: dict, data: bytes, count: int):
        def bad(what: str) -> RemoteRewardError:
            return RemoteRewardError(
                f"remote reward {self.name!r}: the server at {_site(url)} {what}."
            )

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


def _site(url: str, limit: int = 100) -> str:
    """A URL named in a sentence, cut short when long (its credentials were refused)."""
    url = redacted(url)
    return url if len(url) <= limit else f"{url[: limit - 3]}..."


def _origin(url: str) -> tuple:
    parts = urllib.parse.urlsplit(url)
    default = 443 if parts.scheme == "https" else 80
    return (parts.scheme, (parts.hostname or "").lower(), parts.port or default)


def retry_after(headers: dict) -> float | None:
    """The seconds a server's `Retry-After` asks for (delay seconds or an HTTP date), or
    None when it sends none that reads."""
    value = headers.get("retry-after", "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def token_problem(name: str, variable: str) -> str | None:
    """One sentence when the token's variable is unset or holds what a header cannot carry
    (said without the value), else None."""
    token = os.environ.get(variable)
    if token is None:
        return (
            f"remote reward {name!r} reads its token from the environment variable "
            f"{variable}, which is not set; export it before the run."
        )
    if not token:
        return (
            f"remote reward {name!r} reads its token from the environment variable "
            f"{variable}, which is set but empty; export the header's value in it."
        )
    stripped = token.rstrip("\r\n")
    if stripped != token and not _CONTROL.search(stripped):
        ending = {"\r\n": "a line break (CR LF)", "\n": "a line break (a newline)"}
        what = ending.get(token[len(stripped) :][-2:], ending.get(token[-1], "a carriage return"))
        problem, remedy = f"ends with {what}", "without the line break"
    elif _CONTROL.search(token):
        problem, remedy = "holds a control character (a line break, ...)", "without it"
    elif not _latin1(token):
        problem, remedy = "holds a character outside Latin-1", "without it"
    else:
        return None
    return (
        f"remote reward {name!r}: the value of the environment variable {variable} {problem}, "
        f"which an HTTP header cannot carry; export it again {remedy} (the value is not shown)."
    )


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def probe(instance: str, s) -> str | None:
    """One sentence when a server of `remote:<instance>` takes no connection (or its token's
    variable is unset), else None; nothing is scored."""
    s = {**settings().to_dict(), **dict(s.items())}
    name = f"{FAMILY}:{instance}"
    if s["token_env"]:
        sentence = token_problem(name, s["token_env"])
        if sentence:
            return sentence
    for url in urls_of(s["url"]):
        _, host, port = _origin(url)
        try:
            socket.create_connection(
                (host, port), timeout=min(s["timeout_s"], PROBE_TIMEOUT_S)
            ).close()
        except OSError as e:
            why = e.strerror or type(e).__name__
            return (
                f"remote reward {name!r}: nothing answers at {_site(url)} ({why.lower()}); start "
                f"its server or fix --config.{where_of(instance)}.url."
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
        input_images_of=lambda s: bool(s.get("input_images", False)),
        describe="url=http://host:port/path",
    )
