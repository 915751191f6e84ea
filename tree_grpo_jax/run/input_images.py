"""Input images named by a prompt file's rows: the images an editing or image-to-video
model starts from, and that a reward may compare its output with.

A row names them in its image field or column (`prompts.image_field`; empty: the one of
IMAGE_FIELDS the file has; "none": no images): one path or http(s) URL, or a list of them
(a JSON list, also inside a table's cell). A path is read relative to the prompt file's
folder. Each becomes an `InputImage`, a reference that loads its pixels only when asked
(`np.asarray(ref)`: [H, W, 3] uint8, RGB): a host keeps no pixels of rows it never draws,
and a batch carries references, not arrays. The few most recent loads are cached.

`check_input_images` opens every image once before a run writes anything: a missing file,
an unreadable image, a download that fails or a size the run cannot take is one sentence
(`InputImageError`). A URL's query string and credentials never appear in a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import io
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from tree_grpo_jax.errors import WORD_LIMIT, ConfigError, UserError, echo, reason

# What an empty `prompts.image_field` looks for, in this order; "none" turns images off.
IMAGE_FIELDS = ("image", "images", "input_image", "input_images")
NO_IMAGES = "none"
URL_SCHEMES = ("http", "https")
DOWNLOAD_TIMEOUT_S = 30.0  # one download's deadline: connecting and every byte
MAX_DOWNLOAD_BYTES = 64 * 2**20
MAX_REDIRECTS = 5
CACHED_IMAGES = 32  # decoded images kept (a batch's worth, for the rewards of one step)


class InputImageError(UserError):
    """An input image that cannot be used; one sentence for the user."""


def shown_url(url: str) -> str:
    """`url` as a message shows it: scheme, host and path, without credentials or query
    (either may hold a token)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return echo(f"{parts.scheme}://{host}{parts.path}", limit=WORD_LIMIT)


@dataclasses.dataclass(frozen=True)
class InputImage:
    """One input image: a file's absolute path or an http(s) URL. `np.asarray(ref)` gives
    its pixels, [H, W, 3] uint8 RGB, read (or downloaded) when first asked."""

    location: str

    @property
    def is_url(self) -> bool:
        return urllib.parse.urlsplit(self.location).scheme.lower() in URL_SCHEMES

    @property
    def shown(self) -> str:
        # whole up to the length of a word any message keeps: a path's end names the file
        return shown_url(self.location) if self.is_url else echo(self.location, limit=WORD_LIMIT)

    def pixels(self) -> np.ndarray:
        return _pixels(self.location)

    def __array__(self, dtype=None, copy=None):
        out = self.pixels()
        return out if dtype is None else out.astype(dtype)


@functools.lru_cache(maxsize=CACHED_IMAGES)
def _pixels(location: str) -> np.ndarray:
    ref = InputImage(location)
    data = _download(ref) if ref.is_url else None
    try:
        with Image.open(io.BytesIO(data) if data is not None else location) as image:
            out = np.asarray(image.convert("RGB"), np.uint8)
    except FileNotFoundError:
        raise InputImageError(f"input image {ref.shown} does not exist.") from None
    except Image.DecompressionBombError:  # PIL refuses it before decoding a pixel
        raise InputImageError(
            f"input image {ref.shown} has more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels, "
            "more than PIL opens (a decompression bomb or a mistake); resize it first."
        ) from None
    except OSError as e:  # PIL's UnidentifiedImageError and a truncated file are OSErrors
        raise InputImageError(
            f"input image {ref.shown} cannot be read as an image ({reason(e)})."
        ) from None
    out.setflags(write=False)  # shared by the cache: no caller may change it
    return out


