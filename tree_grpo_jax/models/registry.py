"""Model families as registered records, the model-side twin of the method table.

A `ModelFamily` says everything the rest of the library needs to know about a family: the
`model.name` values it loads, its loader, its own config sub-section (`model.<family>`),
whether it needs `model.path`, its LoRA default targets, how to recognise its folders and
how it exports, the prompt sets and rewards of its own world (the tiny model's digits),
how to describe its model as shapes alone, for planning a run's memory (`abstract`), and,
for one family, the model, prompts and reward of the config's default run.
Each sub-package of `models/` registers one in its `family.py`; the
trainer, the config checks, `lora` and `export` look families up here and never name one.

    from tree_grpo_jax.models import registry
    registry.register(registry.ModelFamily(name="toy", model_names=("toy",), load=load_toy))

The built-in families are found on first look-up: every `models/<family>/family.py`. A
family's record names its loaders as `"module:attribute"` targets (`deferred`, `path_loader`,
`deferred_export`), imported on first use, so that finding the families imports no model code.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tree_grpo_jax.core.settings import Setting
from tree_grpo_jax.errors import reason
from tree_grpo_jax.weights.files import ModelLoadError


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What a family's loader is given: the config's choices, as plain values."""

    name: str  # the model.name asked for (a family may load several)
    path: str  # model.path ("" when the family needs none)
    dtype: Any  # the compute dtype (a jnp dtype)
    seed: int  # the run's seed (for families that can build random weights)
    options: Any  # the family's own sub-section `model.<family>` (its defaults if absent)
    # model.remat as a `base.REMAT_MODES` name: a family whose denoiser can recompute each
    # block in the backward pass builds it so (and says so in the model's `remat`); others
    # ignore it
    remat: str = "none"
    # model.scan_layers: a family with runs of identical blocks scans them; others ignore it
    scan_layers: bool = True
    attention: str = "xla"  # model.attention: a `models.attention` backend name


@dataclasses.dataclass(frozen=True)
class FamilyExport:
    """How a family's trained denoiser goes back into a diffusers pipeline folder."""

    component: str  # the pipeline's denoiser folder, also the LoRA key prefix ("unet")
    # base folder (local path or hub id) -> (the folder, a `models.export.Denoiser`), checked
    base_denoiser: Callable[[str], tuple[Path, Any]]
    # base folder -> its denoiser's weights in float32 (a LoRA export with --merge adds to them)
    base_params: Callable[[str], dict]
    # the denoiser's module lists (Flax `name_N` is PyTorch `name.N`) for its LoRA keys;
    # None: diffusers' usual ones (`weights.convert.DIFFUSERS_LIST_NAMES`)
    list_names: frozenset | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str  # the family, also the name of its config sub-section `model.<name>`
    model_names: tuple[str, ...]  # the model.name values it loads
    load: Callable[[LoadRequest], Any]  # -> a `base.TextToImageModel`
    needs_path: bool = False  # True: model.path must name its folder
    path_hint: str = ""  # what model.path should be, ending the sentence when it is missing
    # the defaults of `model.<name>` (a ConfigDict); made by `core.settings.defaults_of`,
    # it carries the fields' declarations (types, ranges), which the config checks read
    options: Callable[[], Any] | None = None
    # `model.<name>` -> one sentence for a rule spanning its fields, or None
    check_options: Callable[[Any], str | None] | None = None
    # fields of the shared `model` section that moved into `model.<name>` (old -> new path)
    moved_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    lora_targets: tuple[str, ...] = ()  # LoRA's default target modules (Flax names)
    recognizes: Callable[[Path], bool] | None = None  # a local folder has this family's layout
    export: FamilyExport | None = None  # None: nothing to export into
    prompt_sets: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # rewards of the family's own world, for the reward registry: () -> {name: (fn, on_host)},
    # or (fn, on_host, media) for one that takes videos whole (see `rewards.registry`)
    rewards: Callable[[], Mapping[str, tuple[Callable, bool]]] | None = None
    # -> a `models.abstract.AbstractModel`: the model as shapes, from its JSON configs or a
    # built-in release (`model.path=builtin:<name>`); None: its runs cannot be planned
    abstract: Callable[[LoadRequest], Any] | None = None
    # () -> decoded samples (images [B, H, W, C], videos [B, T, H, W, C]) in [0, 1] ->
    # features [B, D]: what the family's diversity measure compares when no CLIP is
    # configured; None: pixels
    image_features: Callable[[], Callable] | None = None
    # its denoiser is a transformer whose blocks carry [B, tokens, width] and attend through
    # `models.attention`: `mesh.sequence` may split one sample's tokens over devices
    token_blocks: bool = False
    # the config fields of the package's default run, when it is this family's (dotted path ->
    # value: the tiny family's model, prompts and reward); one family at most says them
    default_run: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # fields of `model.<name>` that size one sample (a video's sides and frames): the memory
    # checks name them when even one prompt's samples cannot fit
    sample_settings: tuple[str, ...] = ()


