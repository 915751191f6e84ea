"""Every setting has one declaration (core/settings.py), and every declaration refuses a
value outside its range, choices or type in a sentence naming the field: the cases are made
from the declarations, so a setting added without one, or a range that stopped being checked,
fails here."""

import importlib
import pathlib

import ml_collections
import pytest

from configs import tiny
from tree_grpo_jax import config as cfg
from tree_grpo_jax.config import reference
from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.rewards import registry as rewards
from tree_grpo_jax.rewards import remote_settings

PRESETS = sorted(
    p.stem
    for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.py")
    if p.stem != "__init__"
)
DECLARED = cfg.declared_settings()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_setting_of_a_preset_is_declared(preset):
    config = importlib.import_module(f"configs.{preset}").get_config()
    missing = set(cfg.flatten(config, leaves_only=True)) - set(DECLARED)
    assert not missing, f"{preset}: no declaration for {sorted(missing)}"


def test_every_declaration_is_a_field_of_the_schema():
    fields = cfg.flatten(cfg.base_config(), leaves_only=True)
    assert set(DECLARED) <= set(fields), set(DECLARED) - set(fields)
    for path, setting in DECLARED.items():
        assert setting.any_type or type(fields[path]) is type(setting.default), path


def _wrong_type(default):
    """A value of another type than the default's."""
    if isinstance(default, bool):
        return "yes"
    if isinstance(default, (int, float)):
        return "3"
    return 3  # a string or a tuple


def _candidates(setting: Setting) -> list:
    """Values outside the declared range or choices (or, without one, of the wrong type)."""
    if setting.choices is not None:
        numbers = [c for c in setting.choices if not isinstance(c, str)]
        return [max(numbers) + 1] if numbers else ["not_a_choice"]
    default = setting.default
    step = 1 if isinstance(default, int) else 0.5
    values = []
    if setting.low is not None:
        lowest = min([setting.low, *setting.also])
        values.append(type(default)(lowest if setting.open_low else lowest - step))
    if setting.high is not None:
        values.append(type(default)(setting.high if setting.open_high else setting.high + step))
    if values:
        return values
    if setting.check is not None:  # the setting's own sentence: typical hostile values
        if isinstance(default, tuple):
            return [(-1,), ("",), (0, 0)]
        return ["not_a_value", 0, 2, -1]
    return [_wrong_type(default)]


def _refusal(path: str, value) -> str | None:
    """The sentence the tiny config with `path` set to `value` is refused with, or None."""
    d = tiny.get_config().to_dict()  # a ConfigDict keeps a field's type: rebuild it
    *parents, field = path.split(".")
    node = d
    for part in parents:
        node = node[part]
    node[field] = value
    try:
        cfg.validate(ml_collections.ConfigDict(d), known_rewards=rewards.available_rewards())
    except cfg.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("path", sorted(DECLARED))
def test_every_declaration_refuses_a_value_outside_its_range(path):
    setting = DECLARED[path]
    refused = [(v, _refusal(path, v)) for v in _candidates(setting)]
    named = [(v, s) for v, s in refused if s is not None and s.startswith(path + " ")]
    assert named, f"{path}: no candidate refused with a sentence naming it: {refused}"
    if setting.phrase():
        assert all(s and s.startswith(f"{path} must be") for _, s in refused), refused


def test_the_range_sentences_are_made_from_the_declaration():
    assert Setting(1, low=1).sentence("a.b", 0) == "a.b must be at least 1, got 0."
    assert Setting(1.0, low=0, open_low=True).sentence("a.b", 0.0) == (
        "a.b must be positive, got 0.0."
    )
    assert Setting(0.5, low=0, high=1, open_high=True, note="why").sentence("a.b", 1.0) == (
        "a.b must be in [0, 1) (why), got 1.0."
    )
    mesh = Setting(1, low=1, also=(-1,), note="every remaining device")
    assert mesh.sentence("m", -1) is None
    assert mesh.sentence("m", 0) == "m must be -1 (every remaining device) or at least 1, got 0."
    assert Setting("a", choices=("a", "b")).sentence("s", "c") == (
        "s must be one of a, b, got 'c'."
    )
    assert Setting(0, choices=(0, 1)).sentence("s", 2) == "s must be 0 or 1, got 2."
    assert Setting(0, low=0, high=2**32, open_high=True).phrase() == "in [0, 2**32)"


# Numbers any finite value of which is meaningful (a mean, a signed temperature).
ANY_FINITE = {"dpo.logit_mean", "crd.weight_temp"}


def test_every_number_declares_its_range():
    free = {
        path
        for path, s in DECLARED.items()
        if isinstance(s.default, (int, float)) and not isinstance(s.default, bool)
        if not s.has_range
    }
    assert free == ANY_FINITE, free ^ ANY_FINITE


@pytest.mark.parametrize("field", sorted(remote_settings.SETTINGS))
def test_every_remote_setting_refuses_a_value_outside_its_range(field):
    """A served reward's settings (`reward_options.remote.<name>`) are declared the same way."""
    where = "reward_options.remote.judge"
    for value in _candidates(remote_settings.SETTINGS[field]):
        said = remote_settings.check_settings("judge", {"url": "http://host:1/score", field: value})
        assert said is not None and said.startswith(f"{where}.{field} "), (value, said)


def test_the_settings_page_is_made_from_the_declarations():
    page = pathlib.Path(__file__).parents[2] / "docs" / "settings.md"
    assert page.read_text() == reference.markdown(), (
        "docs/settings.md differs from the declarations; write it again with "
        "`python -m tree_grpo_jax.config.reference > docs/settings.md`"
    )
