"""The `--config` flag (with `--config.<section>.<field>=<value>` overrides), `--workdir` and
`--print_config`, shared by the commands that run a config (`main`, `plan`, `evaluate`), and
their parsing: every problem with the config file or an override is one sentence.

The commands' parsers are the same argparse parser as every other command's
(`common.command_parser`); the overrides are parsed here, each value typed by the field's
current value in the config: a bool (`true`/`false`, `1`/`0`), an int, a float (an int
accepted), a string, or a tuple as a Python literal (`'(0,3)'`; a bare word is a one-entry
tuple).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import re
import sys
import traceback

from tree_grpo_jax.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_SIGNAL,
    command_parser,
    fail,
    print_out,
)
from tree_grpo_jax.errors import first_line, redact


class Flag:
    """A command's flag, read as `FLAG.value` once `parse_flags` has run (its default before)."""

    def __init__(self, dest: str, default=None):
        self.dest, self.default = dest, default
        self.value = default
        self.present = False


CONFIG = Flag("config")  # the loaded ConfigDict, overrides applied; `CONFIG.path` its file
CONFIG.path = None
CONFIG.overrides = []  # as `_split_overrides` gives them, for another file (`apply_overrides`)
WORKDIR = Flag("workdir")
PRINT_CONFIG = Flag("print_config", False)
_SHARED = (CONFIG, WORKDIR, PRINT_CONFIG)

CONFIG_HELP = (
    "Path to a config file (configs/*.py); override a field with --config.<section>.<field>="
    "<value>, and list them all with --print_config."
)
WORKDIR_HELP = "Where metrics, pictures and checkpoints go (default runs/<name>/<time>)."
PRINT_CONFIG_HELP = (
    "Print every field of the config with its value (overrides applied), one `section.field: "
    "value` a line, and exit."
)


def config_parser(command: str, description: str, workdir_help: str = WORKDIR_HELP):
    """The parser of a command that runs a config: `common.command_parser` with `--config`,
    `--workdir` and `--print_config`; the command adds its own flags with `define`."""
    parser = command_parser(command, description, epilog="")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--workdir", metavar="DIR", help=workdir_help)
    parser.add_argument("--print_config", action="store_true", help=PRINT_CONFIG_HELP)
    parser.flags = []
    return parser


def define(parser, name: str, default=None, help: str = "", **kwargs) -> Flag:  # noqa: A002
    """A flag of the command (`--name`), its parsed value read as the returned `.value`."""
    flag = Flag(name, default)
    parser.add_argument(f"--{name}", dest=name, default=default, help=help, **kwargs)
    parser.flags.append(flag)
    return flag


def comma_list(text: str) -> list[str]:
    """A comma-separated flag value (`--programs=rollout,decode`) as its entries."""
    return [part for part in text.split(",") if part]


# ---------------------------------------------------------------------------------------------
# The config file.


class BadCommandLine(Exception):
    """One sentence; `status` the exit status."""

    def __init__(self, sentence: str, status: int = EXIT_BAD_INPUT):
        super().__init__(sentence)
        self.status = status


def _fields(config, leaves_only=False) -> list[str]:
    from tree_grpo_jax.config import flatten  # only now: it starts JAX

    return list(flatten(config, leaves_only=leaves_only))


def _schema_fields(leaves_only=False) -> list[str]:
    from tree_grpo_jax.config import base_config

    return _fields(base_config(), leaves_only=leaves_only)


def _is_config(config) -> bool:
    import ml_collections

    return isinstance(config, ml_collections.ConfigDict)


def _known_fields(config, leaves_only=False) -> list[str]:
    """The fields to suggest: the loaded config's, else the schema's."""
    if _is_config(config):
        return _fields(config, leaves_only=leaves_only)
    return _schema_fields(leaves_only)


def _missing_config(path: str) -> str:
    """The sentence for a config file that is not there, with the path that is, if any: the
    name with `.py`, or the same relative path in the repository this package came from (a
    command started from another folder)."""
    sentence = f"there is no config file {path!r} (from {os.getcwd()})"
    file = path.split(":", 1)[0]
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__ + "/..")))
    candidates = [file] if file.endswith(".py") else [file + ".py", file]
    if not os.path.isabs(file):
        candidates += [os.path.join(repository, c) for c in candidates]
    found = next((c for c in candidates if c != file and os.path.isfile(c)), None)
    if found is None:
        return sentence + "."
    if not os.path.isabs(file) and os.path.isabs(found):
        return f"{sentence}; the repository's one is --config={found}."
    return f"{sentence}; did you mean --config={found}?"