def deferred(target: str) -> Callable[[], Any]:
    """`"package.module:attribute"` -> a function returning that attribute, importing its
    module on the first call."""
    module, _, attribute = target.partition(":")

    def get():
        return getattr(importlib.import_module(module), attribute)

    get.__qualname__ = get.__name__ = attribute
    return get


def lazy(target: str) -> Callable:
    """`"package.module:function"` -> that function, its module imported on the first call."""
    get = deferred(target)

    def call(*args, **kwargs):
        return get()(*args, **kwargs)

    call.__qualname__ = call.__name__ = get.__name__
    return call


def path_loader(
    target: str, option_names: tuple[str, ...] = (), remat: bool = False
) -> Callable[[LoadRequest], Any]:
    """A `load` (or `abstract`) for a loader taking a folder: `target(request.path,
    dtype=request.dtype, **{name: options.<name>})`, and with `remat` (a transformer's
    loader) `remat`, `scan_layers` and `attention`, the request's."""
    loader = lazy(target)

    def load(request: LoadRequest):
        arguments = {name: getattr(request.options, name) for name in option_names}
        if remat:
            arguments["remat"] = request.remat
            arguments["scan_layers"] = request.scan_layers
            arguments["attention"] = request.attention
        return loader(request.path, dtype=request.dtype, **arguments)

    return load


def pipeline_family(
    name: str,
    options: Callable[[], Any],
    list_names: frozenset | None = None,
    **fields,
) -> ModelFamily:
    """The record of a family whose sub-package `models/<name>/` loads one diffusers pipeline
    folder (`model.path`) around a transformer: `load.load_<name>` and
    `abstract.abstract_<name>` take every field of `model.<name>` (`options()`) and the
    run-time ones, `export` exports into its `transformer/`; `fields` are the rest of the
    record (`path_hint`, `check_options`, `lora_targets`, ...); `list_names` are the
    transformer's module lists, for its LoRA keys."""
    package = f"tree_grpo_jax.models.{name}"
    taken = tuple(options())
    return ModelFamily(
        name=name,
        model_names=(name,),
        load=path_loader(f"{package}.load:load_{name}", taken, remat=True),
        needs_path=True,
        options=options,
        export=deferred_export("transformer", f"{package}.export", list_names),
        abstract=path_loader(f"{package}.abstract:abstract_{name}", taken, remat=True),
        **{"token_blocks": True, **fields},
    )


def square_resolution_setting(multiple: int | None = None) -> Setting:
    """`resolution` of a text-to-image family whose pipeline draws 1024-pixel squares by
    default through an 8x VAE: 0 keeps that default; `multiple` is the side's rule where the
    family refuses other sides (one that rounds them names none)."""
    rule = f", a multiple of {multiple}" if multiple else ""
    return Setting(
        0,
        f"square image side in pixels{rule} (0: 1024); latents are 1/8 of it",
        low=0,
        note="0: 1024 px",
    )


def static_shift_setting(meaning: str, note: str = "0: the folder's schedule") -> Setting:
    """`shift` of a flow-matching family: > 0 is a static sigma shift in place of the
    folder's schedule, 0 keeps the folder's; `meaning` says so in the family's words."""
    return Setting(0.0, meaning, low=0, note=note)


