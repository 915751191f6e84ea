"""What the transformer families' pipelines share: a family's trainable diffusers component
(SD3's or FLUX's `transformer/`) read from and exported to a pipeline folder (the class-name
check, the module built from its `config.json`, its PyTorch safetensors converted to Flax
params in numpy, the `models.export.Denoiser` that writes it back), the loaded model's
record, the flow-matching scheduler's check and the shifted schedule FLUX.1 and Z-Image
set it up with (`ShiftedFlowScheduleConfig`), and the first steps a text-to-image family's
loader and planner take on its folder (`ImageFolder`: configs read and checked, the sample
shape and schedule, the transformer loaded or built).

A family declares one `Component` with its own names (and an `ImageFolder` with its own
rules); the reading, checking and writing is here once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import first_line
from tree_grpo_jax.models import export
from tree_grpo_jax.models.base import (
    FlowSigmasScheduleConfig,
    ModelLoadError,
    TextToImageModel,
    cast_floats,
)
from tree_grpo_jax.weights import convert, files, stacking

# What a hub download of a diffusers pipeline needs: configs, tokenizers, safetensors.
PIPELINE_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model", "*/*.safetensors"]
FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
# Its options that neither family's sigmas implement, with the one value they assume.
FLOW_SCHEDULER_FIXED = {
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "invert_sigmas": False,
    "shift_terminal": None,
    "stochastic_sampling": False,
}
# The configs a transformer family's planner reads first (`abstract.read_configs`).
TRANSFORMER_CONFIG = "transformer/config.json"
VAE_CONFIG = "vae/config.json"
SCHEDULER_CONFIG = "scheduler/scheduler_config.json"
PIPELINE_CONFIGS = (TRANSFORMER_CONFIG, VAE_CONFIG, SCHEDULER_CONFIG)
MAX_PREPARED_PROMPTS = 1024  # prompts encoded ahead so the text encoders can be released


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TransformerModel(TextToImageModel):
    """A loaded pipeline folder whose denoiser is a transformer."""

    path: Path  # the local folder (a hub id resolved to its snapshot)
    transformer: Any  # the Flax module `denoise` applies
    transformer_config: dict
    vae_config: dict
    text_encoders: Any  # the family's `text_encoders.PromptCache`


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What a transformer family's loader and planner take as keywords: the run-time fields
    every family shares, named as the config names them, and the family's own settings
    (`model.<family>`, defaulting to its record's `options()`), read as attributes alike."""

    own: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # model.<family>
    decode_batch_size: int = 4  # latents through the VAE decoder at once
    remat: str = "none"  # model.remat as a `base.REMAT_MODES` name
    scan_layers: bool = True  # model.scan_layers: runs of identical blocks as one scan
    attention: str = "xla"  # model.attention: a `models.attention` backend name

    @classmethod
    def of(cls, defaults: Mapping[str, Any], **options) -> LoadOptions:
        """`options` over the family's `defaults`; TypeError for a name neither holds."""
        shared = {f.name for f in dataclasses.fields(cls)} - {"own"}
        unknown = sorted(set(options) - shared - set(defaults))
        if unknown:
            raise TypeError(f"unexpected load option(s) {', '.join(unknown)}.")
        values = {**defaults, **options}
        own = {k: v for k, v in values.items() if k not in shared}
        return cls(own=own, **{k: v for k, v in values.items() if k in shared})

    def __getattr__(self, name: str):
        own = self.__dict__.get("own", {})
        if name in own:
            return own[name]
        raise AttributeError(f"LoadOptions has no option {name!r}.")

    def module_options(self) -> dict:
        """The transformer module's run-time fields."""
        return dict(remat=self.remat, scan_layers=self.scan_layers, attention=self.attention)


def model_fields(root: Path, loaded, vae_config: dict, encoders, options: LoadOptions) -> dict:
    """The fields every `TransformerModel` of a pipeline folder `root` fills alike:
    `loaded` is `Component.load`'s (module, params, config), `encoders` the family's
    prompt cache (its `conditioning` encodes the prompts), `options` give `remat`."""
    module, params, transformer_config = loaded
    return dict(
        name=root.name,
        params=params,
        encode_prompts=encoders.conditioning,
        path=root,
        transformer=module,
        transformer_config=transformer_config,
        vae_config=vae_config,
        text_encoders=encoders,
        remat=options.remat,
    )


