"""The errors a user can fix, and how one is told in a sentence.

`UserError` is the base of every error caused by the user's input (a config value, a file, a
flag): the commands print its first line as one `error:` sentence and exit 2, never a
traceback. `first_line` and `reason` are the one way an error's message is shortened for that
sentence. This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import argparse
import re


class UserError(ValueError):
    """Bad input, told in one sentence: the commands exit 2 on it, before anything is written."""


class ConfigError(UserError):
    """A config value that cannot work; the message is one sentence for the user. The config
    checks raise it, and so does the reward string's parser, which the rewards package owns."""


class PromptError(UserError):
    """A prompt that a model's text encoder or a reward cannot read; one sentence naming it.
    A start's check of the prompts blames the prompt source for this error only: any other
    error of a reward is the reward's."""


# The longest first line an error sentence keeps: user input echoed whole (a 20 MB prompt)
# would otherwise become the line.
LINE_LIMIT = 1000
# A run of characters without a space longer than WORD_LIMIT is user input (a 100,000-digit
# override, a 300-byte file name): a sentence keeps its first WORD_KEPT characters and its
# length. No word of the sentences' own comes near.
WORD_LIMIT = 200
WORD_KEPT = 60
_LONG_WORD = re.compile(rf"\S{{{WORD_LIMIT + 1},}}")


def echo(text, limit: int = 80) -> str:
    """User input quoted in a sentence: `repr(text)`, or its first `limit` characters and its
    length when it is longer."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def _short_word(match: re.Match) -> str:
    word = match.group()
    body = word.rstrip(".,;:)") or word  # the sentence's own punctuation stays after the count
    tail = word[len(body) :]
    quote = body[-1] if body[-1] in "'\"" else ""  # a quoted value stays quoted
    body = body[: len(body) - len(quote)]
    return f"{body[:WORD_KEPT]}...{quote} ({len(body):,} characters){tail}"


def shorten(text: str) -> str:
    """`text` with every word longer than WORD_LIMIT characters cut to its first WORD_KEPT
    and its length: how every sentence quotes user input, whichever sentence it is."""
    return _LONG_WORD.sub(_short_word, text)


# A URL's user name and password, `scheme://user:pass@`, in running text.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#'\"]*@")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it (`http://user:pass@host`) replaced by
    `***`: a URL's password, like a token, is in no printed line."""
    return _USERINFO.sub(r"\1***@", str(text))


def first_line(error: BaseException | str, default: str | None = None) -> str:
    """The first line of an error's message (or of a message), its long words `shorten`ed and
    URLs' passwords `redact`ed, at most LINE_LIMIT characters; `default`, or the error's class
    name, when it is empty."""
    text = str(error).strip()
    if text:
        line = shorten(redact(text.splitlines()[0]))
        if len(line) > LINE_LIMIT:
            line = f"{line[:LINE_LIMIT]}... (a line of {len(line):,} characters, cut)"
        return line
    return type(error).__name__ if default is None else default


def flat(error: BaseException, limit: int = 300) -> str:
    """An error's whole message on one line (transformers 5's config validation spreads one
    reason over several lines), shortened and redacted, at most `limit` characters."""
    text = shorten(redact(" ".join(str(error).split()))).rstrip(".")
    text = text if len(text) <= limit else f"{text[:limit]}..."
    return text or type(error).__name__


def reason(error: BaseException, limit: int = 200) -> str:
    """`Class: first line` for a sentence's parenthesis: without its full stop, at most
    `limit` characters of the message; the class name alone when the message is empty."""
    text = first_line(error, default="").rstrip(".")[:limit]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class OneLineErrors(argparse.ArgumentParser):
    """argparse, with a command line it cannot parse said in one `error:` line (exit 2): the
    parser of every command."""

    def error(self, message: str):
        self.exit(2, f"error: {first_line(message).rstrip('.')} (see {self.prog} --help).\n")
