"""The settings of a served reward, `reward_options.remote.<name>`: their declarations
(`SETTINGS`: defaults, ranges, choices; `settings()` the defaults) and their checks, one
sentence for the first bad one (`check_settings`), each value quoted short and with a URL's
credentials hidden (`shown`, `redacted`). The client is `remote.py`.
"""

from __future__ import annotations

import math
import numbers
import re
import urllib.parse

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.errors import echo
from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.rewards import chat

FORMATS = ("png", "raw")
SCHEMES = ("http", "https")
# The bounds of the settings (a value past them is a typo, and would overflow a timer)
MAX_TIMEOUT_S = 3600.0  # one request's deadline
MAX_BACKOFF_S = 600.0  # one wait before a retry, doubled or not
MAX_RETRIES = 20
MAX_IN_FLIGHT = 256  # requests at once, each a thread
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# A URL's credentials, with or without its scheme: `[scheme:][//]user:pass@`
_CREDENTIALS = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^/?#]*@")


# One remote reward's settings, `reward_options.remote.<name>`.
SETTINGS = {
    "url": Setting("", "http(s)://host:port/path; several, comma-separated, are taken in turn"),
    "batch_size": Setting(16, "images per request", low=1),
    "in_flight": Setting(2, "requests at once", low=1, high=MAX_IN_FLIGHT, note="requests at once"),
    "timeout_s": Setting(
        60.0,
        "a request's deadline: connecting, sending and the whole answer",
        low=0,
        open_low=True,
        high=MAX_TIMEOUT_S,
        note="seconds for one whole request",
    ),
    "retries": Setting(
        3,
        "further tries of a request that failed to connect, timed out or got 5xx",
        low=0,
        high=MAX_RETRIES,
        note="further tries",
    ),
    "backoff_s": Setting(
        0.5,
        "the wait before the first retry, doubled before each next one",
        low=0,
        high=MAX_BACKOFF_S,
        note="seconds",
    ),
    "score_field": Setting("scores", "the answer's field holding one score per image"),
    "format": Setting("raw", 'how images travel: "raw" (uint8 bytes) or "png"', choices=FORMATS),
    "media": Setting(
        media_kinds.IMAGE,
        '"image": videos go frame by frame; "video": whole',
        choices=tuple(media_kinds.RANKS),
    ),
    "input_images": Setting(
        False,
        "send each image's prompt's input images too (`input_images` in the request: for "
        "editing and image-to-video servers)",
    ),
    "header": Setting("", 'a header carrying the token, e.g. "Authorization" ("" = none)'),
    "token_env": Setting("", "the environment variable holding the header's value"),
    "protocol": Setting(
        "scores",
        'the protocol: "scores" (the wire format above) or "chat" (an OpenAI-compatible chat '
        "endpoint asked `question` per image; `chat.py`), whose settings follow",
        choices=chat.PROTOCOLS,
    ),
    "model": Setting("", "chat: the served model's name"),
    "question": Setting("", "chat: a template; {prompt} and the prompt's metadata fields"),
    "score_from": Setting(
        "answer",
        'chat: "answer" (yes/no or a number) or "logprobs" (P(yes))',
        choices=chat.SCORE_FROM,
    ),
    "scale": Setting(1.0, "chat: an answer's number is divided by it", low=0, open_low=True),
    "max_tokens": Setting(8, "chat: the longest answer", low=1),
    "top_logprobs": Setting(5, 'chat: the first token\'s alternatives read by "logprobs"', low=1),
}
settings = defaults_of(SETTINGS)


FIELDS = tuple(settings().keys())
CHAT_FIELDS = ("model", "question", "score_from", "scale", "max_tokens", "top_logprobs")


def urls_of(text: str) -> list[str]:
    return [u.strip() for u in str(text).split(",") if u.strip()]


def where_of(instance: str) -> str:
    return f"reward_options.remote.{instance}"


def redacted(url: str) -> str:
    """`url` with its user name and password (`user:pass@`), if any, shown as `***`."""
    return _CREDENTIALS.sub(lambda m: f"{m.group(1) or ''}***@", url)