def deferred_export(
    component: str, module: str, list_names: frozenset | None = None
) -> FamilyExport:
    """The `FamilyExport` of a module with `base_denoiser` and `base_params` functions."""
    return FamilyExport(
        component, lazy(f"{module}:base_denoiser"), lazy(f"{module}:base_params"), list_names
    )


def component_class_is(
    component: str, classes: tuple, unreadable: bool = False
) -> Callable[[Path], bool]:
    """A `recognizes`: the folder has `component/` and its `config.json` names one of
    `classes` (None: no `_class_name`); `unreadable` when the config cannot be read."""

    def recognizes(folder: Path) -> bool:
        where = Path(folder) / component
        if not where.is_dir():
            return False
        try:
            config = json.loads((where / "config.json").read_text())
        except (OSError, ValueError):
            return unreadable
        return config.get("_class_name") in classes if isinstance(config, dict) else unreadable

    return recognizes


_FAMILIES: dict[str, ModelFamily] = {}
_discovered = False


def register(family: ModelFamily, *, overwrite: bool = False) -> ModelFamily:
    """Adds a family; a family or model name already taken needs `overwrite=True`."""
    if not family.model_names:
        raise ValueError(f"model family {family.name!r} loads no model name.")
    taken = {n: f.name for f in _FAMILIES.values() if f.name != family.name for n in f.model_names}
    clash = [n for n in family.model_names if n in taken]
    if not overwrite and (family.name in _FAMILIES or clash):
        what = f"family {family.name!r}" if family.name in _FAMILIES else f"model {clash[0]!r}"
        raise ValueError(f"a {what} is already registered; pass overwrite=True.")
    for name in clash:  # overwriting takes the model names over from their old family
        old = _FAMILIES[taken[name]]
        _FAMILIES[old.name] = dataclasses.replace(
            old, model_names=tuple(n for n in old.model_names if n != name)
        )
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes a family (tests that register toys clean up with this)."""
    _FAMILIES.pop(name, None)


def _discover() -> None:
    """Imports every `models/<family>/family.py` once: each registers its family.

    All or nothing: when one of them fails to import, the families registered on the way are
    dropped again and the error raised, so every later call raises it too rather than answer
    with part of the families ("unknown model.name" for a family that merely failed)."""
    global _discovered
    if _discovered:
        return
    before, imported = dict(_FAMILIES), []
    package = importlib.import_module("tree_grpo_jax.models")
    try:
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if not info.ispkg:
                continue
            name = f"tree_grpo_jax.models.{info.name}.family"
            fresh = name not in sys.modules
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise
                continue
            if fresh:
                imported.append(name)
    except BaseException:
        _FAMILIES.clear()
        _FAMILIES.update(before)
        for name in imported:  # imported again, and so registered again, by the next call
            sys.modules.pop(name, None)
        raise
    _discovered = True


def families() -> tuple[ModelFamily, ...]:
    """The registered families by name: the same order whichever a process imported first."""
    _discover()
    return tuple(sorted((f for f in _FAMILIES.values() if f.model_names), key=lambda f: f.name))


def model_names() -> tuple[str, ...]:
    """Every model.name some family loads, family by family."""
    return tuple(n for f in families() for n in f.model_names)


def default_run() -> dict[str, Any]:
    """The config fields of the package's default run: its family's `default_run` ({} when no
    family says them; ValueError when several do)."""
    runs = {f.name: f.default_run for f in families() if f.default_run}
    if len(runs) > 1:
        raise ValueError(
            f"model families {', '.join(sorted(runs))} each give the default run; one may."
        )
    return dict(next(iter(runs.values()), {}))


def family_of(model_name: str) -> ModelFamily:
    """The family that loads `model_name`; ValueError with one sentence when none does."""
    for family in families():
        if model_name in family.model_names:
            return family
    raise ValueError(
        f"unknown model.name {model_name!r}; choose one of {', '.join(model_names())}."
    )


def options_of(family: ModelFamily, model_config) -> Any:
    """The family's sub-section of `model_config`, or its defaults when the config has none."""
    section = getattr(model_config, family.name, None)
    if section is None and family.options is not None:
        section = family.options()
    return section