def _line_in(e: BaseException, file: str) -> int | None:
    """The line of `file` (the config file) in `e`'s traceback, the innermost one."""
    target = os.path.abspath(file)
    lines = [
        line
        for frame, line in traceback.walk_tb(e.__traceback__)
        if os.path.abspath(frame.f_code.co_filename) == target
    ]
    return lines[-1] if lines else None


def load_config(path: str):
    """The config file's `get_config()` (`file:argument` passes the argument), a ConfigDict;
    BadCommandLine with one sentence for anything else."""
    file, _, argument = path.partition(":")
    if not os.path.isfile(file):
        raise BadCommandLine(_missing_config(path))
    name = "tree_grpo_jax_config_" + re.sub(r"\W", "_", os.path.basename(file).removesuffix(".py"))
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a dataclass or pickle in the file finds its module
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise BadCommandLine(
                f"the config file {path!r} defines no get_config(); start it from "
                "tree_grpo_jax.config.base_config()."
            )
        config = module.get_config(argument) if argument else module.get_config()
    except BadCommandLine:
        raise
    except KeyboardInterrupt:  # the file itself raising it (a real Ctrl-C is `interrupts`')
        raise BadCommandLine(
            f"the config file {path!r} was interrupted (KeyboardInterrupt) while loading; "
            "nothing was written.",
            EXIT_SIGNAL["SIGINT"],
        ) from None
    except SystemExit as e:
        code = "" if e.code is None else repr(e.code)
        raise BadCommandLine(
            f"the config file {path!r} called sys.exit({code}) while loading; its "
            "get_config() must return the config."
        ) from None
    except SyntaxError as e:
        where = f" (line {e.lineno})" if e.lineno else ""
        raise BadCommandLine(
            f"the config file {path!r} could not be loaded{where}: SyntaxError: {e.msg}."
        ) from None
    except Exception as e:  # noqa: BLE001 - whatever the file raised is its own sentence
        line = _line_in(e, file)
        where = f" (line {line})" if line else ""
        raise BadCommandLine(
            f"the config file {path!r} could not be loaded{where}: {type(e).__name__}: "
            f"{first_line(e, default='').rstrip('.')}."
        ) from None
    if not _is_config(config):
        what = "None (a missing return?)" if config is None else f"a {type(config).__name__}"
        raise BadCommandLine(
            f"{path}'s get_config() returned {what}, not an ml_collections ConfigDict; start it "
            "from tree_grpo_jax.config.base_config()."
        )
    return config


# ---------------------------------------------------------------------------------------------
# Overrides: `--config.<field>=<value>`, each typed by the field's value in the config.


def _kind(config, field: str):
    """The type of `field` in `config` (None: no such field, or no config)."""
    import ml_collections

    parent, _, key = field.rpartition(".")
    node = config
    for part in parent.split(".") if parent else ():
        node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        return None
    return node.get_type(key)


def _split_overrides(words: list[str], config=None):
    """The overrides, (flag as typed, field, value or None for a bare `--config.f`), and the
    other words; `--noconfig.f` is `--config.f=false`, and, with `config`, the word after a
    bare `--config.f` of a field that is no bool is its value (`--config.f 3`), as before."""
    overrides, others = [], []
    words = list(words)
    while words:
        word = words.pop(0)
        match = re.match(r"--(no)?config\.([^=]*)(=(.*))?$", word, re.DOTALL)
        if match is None:
            others.append(word)
            continue
        negated, field, value = match.group(1), match.group(2), match.group(4)
        if negated:
            value = "false" if value is None else None  # `--noconfig.f=x` is no bool
        elif value is None and words and not words[0].startswith("-"):
            kind = _kind(config, field) if config is not None else None
            if kind is not None and kind is not bool:
                value = words.pop(0)
                word = f"{word} {value}"
        overrides.append((word, field, value))
    return overrides, others


def _tuple_value(text: str) -> tuple:
    """`text` as a tuple: a Python literal (`(0,3)`, `0,3`, `('a',)`), else the word itself as
    a one-entry tuple (`digit_accuracy`, a path); a list of words with no quotes is refused."""
    try:
        value = ast.literal_eval(text)
    except ValueError:  # a bare name (`digit_accuracy`) is no literal
        value = text
    except SyntaxError:
        if "," in text or " " in text:
            raise ValueError(
                f"{text!r} is no tuple literal; quote each entry, e.g. ('a', 'b')"
            ) from None
        value = text  # a path or pattern (`/x/y`, `a*`): one word
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,)


_TRUE, _FALSE = ("true", "t", "1", "yes", "y"), ("false", "f", "0", "no", "n")