def shown(value) -> str:
    """A setting's value quoted in a sentence: short whatever its size, a URL's credentials
    hidden."""
    if isinstance(value, str):
        return echo(redacted(value))
    try:
        text = repr(value)
    except ValueError:  # an int past str()'s digits
        return "a number of thousands of digits"
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text):,} characters)"


def check_settings(instance: str, s) -> str | None:
    """One sentence for the first bad setting of `reward_options.remote.<instance>`."""
    where = where_of(instance)
    if not hasattr(s, "keys"):
        return f"{where} must be a section of settings (url, batch_size, ...)."
    for field in s:
        if field not in FIELDS:
            return (
                f"{where} sets {shown(field)}, which is not a setting; the settings are: "
                f"{', '.join(FIELDS)}."
            )
    s = {**settings().to_dict(), **dict(s.items())}
    for field in FIELDS:
        default, value = settings()[field], s[field]
        if isinstance(default, str) and not isinstance(value, str):
            return f"{where}.{field} must be a string, got {shown(value)}."
        if isinstance(default, bool):
            if not isinstance(value, bool):
                return f"{where}.{field} must be True or False, got {shown(value)}."
            continue
        if isinstance(default, int) and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral)
        ):
            return f"{where}.{field} must be a whole number, got {shown(value)}."
        if isinstance(default, float) and (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
        ):
            return f"{where}.{field} must be a finite number, got {shown(value)}."
    for field, setting in SETTINGS.items():  # the ranges and choices declared above
        sentence = setting.sentence(f"{where}.{field}", s[field], show=shown)
        if sentence:
            return sentence
    sentence = _check_urls(where, s["url"])
    if sentence:
        return sentence
    if not s["score_field"]:
        return f"{where}.score_field must name the answer's field of scores."
    if bool(s["header"]) != bool(s["token_env"]):
        return (
            f"{where} sets one of header and token_env; set both (the header and the "
            "environment variable holding its value) or neither."
        )
    if s["header"] and not _HEADER_NAME.match(s["header"]):
        return f"{where}.header {shown(s['header'])} is not a header name."
    if s["protocol"] == "chat":
        return _check_chat(where, s)
    unread = [f for f in CHAT_FIELDS if s[f] != settings()[f]]
    if unread:
        return (
            f"{where} sets {unread[0]!r}, which only protocol 'chat' reads; set "
            f"--config.{where}.protocol=chat or leave it out."
        )
    return None


def _check_urls(where: str, text: str) -> str | None:
    urls = urls_of(text)
    if not urls:
        return f"{where}.url is missing: set --config.{where}.url=http://host:port/path."
    # credentials first, in every URL: a password holding a comma splits into two "URLs"
    for url in urls:
        if redacted(url) != url:
            return (
                f"{where}.url {shown(url)} carries a user name or password, which would be "
                "written into config.json and every command the run prints; take it out "
                f"and send the credentials in a header: set {where}.header=Authorization and "
                f"{where}.token_env to a variable holding e.g. 'Basic <base64 of user:password>'."
            )
    for url in urls:
        if not url.isascii() or any(c.isspace() or not c.isprintable() for c in url):
            return (
                f"{where}.url {shown(url)} holds a space, a control or a non-ASCII "
                "character; percent-encode it (%20 for a space)."
            )
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            return f"{where}.url {shown(url)} is not an http:// or https:// URL with a host."
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            return f"{where}.url {shown(url)} has a bad port."
    return None


def _check_chat(where: str, s: dict) -> str | None:
    if not s["model"]:
        return f"{where}.model is missing: set the name the chat server serves its model under."
    sentence = chat.check_question(where, s["question"])
    if sentence:
        return sentence
    if s["media"] != media_kinds.IMAGE:
        return f"{where}.media must be 'image' with protocol 'chat' (one image per question)."
    if s["input_images"]:
        return (
            f"{where}.input_images is for protocol 'scores' only (a chat question carries one "
            "image); leave it out or set protocol=scores."
        )
    return None