def abstract_model(configs, transformer, dtype, options: LoadOptions, **fields):
    """The `models.abstract.AbstractModel` of a pipeline's `configs` (`read_configs`) around
    `transformer`: its params as shapes in `dtype`, the model's `remat` from `options`;
    `fields` are the rest (sample shape, denoise, conditioning, schedule, decoder)."""
    from tree_grpo_jax.models.abstract import AbstractModel

    return AbstractModel(
        name=Path(configs.where).name,
        source=configs.source,
        params=jax.eval_shape(lambda p: cast_floats(p, dtype), abstract_params(transformer)),
        remat=options.remat,
        **fields,
    )


# The shifted schedule's scheduler options, with the one value its sigmas assume.
SHIFTED_SCHEDULER_FIXED = {**FLOW_SCHEDULER_FIXED, "time_shift_type": "exponential"}


@dataclasses.dataclass(frozen=True)
class ShiftedFlowScheduleConfig(FlowSigmasScheduleConfig):
    """diffusers' FlowMatchEulerDiscreteScheduler as FluxPipeline and ZImagePipeline set it
    up: N sigmas `linspace(1, 1/N, N)`, then 0. With `use_dynamic_shifting` they are shifted
    by `exp(mu) / (exp(mu) + 1/sigma - 1)`, mu growing linearly with the image's token count
    from `base_shift` at `base_image_seq_len` to `max_shift` at `max_image_seq_len`; without
    it by the folder's static `shift`. `static_shift > 0` replaces both with
    `s * sigma / (1 + (s - 1) * sigma)` (the released GRPO codes' shift 3). The SDE comes from
    the sampling options."""

    image_seq_len: int  # the image's 2x2-patch tokens: (h / 2) * (w / 2)
    use_dynamic_shifting: bool = True
    shift: float = 3.0
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    num_train_timesteps: int = 1000
    static_shift: float = 0.0  # > 0: this shift, whatever the folder says

    @property
    def mu(self) -> float:
        slope = (self.max_shift - self.base_shift) / (
            self.max_image_seq_len - self.base_image_seq_len
        )
        return self.image_seq_len * slope + self.base_shift - slope * self.base_image_seq_len

    def sigmas(self, num_steps: int) -> np.ndarray:
        # The scheduler takes the pipeline's linspace as float32, then shifts it.
        base = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32).astype(np.float64)
        if self.static_shift > 0 or not self.use_dynamic_shifting:
            s = self.static_shift if self.static_shift > 0 else self.shift
            shifted = s * base / (1.0 + (s - 1.0) * base)
        else:
            shifted = math.exp(self.mu) / (math.exp(self.mu) + (1.0 / base - 1.0))
        return np.append(shifted, 0.0)


def shifted_flow_schedule(
    cls,
    config: dict,
    where: Path,
    family: str,
    image_seq_len: int,
    static_shift: float = 0.0,
    fixed: Mapping = SHIFTED_SCHEDULER_FIXED,
):
    """The `cls` (a `ShiftedFlowScheduleConfig`) of a `scheduler_config.json`, checked to
    hold the values `fixed` (a subclass that implements one of them leaves it out)."""
    check_flow_scheduler(config, where, family, fixed)
    fields = {f.name for f in dataclasses.fields(cls)} - {"image_seq_len", "static_shift"}
    values = {k: config[k] for k in fields if config.get(k) is not None}
    if values.get("max_image_seq_len", 4096) == values.get("base_image_seq_len", 256):
        raise ModelLoadError(f"{where} has max_image_seq_len equal to base_image_seq_len.")
    return cls(image_seq_len=image_seq_len, static_shift=static_shift, **values)


def check_flow_scheduler(config: dict, where: Path, family: str, fixed: Mapping) -> None:
    """A `scheduler_config.json` of diffusers' flow-matching Euler scheduler, with the values
    `fixed` that the family's sigmas assume; one sentence naming the `family` otherwise."""
    if config.get("_class_name", FLOW_SCHEDULER) != FLOW_SCHEDULER:
        raise ModelLoadError(
            f"{where} describes a {config.get('_class_name')}, but {family} folders use "
            f"{FLOW_SCHEDULER}."
        )
    files.check_fixed(config, fixed, where)


def abstract_params(module) -> dict:
    """A module's params as ShapeDtypeStructs (nothing is computed); the module says its
    smallest input in `init_weights(rng)`."""
    return jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))