def _typed(kind: type, text: str):
    """`text` as a value of the field's type `kind`; ValueError saying what was expected."""
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("true or false is expected")
    if kind is int:
        for base in (10, 0):  # `010` and `0x10` both
            try:
                return int(text, base)
            except ValueError:
                pass
        raise ValueError("an integer is expected")
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("a number is expected") from None
    if kind is str:
        return text
    if kind is tuple:
        return _tuple_value(text)
    try:  # another type: a Python literal, else the text
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def _field_sentence(config, field: str, flag: str, path: str | None) -> str:
    """The sentence for an override naming a field the config does not have."""
    from tree_grpo_jax import config as cfg  # only now: it starts JAX

    moved = cfg.moved_fields().get(field)
    if moved:
        return f"the config has no field {field!r} (from {flag}): it moved to {moved}."
    if field in _schema_fields():
        return (
            f"{path}'s get_config() lacks {field} (from {flag}); start it "
            "from tree_grpo_jax.config.base_config()."
        )
    close = difflib.get_close_matches(field, _known_fields(config), n=1)
    hint = f"; did you mean --config.{close[0]}?" if close else "."
    return f"the config has no field {field!r} (from {flag}){hint}"


def _add_family_member(config, parent: str) -> None:
    """An override of `reward_options.<family>.<name>.<field>` (a served reward's setting,
    `reward_options.remote.judge.url`) adds that member's settings at their defaults when
    the config has none yet."""
    import ml_collections

    section, family, member = (parent.split(".") + ["", "", ""])[:3]
    if section != "reward_options" or not member or parent.count(".") != 2:
        return
    from tree_grpo_jax.rewards import families  # only now: it starts JAX

    defaults = families.instance_defaults(family)
    options = config.get("reward_options") if _is_config(config) else None
    if defaults is None or not isinstance(options, ml_collections.ConfigDict):
        return
    if options.get(family) is None:
        options[family] = ml_collections.ConfigDict()
    if isinstance(options[family], ml_collections.ConfigDict) and member not in options[family]:
        options[family][member] = defaults


def apply_overrides(config, overrides, path: str | None = None):
    """`config` with `overrides` ((flag as typed, field, value text or None), as
    `_split_overrides` gives them) set, each field at most once; BadCommandLine with one
    sentence for a field given twice, one the config lacks, or a value of the wrong type."""
    import ml_collections

    seen = {}
    for flag, field, text in overrides:
        name = f"--config.{field}"
        if field in seen:
            raise BadCommandLine(
                f"{name} is given twice ({seen[field]} and {flag}); give each field once."
            )
        seen[field] = flag
        parent, _, key = field.rpartition(".")
        _add_family_member(config, parent)
        node = config
        for part in parent.split(".") if parent else ():
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
            raise BadCommandLine(_field_sentence(config, field, name, path))
        if isinstance(node[key], ml_collections.ConfigDict):
            raise BadCommandLine(
                f"{name} is a section of the config; override its fields one by one, "
                f"e.g. --config.{field}.<field>=<value> (--print_config lists them)."
            )
        kind = node.get_type(key)
        if kind is type(None):
            raise BadCommandLine(
                f"{name} cannot be set from the command line: the field is None in the "
                "config, so its type is unknown; set it in the config file."
            )
        if text is None:
            if kind is not bool:
                raise BadCommandLine(f"{name} needs a value: {name}=<value>.")
            text = "true"
        try:
            value = _typed(kind, text)
            node[key] = value
        except (ValueError, TypeError) as e:
            why = str(e) if isinstance(e, ValueError) else f"a {kind.__name__} is expected"
            raise BadCommandLine(
                f"{flag} has the wrong type for that field ({first_line(why).rstrip('.')})."
            ) from None
    return config


# ---------------------------------------------------------------------------------------------
# Words that are no flag of the command.


def _fields_like(name: str, known: list[str], fuzzy: bool = True) -> list[str]:
    """The config fields `name` (a flag or argument) may have meant: itself, itself after a
    mistyped first part (`confg.train.iterations`), the fields it ends (`iterations`), or,
    `fuzzy`, the closest ones."""
    tail = name.partition(".")[2]
    for candidate in (name, tail):
        if candidate in known:
            return [candidate]
    last = {}
    for field in known:
        last.setdefault(field.rsplit(".", 1)[-1], []).append(field)
    if name in last or not fuzzy:
        return last.get(name, [])[:3]
    for close in difflib.get_close_matches(name, list(last), n=1):
        return last[close][:3]
    return difflib.get_close_matches(name, known, n=1)