def _download(ref: InputImage, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> bytes:
    """The bytes at `ref`'s URL, all of them within `timeout_s` (connecting, redirects and
    the last byte): a timer shuts the socket down at the deadline, which ends a read that a
    server keeps alive byte by byte (a socket timeout bounds each read only)."""
    deadline = time.monotonic() + timeout_s
    url = ref.location
    for _ in range(MAX_REDIRECTS + 1):
        try:
            status, location, data = _get(url, deadline)
        except TimeoutError:
            why = f"no whole answer within {timeout_s:g}s"
            break
        except (OSError, http.client.HTTPException) as e:
            why = (getattr(e, "strerror", None) or type(e).__name__).lower()
            break
        if status in (301, 302, 303, 307, 308) and location:
            url = urllib.parse.urljoin(url, location)
            if urllib.parse.urlsplit(url).scheme.lower() not in URL_SCHEMES:
                why = "it redirects to a URL that is not http(s)"
                break
            continue
        if status == 200:
            if data is None:
                why = f"it is over {MAX_DOWNLOAD_BYTES >> 20} MiB"
                break
            return data
        why = f"the server answered {status}"
        break
    else:
        why = f"over {MAX_REDIRECTS} redirects"
    raise InputImageError(f"input image {ref.shown} cannot be downloaded ({why}).")


def _get(url: str, deadline: float) -> tuple[int, str | None, bytes | None]:
    """(status, Location header, body; None when over MAX_DOWNLOAD_BYTES) of one GET, all of
    it by `deadline` (time.monotonic())."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=left)
    expired, held = threading.Event(), []

    def cut():
        expired.set()
        sock = held[0] if held else connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(left, cut)
    timer.daemon = True
    timer.start()
    try:
        connection.connect()
        held.append(connection.sock)
        if expired.is_set():
            raise TimeoutError
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"User-Agent": "tree_grpo_jax"})
        answer = connection.getresponse()
        data = answer.read(MAX_DOWNLOAD_BYTES + 1)
        if expired.is_set():  # an answer read to its close may look whole when cut
            raise TimeoutError
        if len(data) > MAX_DOWNLOAD_BYTES:
            data = None
        return answer.status, answer.getheader("Location"), data
    except OSError:
        if expired.is_set():
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
        connection.close()


class RowMetadata(dict):
    """A row's metadata (its other fields, unchanged) and the input images it names,
    `input_images` (`input_images.InputImage` references; () for none): the images go
    wherever the metadata goes."""

    def __init__(self, fields=(), input_images=()):
        super().__init__(fields)
        self.input_images = tuple(input_images)

    def __reduce__(self):  # copies and pickles keep the images
        return (RowMetadata, (dict(self), self.input_images))


def input_images_of(metadata) -> tuple:
    """The input images of one row's metadata (() for plain metadata or None)."""
    return tuple(getattr(metadata, "input_images", ()))


# ---------------------------------------------------------------------------------------------
# A row's references.


def _named(value) -> list | None:
    """The names in a row's image value: a text (a JSON list when it reads as one, else one
    name) or a list of texts; None when it is neither."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return None
        else:
            return [text] if text else []
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value]
    return None


def references(value, folder: Path, where: str, field: str) -> tuple[InputImage, ...]:
    """The input images a row's `field` value names, paths resolved against `folder` (the
    prompt file's); `where` names the row in a message ("line 3 of prompt file x.jsonl").
    A value that names nothing, or not as a path or URL, is one sentence."""
    names = _named(value)
    if names is None:
        raise InputImageError(
            f"{where} has {echo(json.dumps(value, default=str))} as its image {field!r}; "
            "give a path or an http(s) URL, or a list of them."
        )
    if not names or not all(names):
        raise InputImageError(
            f"{where} names no image in its {field!r}; give a path or an http(s) URL to each "
            "row (or set prompts.image_field to none to read no images)."
        )
    refs = []
    for name in names:
        scheme = urllib.parse.urlsplit(name).scheme.lower()
        if scheme in URL_SCHEMES:
            refs.append(InputImage(name))
        elif len(scheme) > 1:  # a one-letter scheme is a Windows drive
            raise InputImageError(
                f"{where} names the image {shown_url(name)} with the scheme {scheme!r}; an "
                "input image is a path or an http(s) URL."
            )
        else:
            path = Path(os.path.expanduser(name))
            refs.append(InputImage(str(path if path.is_absolute() else folder / path)))
    return tuple(refs)


def image_field(path: Path, have: Sequence[str], named: str) -> str | None:
    """The field or column holding the input images: `named` (`prompts.image_field`), which
    must be among `have`; else the one of IMAGE_FIELDS in `have`; None for none (or
    "none")."""
    if named == NO_IMAGES:
        return None
    if named:
        if named not in have:
            raise InputImageError(
                f"prompt file {path} has no {named!r} image field (its fields: "
                f"{', '.join(map(repr, have)) or 'none'}); fix --config.prompts.image_field."
            )
        return named
    present = [f for f in IMAGE_FIELDS if f in have]
    if len(present) > 1:
        raise InputImageError(
            f"prompt file {path} has several image fields {', '.join(map(repr, present))}; "
            "name the one to read with --config.prompts.image_field=<name>."
        )
    return present[0] if present else None


# ---------------------------------------------------------------------------------------------
# The checks before a run.

# A size rule: (height, width) of an image -> one sentence's middle when the run cannot take
# it, else None.
SizeRule = Callable[[int, int], str | None]


def required_size(height: int, width: int) -> SizeRule:
    """The rule of a run that needs its input images at exactly `height` x `width`."""

    def rule(h: int, w: int) -> str | None:
        if (h, w) != (height, width):
            return f"is {w}x{h} but the run needs {width}x{height} (width x height)"
        return None

    return rule


def size_rule_of(model) -> SizeRule | None:
    """The model's rule for its input images: its `input_image_size` ((height, width), or a
    `SizeRule`), None (the default) for any size (the family resizes)."""
    wanted = getattr(model, "input_image_size", None)
    if wanted is None or callable(wanted):
        return wanted
    height, width = wanted
    return required_size(int(height), int(width))


def takes_input_images(model) -> bool:
    """Whether the model's family conditions on input images (its `takes_input_images`;
    False unless a family says so)."""
    return bool(getattr(model, "takes_input_images", False))


def check_input_images(rows: Sequence[Sequence[InputImage]], rule: SizeRule | None = None):
    """Every distinct image of `rows` (each row's references) opened once, in order: the
    first that is missing, unreadable, cannot be downloaded or breaks `rule` is one
    sentence (InputImageError)."""
    seen = set()
    for refs in rows:
        for ref in refs:
            if ref.location in seen:
                continue
            seen.add(ref.location)
            if not ref.is_url and os.path.isdir(ref.location):
                raise InputImageError(f"input image {ref.shown} is a folder, not an image file.")
            if not ref.is_url and not os.path.isfile(ref.location):
                raise InputImageError(
                    f"input image {ref.shown} does not exist; paths are read relative to the "
                    "prompt file's folder."
                )
            height, width = ref.pixels().shape[:2]
            problem = rule(height, width) if rule is not None else None
            if problem:
                raise InputImageError(f"input image {ref.shown} {problem}.")


def check_prompt_images(model, rewards, metadata: Sequence, where: str, others=()) -> None:
    """Before a run writes anything: prompts that name input images go to a model that
    conditions on them (`takes_input_images`) or to a reward that reads them (`rewards`,
    those scoring these prompts, or `others`, the run's other rewards: a held-out one that
    reads the same file); a reward of `rewards` that reads them has them for every prompt;
    and every image opens (at the size the model needs when it takes them: its
    `input_image_size`). `metadata`: the prompts' (`where`: the setting or flag that gave
    them). Else one sentence (ConfigError)."""
    rows = [input_images_of(m) for m in metadata]
    readers = [r.name for r in rewards if getattr(r, "takes_input_images", False)]
    read_elsewhere = any(getattr(r, "takes_input_images", False) for r in others)
    conditioned = takes_input_images(model)
    if not all(rows) and (readers or conditioned):
        who = f"reward {readers[0]!r}" if readers else f"model {model.name!r}"
        missing = "any prompt" if not any(rows) else "some of its prompts"
        raise ConfigError(
            f"{who} reads each prompt's input image, but {where} names none for {missing}; "
            "give a prompt file with an image field (prompts.image_field) in every row."
        )
    if not any(rows):
        return
    if not conditioned and not readers and not read_elsewhere:
        raise ConfigError(
            f"{where} names input images, but model {model.name!r} takes none (its family "
            "has no image conditioning) and no reward reads them; use a model that edits or "
            "animates images, a reward that compares with them (input_similarity), or "
            "prompts.image_field set to none."
        )
    try:
        check_input_images(rows, size_rule_of(model) if conditioned else None)
    except InputImageError as e:
        raise ConfigError(f"{where}: {e}") from None


def encode_prompts(model, prompts: Sequence[str], metadata: Sequence | None = None):
    """The model's conditioning of `prompts`: `model.encode_prompts(prompts)`, and for a
    family that conditions on input images (`takes_input_images`)
    `model.encode_prompts(prompts, input_images=...)`, one list of [H, W, 3] uint8 per
    prompt (`metadata`: the prompts', which carry them)."""
    if not takes_input_images(model):
        return model.encode_prompts(list(prompts))
    metadata = [None] * len(prompts) if metadata is None else metadata
    images = [[np.asarray(ref) for ref in input_images_of(m)] for m in metadata]
    return model.encode_prompts(list(prompts), input_images=images)