@dataclasses.dataclass(frozen=True)
class Component:
    """A pipeline folder's trainable component, as a family builds and exports it."""

    folder: str  # the pipeline's sub-folder, e.g. "transformer"
    pt_class: str  # diffusers' PyTorch class, the config's `_class_name`
    # (config, dtype, **options) -> the checked Flax module; ValueError for what it lacks
    build: Callable
    point: str  # what the user should do, ending every error sentence
    article: str = "a"  # "a" or "an", before `pt_class` in a sentence
    hub_patterns: Sequence[str] = tuple(PIPELINE_PATTERNS)
    buffers: tuple[str, ...] = ()  # state-dict keys that are fixed buffers, not params
    list_names: frozenset = convert.DIFFUSERS_LIST_NAMES  # Flax `name_N` <-> PyTorch `name.N`

    def from_config(self, config: dict, where: Path, dtype, **options):
        """The module `config` describes, checked; `options` are its run-time fields
        (`remat`, `scan_layers`, `attention`)."""
        if config.get("_class_name", self.pt_class) != self.pt_class:
            raise ModelLoadError(
                f"{where} describes a {config.get('_class_name')}, not {self.article} "
                f"{self.pt_class}; {self.point}."
            )
        try:
            return self.build(config, dtype, **options)
        except ValueError as e:
            raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {self.point}.") from None

    def from_configs(self, configs, dtype, options: LoadOptions):
        """The module `load_from` would build, from a planner's `abstract.ModelConfigs`."""
        relative = f"{self.folder}/config.json"
        config = configs.files[relative]
        return self.from_config(config, configs.path(relative), dtype, **options.module_options())

    def load(self, folder: Path, dtype, **options):
        """`(module, params, config)` of the component's folder, params cast to `dtype`; a
        module with `scan_layers` gets its runs of blocks stacked (`weights.stacking`)."""
        config = files.read_json(folder / "config.json", self.point)
        module = self.from_config(config, folder / "config.json", dtype, **options)
        state = files.read_weights(folder, "diffusion_pytorch_model", self.point)
        state = {k: v for k, v in state.items() if k not in self.buffers}
        params = stacking.module_params(
            module,
            lambda shapes: convert.folder_to_flax(
                folder, state, convert.shapes_of(shapes), self.point
            ),
        )
        return module, cast_floats(params, dtype), config

    def resolve(self, model_path: str) -> Path:
        """The pipeline folder of a local path or hub id."""
        return files.resolve_folder(model_path, "model path", self.point, self.hub_patterns)

    def pipeline(self, model_path: str) -> tuple[Path, dict[str, Path]]:
        """The pipeline folder of a local path or hub id, and its folders of this component,
        `vae` and `scheduler`, each checked to hold its config."""
        root = self.resolve(model_path)
        configs = {self.folder: "config.json", "vae": "config.json"}
        configs["scheduler"] = "scheduler_config.json"
        return root, {
            name: files.component_dir(root, name, (config,), self.point)
            for name, config in configs.items()
        }

    def load_from(self, folders: Mapping[str, Path], dtype, options: LoadOptions):
        """`load` of `pipeline`'s folder of this component, built as `options` say."""
        return self.load(folders[self.folder], dtype, **options.module_options())

    def scheduler(self, folders: Mapping[str, Path]) -> tuple[dict, Path]:
        """The `scheduler_config.json` of `pipeline`'s folders, and where it is."""
        where = folders["scheduler"] / "scheduler_config.json"
        return files.read_json(where, self.point), where

    def denoiser(self, config: dict) -> export.Denoiser:
        """What `models.export` writes for params of this component's `config` (the blocks
        one by one, as the folder holds them)."""
        try:
            module = self.build(config, jnp.float32)
            reference = convert.shapes_of(abstract_params(module))
        except (ValueError, TypeError) as e:  # TypeError: a value of the wrong type
            raise ModelLoadError(
                f"the {self.folder} config cannot be exported: {first_line(e)}"
            ) from None
        return export.Denoiser(
            component=self.folder,
            pt_class=self.pt_class,
            config=config,
            reference=reference,
            list_names=self.list_names,
        )

    def base_denoiser(self, base_model_path: str) -> tuple[Path, export.Denoiser]:
        """The base folder and its component, checked (one sentence if unusable)."""
        base = self.resolve(base_model_path)
        config_file = base / self.folder / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(
                f"model folder {base} has no {self.folder}/config.json to export against."
            )
        return base, self.denoiser(files.read_json(config_file, self.point))

    def base_params(self, base_model_path: str) -> dict:
        """The base folder's component weights in float32 (a LoRA export with --merge adds
        to them)."""
        folder = self.resolve(base_model_path) / self.folder
        return self.load(folder, jnp.float32)[1]


