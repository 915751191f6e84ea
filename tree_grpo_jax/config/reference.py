"""docs/settings.md, made from the settings' declarations: every setting's default, what it
may be and what it means, one table per section. A test holds the page to this text; after
changing a declaration, write it again with

    python -m tree_grpo_jax.config.reference > docs/settings.md
"""

from __future__ import annotations

from tree_grpo_jax.config.schema import declared_settings
from tree_grpo_jax.core.settings import Setting, flat

INTRO = """# Settings

Every setting of a run's config, with its default, what it may be and what it means, made
from the settings' declarations (`tree_grpo_jax/core/settings.py`: `Setting`) by
`python -m tree_grpo_jax.config.reference`. A value outside what a setting may be is
refused before anything starts, in one sentence naming the field; rules spanning several
settings (a window inside the sampling steps, say) are checked beside. Set any of them on
the command line, e.g. `--config.train.learning_rate=3e-5`, or in a config file
([Getting started](getting-started.md)); `--print_config` lists a config's values.
"""

_KINDS = {bool: "True or False", int: "a whole number", float: "a number", str: "a string"}


def allowed(setting: Setting) -> str:
    """What a setting may be, in words."""
    default = setting.default
    if isinstance(default, tuple):
        kind = setting.element.__name__ + "s" if setting.element else "values"
        return f"a tuple of {kind}"
    phrase = setting.phrase()
    if not phrase:
        return "its own rule" if setting.check else _KINDS[type(default)]
    note = f" ({setting.note})" if setting.note else ""
    if setting.also:
        return f"{setting.also[0]!r}{note} or {phrase}"
    return f"{phrase}{note}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The page: the shared sections, then the registered records' (model families,
    objectives, rewards), then a served reward's."""
    from tree_grpo_jax.rewards import remote_settings

    declared = dict(declared_settings())
    for path, setting in flat(remote_settings.SETTINGS, "reward_options.remote.<name>.").items():
        declared[path] = setting
    lines = [INTRO]

    sections: dict[str, list[str]] = {}  # in the order first met
    for path in declared:
        sections.setdefault(path.rpartition(".")[0], []).append(path)
    for section, paths in sections.items():
        title = f"`{section}`" if section else "The top level"
        lines += [
            "",
            f"## {title}",
            "",
            "| setting | default | may be | meaning |",
            "|---|---|---|---|",
        ]
        for path in paths:
            s = declared[path]
            field = path[len(section) + 1 :] if section else path
            lines.append(
                f"| `{field}` | `{_cell(repr(s.default))}` | {_cell(allowed(s))} | "
                f"{_cell(s.meaning)} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