def sample_settings(model_config) -> str:
    """The settings that size one sample of `model_config`'s family with their values, each
    `model.<family>.<field>=<value>`, joined by " or "; "" when it has none."""
    try:
        family = family_of(model_config.name)
    except ValueError:
        return ""
    section = options_of(family, model_config)
    if section is None:
        return ""
    return " or ".join(
        f"model.{family.name}.{field}={getattr(section, field)!r}"
        for field in family.sample_settings
    )


def family_of_folder(path: str) -> ModelFamily:
    """The exportable family whose layout a local folder has (one sentence when none)."""
    folder = Path(path).expanduser()
    exportable = [f for f in families() if f.export is not None and f.recognizes is not None]
    if not folder.exists():
        raise ModelLoadError(
            f"model folder {folder} does not exist; pass the base pipeline folder as --model_path."
        )
    if folder.is_dir():
        for family in exportable:
            if family.recognizes(folder):
                return family
    layouts = ", ".join(f"{f.export.component}/ ({f.name})" for f in exportable)
    raise ModelLoadError(
        f"model folder {folder} has none of the layouts export knows ({layouts}); pass the "
        "base pipeline folder as --model_path."
    )


def _request(family: ModelFamily, model_config, seed: int, attention: str = "") -> LoadRequest:
    from tree_grpo_jax.models.base import DTYPES, remat_mode

    return LoadRequest(
        name=model_config.name,
        path=getattr(model_config, "path", "") or "",
        dtype=DTYPES[getattr(model_config, "compute_dtype", "float32")],
        seed=seed,
        options=options_of(family, model_config),
        remat=remat_mode(getattr(model_config, "remat", False)),
        scan_layers=bool(getattr(model_config, "scan_layers", True)),
        attention=attention or getattr(model_config, "attention", "xla"),
    )


def load_model(model_config, seed: int = 0):
    """The `TextToImageModel` that `model_config` (the config's `model` section) names."""
    import jax

    from tree_grpo_jax.models import attention

    family = family_of(model_config.name)
    request = _request(family, model_config, seed)
    sentence = attention.check_platform(request.attention, jax.default_backend())
    if sentence is not None:  # before any weight is read
        raise ModelLoadError(sentence)
    try:
        return family.load(request)
    except ModelLoadError:
        raise
    except BUILD_ERRORS as e:  # a config.json whose keys or values do not build a model
        raise ModelLoadError(
            f"the {family.name} model in {request.path or model_config.name!r} could not be "
            f"built from its folder's config files ({config_error(e)}); check the "
            "components' config.json against the diffusers release they came from."
        ) from e


# What building a network from config values that do not fit raises (shapes that do not
# broadcast, a string where a size belongs, a missing key).
BUILD_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError)


def config_error(e: BaseException) -> str:
    """`Type: first line` of an error raised while building from config files."""
    return reason(e, limit=160)


def abstract_model(model_config, seed: int = 0):
    """The `models.abstract.AbstractModel` of what `model_config` names: shapes only, no
    weight read. ModelLoadError with one sentence when its family cannot say them.

    Its attention is the kernel the run will use where this platform has it; a kernel that
    exists only on another platform is planned as "blockwise" (the same O(L) memory order),
    and the model's `attention_note` says so (`models.attention.plan_backend`)."""
    import jax

    from tree_grpo_jax.models import attention

    family = family_of(model_config.name)
    if family.abstract is None:
        raise ModelLoadError(
            f"model family {family.name!r} cannot describe its model without loading it, so "
            "its runs cannot be planned."
        )
    asked = getattr(model_config, "attention", "xla")
    planned, note = attention.plan_backend(asked, jax.default_backend())
    model = family.abstract(_request(family, model_config, seed, planned))
    return dataclasses.replace(model, attention_note=note) if note else model
