"""The `--config` flag (with `--config.<section>.<field>=<value>` overrides), `--workdir` and
`--print_config`, shared by the commands that run a config (`main`, `plan`, `evaluate`), and
their parsing: every problem with the config file or an override is one sentence."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
import traceback

import ml_collections
from absl import flags
from ml_collections import config_flags

from tree_grpo_jax.cli.common import EXIT_BAD_INPUT, EXIT_SIGNAL, fail
from tree_grpo_jax.errors import first_line

CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Path to a config file (configs/*.py); override a field with --config.<section>.<field>="
    "<value>, and list them all with --print_config.",
)
WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics, pictures and checkpoints go (default runs/<name>/<time>)."
)
PRINT_CONFIG = flags.DEFINE_bool(
    "print_config",
    False,
    "Print every field of the config with its value (overrides applied), one `section.field: "
    "value` a line, and exit.",
)


# ---------------------------------------------------------------------------------------------
# Flags: every problem with the config file or an override is one sentence.


def _config_path(argv) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _fields(config, leaves_only=False) -> list[str]:
    from tree_grpo_jax.config import flatten  # only now: it starts JAX

    return list(flatten(config, leaves_only=leaves_only))


def _schema_fields(leaves_only=False) -> list[str]:
    from tree_grpo_jax.config import base_config

    return _fields(base_config(), leaves_only=leaves_only)


_UNREADABLE = object()


def _get_config(path) -> object:
    """The config file's `get_config()`, loaded again (_UNREADABLE when that fails)."""
    try:
        spec = importlib.util.spec_from_file_location("tree_grpo_jax_config_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except (Exception, SystemExit):  # noqa: BLE001 - fall back to a sentence without a suggestion
        return _UNREADABLE


def _config_fields(path, leaves_only=False) -> list[str]:
    """Every field of the config file's `get_config()` ([] when it cannot be loaded)."""
    config = _get_config(path)
    return _fields(config, leaves_only=leaves_only) if hasattr(config, "items") else []


def _known_fields(argv, leaves_only=False) -> list[str]:
    """The fields to suggest: the loaded config's, else its file's, else the schema's."""
    config = CONFIG.value if flags.FLAGS["config"].present else None
    if isinstance(config, ml_collections.ConfigDict):
        return _fields(config, leaves_only=leaves_only)
    path = _config_path(argv)
    return (path and _config_fields(path, leaves_only)) or _schema_fields(leaves_only)


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


def _unknown_field(argv) -> str:
    """The sentence for an override naming a field the config does not have."""
    known = _known_fields(argv)
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and match.group(1) not in known:
            field = match.group(1)
            flag = arg.split("=")[0]
            from tree_grpo_jax import config as cfg  # only now: it starts JAX

            moved = cfg.moved_fields().get(field)
            if moved:
                return f"the config has no field {field!r} (from {flag}): it moved to {moved}."
            if field in _schema_fields():
                return (
                    f"{_config_path(argv)}'s get_config() lacks {field} (from {flag}); start it "
                    "from tree_grpo_jax.config.base_config()."
                )
            close = difflib.get_close_matches(field, known, n=1)
            hint = f"; did you mean --config.{close[0]}?" if close else "."
            return f"the config has no field {field!r} (from {flag}){hint}"
    return "an override names a field the config does not have."


def _unknown_flag(e: flags.UnrecognizedFlagError, argv) -> str:
    """absl's sentence, pointing at `--config.<field>` when the flag looks like a field."""
    arg = str(e.flagvalue)
    value = arg.partition("=")[2] if "=" in arg else "<value>"
    known = _known_fields(argv, leaves_only=True)
    fields = _fields_like(e.flagname, known, fuzzy=False)
    if not fields and "Did you mean" not in str(e):  # absl's guess of a flag comes first
        fields = _fields_like(e.flagname, known)
    if not fields:
        return re.sub(r"\s*\?$", "?", first_line(e))
    spelled = " or ".join(f"--config.{f}={value}" for f in fields)
    return f"Unknown command line flag {e.flagname!r}; did you mean {spelled}?"


def _stray(arg: str, argv) -> str:
    """A positional argument: the command takes none, so it is a field without `--config.`."""
    name, eq, value = arg.lstrip("-").partition("=")
    # Only `name=value` looks enough like a field to guess at a near miss.
    fields = (
        _fields_like(name, _known_fields(argv, leaves_only=True), fuzzy=bool(eq)) if name else []
    )
    if fields:
        spelled = " or ".join(f"--config.{f}={value if eq else '<value>'}" for f in fields)
        return f"stray argument {arg!r}; did you mean {spelled}?"
    return (
        f"stray argument {arg!r}: the command takes flags only (--config=<file>, "
        "--config.<section>.<field>=<value>; --print_config lists the fields)."
    )


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


def _raised_in(e: BaseException, path: str | None) -> bool:
    """Whether `e` came from running the file `path` (the config file, while it loaded)."""
    if path is None:
        return False
    target = os.path.abspath(path.split(":", 1)[0])
    return any(
        os.path.abspath(frame.f_code.co_filename) == target
        for frame, _ in traceback.walk_tb(e.__traceback__)
    )


def _not_a_config(path: str | None) -> str | None:
    """The sentence for a config file whose get_config() returned no ConfigDict."""
    if path is None:
        return None
    # Overrides on what is no ConfigDict fail while the file's flag parses: load it again.
    config = CONFIG.value if flags.FLAGS["config"].present else _get_config(path)
    if config is _UNREADABLE or type(config).__name__ == "_ErrorConfig":
        return None
    if isinstance(config, ml_collections.ConfigDict):
        return None
    what = "None (a missing return?)" if config is None else f"a {type(config).__name__}"
    return (
        f"{path}'s get_config() returned {what}, not an ml_collections ConfigDict; start it "
        "from tree_grpo_jax.config.base_config()."
    )


def _load_failure(message: str, path: str | None) -> str:
    """`message` (ml_collections' text, with the traceback of a config file that raised)
    as one sentence: the exception's own line, and the file's line that raised it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    where = ""
    if path is not None:
        target = os.path.abspath(path.split(":", 1)[0])
        for line in lines:
            match = re.match(r'File "(.+)", line (\d+)', line)
            if match and os.path.abspath(match.group(1)) == target:
                where = f" (line {match.group(2)})"
    return f"the config file {path!r} could not be loaded{where}: {lines[-1].rstrip('.')}."


def _config_text(config) -> str:
    """Every field with its value, one `section.field: value` a line (sorted, as ConfigDict
    keeps them)."""
    from tree_grpo_jax.config import flatten

    return "".join(
        f"{path}: {value!r}\n" for path, value in flatten(config, leaves_only=True).items()
    )


def _print_and_exit(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head` has what it asked for; no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


# absl's help flags, which print and exit 1; ours print the command's own text and exit 0.
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def _command_module():
    """The command's module in tree_grpo_jax.cli (`python -m tree_grpo_jax.plan` runs
    tree_grpo_jax/plan.py, whose `run` is tree_grpo_jax.cli.plan's), or `__main__`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name.rsplit(".", 1)[-1] if spec is not None else ""
    return sys.modules.get(f"tree_grpo_jax.cli.{name}") or main


def help_text() -> str:
    """The command's docstring and its flags (absl's own text for each)."""
    module = _command_module()
    doc = (getattr(module, "__doc__", None) or "").strip()
    modules = [__name__] + ([module.__name__] if module is not None else [])
    listed = "\n".join(flags.FLAGS.module_help(m) for m in dict.fromkeys(modules))
    listed = "\n".join(line for line in listed.splitlines() if not line.endswith(":"))
    return f"{doc}\n\nflags:\n{listed}\n"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with the config file loaded and its overrides applied here, so
    that a missing or broken file, an unknown field or a wrong type is one sentence."""
    path = _config_path(argv)
    words = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(w in HELP_FLAGS or w.split("=", 1)[0] in HELP_FLAGS for w in words):
        _print_and_exit(help_text())
    try:
        rest = flags.FLAGS(argv)
        config = CONFIG.value
        if path is not None and not isinstance(config, ml_collections.ConfigDict):
            getattr(config, "keys", None)  # a file that failed to load: its stand-in raises here
    except KeyboardInterrupt:  # Ctrl-C, or the file itself raising it, while it loads
        fail(
            f"the config file {path!r} was interrupted (KeyboardInterrupt) while loading; "
            "nothing was written.",
            EXIT_SIGNAL["SIGINT"],
        )
    except SystemExit as e:
        if not _raised_in(e, path):  # --help
            raise
        code = "" if e.code is None else repr(e.code)
        fail(
            f"the config file {path!r} called sys.exit({code}) while loading; its "
            "get_config() must return the config.",
            EXIT_BAD_INPUT,
        )
    except flags.UnrecognizedFlagError as e:
        fail(_not_a_config(path) or _unknown_flag(e, argv), EXIT_BAD_INPUT)
    except flags.Error as e:
        message = str(e)
        if "Error whilst parsing config file" in message:  # ml_collections' wrapped traceback
            fail(_load_failure(message, path), EXIT_BAD_INPUT)
        message = first_line(e)
        message = re.sub(r"^(FATAL )?Flags parsing error: ", "", message)
        if "could not convert" in message or "invalid literal" in message:
            flag = message.split(":", 1)[0].replace("flag ", "")
            message = f"{flag} has the wrong type for that field ({message.split(': ')[-1]})"
        fail(_not_a_config(path) or message.rstrip(".") + ".", EXIT_BAD_INPUT)
    except (AttributeError, KeyError) as e:
        if _raised_in(e, path):
            fail(_load_failure(f"{type(e).__name__}: {first_line(e)}", path), EXIT_BAD_INPUT)
        if path is not None and not flags.FLAGS["config"].present and "get_config" in str(e):
            fail(
                f"the config file {path!r} defines no get_config(); start it from "
                "tree_grpo_jax.config.base_config().",
                EXIT_BAD_INPUT,
            )
        fail(_not_a_config(path) or _unknown_field(argv), EXIT_BAD_INPUT)
    except Exception as e:  # noqa: BLE001 - the config file itself failed
        if isinstance(e, OSError) and path and not os.path.isfile(path):
            fail(_missing_config(path), EXIT_BAD_INPUT)
        if _not_a_config(path):
            fail(_not_a_config(path), EXIT_BAD_INPUT)
        reason = e.msg if isinstance(e, SyntaxError) else first_line(e)
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        fail(
            f"the config file {path!r} could not be loaded{where}: {type(e).__name__}: {reason}.",
            EXIT_BAD_INPUT,
        )
    sentence = _not_a_config(path) or (_stray(rest[1], argv) if len(rest) > 1 else None)
    if sentence:
        fail(sentence, EXIT_BAD_INPUT)
    if PRINT_CONFIG.value:
        if path is None:
            fail("give the config file to print, e.g. --config=configs/tiny.py.", EXIT_BAD_INPUT)
        _print_and_exit(_config_text(CONFIG.value))
    if path is not None:
        from tree_grpo_jax import config as cfg  # only now: it starts JAX

        try:
            cfg.check_shape(CONFIG.value, source=f"{path}'s get_config()")
        except cfg.ConfigError as e:
            fail(str(e), EXIT_BAD_INPUT)
    return rest