def _unknown_flag(word: str, parser, config) -> str:
    """The sentence for a flag the command does not have, pointing at `--config.<field>`
    when it looks like a field, or at the command's own flag it is closest to."""
    name, eq, value = word.lstrip("-").partition("=")
    value = value if eq else "<value>"
    known = _known_fields(config, leaves_only=True)
    fields = _fields_like(name, known, fuzzy=False)
    own = [o.lstrip("-") for o in parser._option_string_actions if o.startswith("--")]
    close = difflib.get_close_matches(name, own, n=1)
    if not fields and not close:
        fields = _fields_like(name, known)
    if fields:
        spelled = " or ".join(f"--config.{f}={value}" for f in fields)
        return f"Unknown command line flag {name!r}; did you mean {spelled}?"
    if close:
        return f"Unknown command line flag {name!r}. Did you mean: {close[0]}?"
    return f"Unknown command line flag {name!r}."


def _stray(arg: str, config) -> str:
    """A positional argument: the command takes none, so it is a field without `--config.`."""
    name, eq, value = arg.lstrip("-").partition("=")
    # Only `name=value` looks enough like a field to guess at a near miss.
    fields = (
        _fields_like(name, _known_fields(config, leaves_only=True), fuzzy=bool(eq)) if name else []
    )
    if fields:
        spelled = " or ".join(f"--config.{f}={value if eq else '<value>'}" for f in fields)
        return f"stray argument {arg!r}; did you mean {spelled}?"
    return (
        f"stray argument {arg!r}: the command takes flags only (--config=<file>, "
        "--config.<section>.<field>=<value>; --print_config lists the fields)."
    )


# ---------------------------------------------------------------------------------------------
# The command line.


def _config_text(config) -> str:
    """Every field with its value, one `section.field: value` a line (sorted, as ConfigDict
    keeps them)."""
    from tree_grpo_jax.config import flatten

    return "".join(
        f"{path}: {redact(repr(value))}\n"  # a URL's password is in no printed line
        for path, value in flatten(config, leaves_only=True).items()
    )


def _print_and_exit(text: str) -> None:
    print_out(text.rstrip("\n"))
    sys.exit(0)


# The help flags, absl's spellings included: each prints the command's text and exits 0.
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def _given_twice(words: list[str], parser: argparse.ArgumentParser) -> None:
    """Each of the command's flags at most once, as each field: argparse would keep the
    last `--config` (or `--workdir`) without a word."""
    seen = {}
    for at, word in enumerate(words):
        name, eq, _ = word.partition("=")
        action = parser._option_string_actions.get(name)
        if action is None or not name.startswith("--"):
            continue
        if not eq and action.nargs != 0 and at + 1 < len(words):  # `--config FILE`
            word = f"{word} {words[at + 1]}"
        if name in seen:
            raise BadCommandLine(
                f"{name} is given twice ({seen[name]} and {word}); give each flag once."
            )
        seen[name] = word


def _parse(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    words = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    after = argv[argv.index("--") + 1 :] if "--" in argv else []
    if any(w.split("=", 1)[0] in HELP_FLAGS for w in words):
        _print_and_exit(parser.format_help())
    overrides, others = _split_overrides(words)
    _given_twice(others, parser)
    path = parser.parse_known_args(others)[0].config
    config = load_config(path) if path is not None else None
    if config is not None:  # now the fields' types tell `--config.f 3` from a bare bool
        overrides, others = _split_overrides(words, config)
    args, extras = parser.parse_known_args(others)
    for word in [*extras, *after]:
        if word.startswith("-") and word != "-":
            raise BadCommandLine(_unknown_flag(word, parser, config))
        raise BadCommandLine(_stray(word, config))
    if overrides and config is None:
        raise BadCommandLine(
            f"{overrides[0][0]} overrides a config field: give the config file too, "
            "e.g. --config=configs/tiny.py."
        )
    if config is not None:
        apply_overrides(config, overrides, path)
    CONFIG.value, CONFIG.path, CONFIG.present = config, path, path is not None
    CONFIG.overrides = overrides
    for flag in (WORKDIR, PRINT_CONFIG, *getattr(parser, "flags", ())):
        flag.value = getattr(args, flag.dest)
        flag.present = f"--{flag.dest}" in {w.split("=", 1)[0] for w in others}
    if PRINT_CONFIG.value:
        if path is None:
            raise BadCommandLine("give the config file to print, e.g. --config=configs/tiny.py.")
        _print_and_exit(_config_text(config))
    if path is not None:
        from tree_grpo_jax import config as cfg  # only now: it starts JAX

        try:
            cfg.check_shape(config, source=f"{path}'s get_config()")
        except cfg.ConfigError as e:
            raise BadCommandLine(str(e)) from None
    return argv[:1]


def parse_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The command line `argv` parsed by `parser` (a `config_parser`): the config file loaded
    and its overrides applied, every flag's `.value` set; a missing or broken file, an
    unknown field or flag, a wrong type, a field or flag given twice is one sentence (exit 2)."""
    try:
        return _parse(argv, parser)
    except BadCommandLine as e:
        fail(str(e), e.status)