@dataclasses.dataclass(frozen=True)
class OpenedFolder:
    """What `ImageFolder.open` read of a pipeline folder before the family's own parts."""

    root: Path  # the local folder (a hub id resolved to its snapshot)
    folders: dict[str, Path]  # `Component.pipeline`'s: the component's, `vae`, `scheduler`
    vae_config: dict
    sample_shape: tuple[int, ...]
    schedule: Any  # the family's `ShiftedFlowScheduleConfig`
    loaded: tuple  # `Component.load`'s (module, params, config)

    @property
    def module(self):
        return self.loaded[0]

    def model_fields(self, encoders, options: LoadOptions) -> dict:
        """`model_fields` with the sample shape, the schedule and `prepare_prompts` (up to
        `MAX_PREPARED_PROMPTS` prompts encoded ahead, then the text encoders released)."""
        return dict(
            **model_fields(self.root, self.loaded, self.vae_config, encoders, options),
            sample_shape=self.sample_shape,
            schedule_config=self.schedule,
            prepare_prompts=functools.partial(encoders.encode_ahead, limit=MAX_PREPARED_PROMPTS),
        )


@dataclasses.dataclass(frozen=True)
class ImageFolder:
    """A text-to-image family's pipeline folder as its loader and planner open it: the
    trainable `component`, and the family's rules for its latents and their shifted schedule
    from the transformer's, the VAE's and the scheduler's configs. The steps are the same for
    every such family; the rules are its own."""

    component: Component
    check_channels: Callable  # (transformer config, vae config, where) -> None
    sample_shape: Callable  # (transformer config, vae config, resolution) -> one latent's shape
    image_tokens: Callable  # one latent's shape -> the schedule's image_seq_len
    schedule_config: Callable  # (scheduler config, where, image_seq_len, static_shift)

    def sampling(self, transformer_config, vae_config, scheduler_config, where, options):
        """`(sample_shape, schedule)`: one latent for `options.resolution`, and the schedule
        of the scheduler's config for its tokens, `options.shift` in place of the folder's."""
        shape = self.sample_shape(transformer_config, vae_config, options.resolution)
        tokens = self.image_tokens(shape)
        return shape, self.schedule_config(scheduler_config, where, tokens, options.shift)

    def open(self, path: str, dtype, options: LoadOptions) -> OpenedFolder:
        """A loader's first steps on a pipeline folder (or hub id): its configs read and
        checked, the sample shape and schedule, the trainable component loaded (last, as
        the costly step)."""
        component = self.component
        root, folders = component.pipeline(path)
        where = folders[component.folder] / "config.json"
        transformer_config = files.read_json(where, component.point)
        vae_config = files.read_json(folders["vae"] / "config.json", component.point)
        self.check_channels(transformer_config, vae_config, root)
        shape, schedule = self.sampling(
            transformer_config, vae_config, *component.scheduler(folders), options
        )
        loaded = component.load_from(folders, dtype, options)
        return OpenedFolder(root, folders, vae_config, shape, schedule, loaded)

    def plan_transformer(self, configs, dtype, options: LoadOptions):
        """A planner's first steps on a folder's `abstract.ModelConfigs` (`PIPELINE_CONFIGS`
        among them): the channels checked, the component's module built."""
        found = configs.files
        transformer_config = found[f"{self.component.folder}/config.json"]
        self.check_channels(transformer_config, found[VAE_CONFIG], Path(configs.where))
        return self.component.from_configs(configs, dtype, options)

    def plan_sampling(self, configs, options: LoadOptions):
        """`sampling` on a folder's `abstract.ModelConfigs`."""
        found = configs.files
        return self.sampling(
            found[f"{self.component.folder}/config.json"],
            found[VAE_CONFIG],
            found[SCHEDULER_CONFIG],
            configs.path(SCHEDULER_CONFIG),
            options,
        )
