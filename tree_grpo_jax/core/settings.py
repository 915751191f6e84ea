"""One typed declaration per config setting: its default, its type (a tuple's element type),
its range or choices and what it means. The schema's defaults, the type checks and the range
sentences ("<field> must be ...") are all derived from it; rules that span several fields
stay with their owner.

    SETTINGS = {
        "beta": Setting(1.0, "the implicit policies' step", low=0, open_low=True),
        "loss_type": Setting("mse", choices=("mse", "bce")),
    }
    options = defaults_of(SETTINGS)  # () -> the section's ConfigDict at its defaults
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting. `low` / `high` bound a number (`open_*`: the bound itself is refused),
    `choices` lists the values a setting may take, `also` values allowed besides the range
    (`0` meaning off, say); `note` is said in brackets after the range in the sentence (after
    the first `also` value when there is one). A tuple's `element` type and its command-line
    `example` are the type check's. `check(value)` is a sentence of the setting's own for a
    value its range cannot describe, checked after the range."""

    default: Any
    meaning: str = ""
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple | None = None
    also: tuple = ()
    note: str = ""
    element: type | None = None
    example: str = ""
    check: Callable[[Any], str | None] | None = None
    any_type: bool = False  # takes values of more than one type (its `check` says which)

    @property
    def has_range(self) -> bool:
        return (
            self.low is not None
            or self.high is not None
            or self.choices is not None
            or self.check is not None
        )

    def phrase(self) -> str:
        """What the setting must be: "at least 1", "in (0, 1]", "mean or sum", ..."""
        if self.choices is not None:
            names = [_shown(c) for c in self.choices]
            if len(names) == 2 and not any(isinstance(c, str) for c in self.choices):
                return f"{names[0]} or {names[1]}"
            return f"one of {', '.join(names)}"
        low, high = self.low, self.high
        if low is not None and high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            return f"in {left}{_number(low)}, {_number(high)}{right}"
        if low is not None:
            if self.open_low and low == 0:
                return "positive"
            if self.open_low:
                return f"above {_number(low)}"
            if low >= 1:
                return f"at least {_number(low)}"
            return f">= {_number(low)}"
        if high is not None:
            return f"below {_number(high)}" if self.open_high else f"<= {_number(high)}"
        return ""

    def within(self, value) -> bool:
        if value in self.also:
            return True
        if self.choices is not None:
            return value in self.choices
        low, high = self.low, self.high
        if low is not None and (value < low or (self.open_low and value == low)):
            return False
        return high is None or not (value > high or (self.open_high and value == high))

    def sentence(self, path: str, value, show: Callable[[Any], str] = repr) -> str | None:
        """One sentence when `value` (of the setting's type, checked before) is outside the
        range or choices, or refused by `check`; else None. `show` quotes the value."""
        if self.phrase() and not self.within(value):
            if self.also:
                said = f"{_shown(self.also[0])}" + (f" ({self.note})" if self.note else "")
                return f"{path} must be {said} or {self.phrase()}, got {show(value)}."
            note = f" ({self.note})" if self.note else ""
            return f"{path} must be {self.phrase()}{note}, got {show(value)}."
        if self.check is not None:
            return self.check(value)
        return None


def _number(x) -> str:
    if isinstance(x, int) and x >= 2**16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"  # a bit width reads better than its digits
    return f"{x:g}" if isinstance(x, float) else str(x)


def _shown(value) -> str:
    return value if isinstance(value, str) else repr(value)


Settings = Mapping[str, "Setting | Settings"]


def section(settings: Settings) -> ml_collections.ConfigDict:
    """A section of the config at its declared defaults (a nested mapping: a sub-section)."""
    s = ml_collections.ConfigDict()
    for name, setting in settings.items():
        if isinstance(setting, Mapping):
            s[name] = section(setting)
        elif setting.any_type:
            s[name] = ml_collections.FieldReference(setting.default, field_type=object)
        else:
            s[name] = setting.default
    return s


def defaults_of(settings: Settings) -> Callable[[], ml_collections.ConfigDict]:
    """A record's `options`: () -> its section at the declared defaults; the declarations
    ride along as its `settings`, for the checks."""

    def options() -> ml_collections.ConfigDict:
        return section(settings)

    options.settings = settings
    return options


def flat(settings: Settings, prefix: str = "") -> dict[str, Setting]:
    """path -> Setting of every declaration below `settings`."""
    out = {}
    for name, setting in settings.items():
        if isinstance(setting, Mapping):
            out.update(flat(setting, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = setting
    return out


def describe(value) -> str:
    """A value as a sentence quotes it: a string as such, a section by its kind."""
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, ml_collections.ConfigDict):
        return "a section"
    if isinstance(value, (tuple, list)):
        return repr(tuple(value))
    if value is None or isinstance(value, numbers.Number):
        return repr(value)
    return f"a {type(value).__name__}"


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
