"""The one interface every text-to-image (or text-to-video) model sits behind.

The tree engine and the trainer see only this: a denoiser function over trainable params,
a prompt encoder, a decoder and `make_schedule`. Each model family (a sub-package of
`models/`) returns a `TextToImageModel`, or a subclass of it with the family's own typed
fields; which library the networks come from stays inside the family. The model's `media`
says what `decode` gives: images [B, H, W, C] or videos [B, T, H, W, C] (`models.media`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.core.guidance import DenoiseFn, PyTree  # noqa: F401 - re-exported
from tree_grpo_jax.core.sampling import (
    Schedule,
    flow_schedule_from_sigmas,
    make_ddim_schedule,
    make_flow_schedule,
)
from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.weights.files import ModelLoadError  # noqa: F401 - re-exported

# The dtypes a config may name (model.param_dtype, model.compute_dtype, reward_options.dtype).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def cast_floats(tree: PyTree, dtype) -> PyTree:
    """Every floating leaf as a jax array of `dtype`; integer and bool leaves unchanged."""

    def cast(x):
        # a host array is put on the device as it is (`jnp.asarray` would compile a program
        # per shape: dozens at a model's load); a cast, when needed, runs there
        x = x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True, eq=False)
class Decoder:
    """A model's `decode` as a function of its weights: `Decoder(apply, params)(latents)` is
    `apply(params, latents)`. Kept apart, the weights can be laid out on a run's devices and
    each device decode its own rows there (`run.scoring.on_each_device`); a `decode` that
    closes over its weights runs as it is."""

    apply: Callable  # (params, latents [B, *sample_shape]) -> decoded media [B, ...]
    params: PyTree

    def __call__(self, latents):
        return self.apply(self.params, latents)


class SamplingOptions(Protocol):
    """What a schedule reads from the run's sampling settings (the config's `sampling`).

    Flow schedules also read `flow_sde` ("flow_grpo" or "dancegrpo") and
    `flow_score_correction` (bool) where the object has them, with the defaults of
    `Sampling` where it does not.
    """

    eta: float  # DDIM: stochasticity of the stochastic steps
    noise_level: float  # flow SDE: Flow-GRPO's noise scale `a`, or DanceGRPO's `eta`
    shift: float  # flow: the sigma shift


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A plain `SamplingOptions`, with the config schema's defaults (tree_grpo_jax.config)."""

    eta: float = 1.0
    noise_level: float = 0.7
    shift: float = 1.0
    flow_sde: str = "flow_grpo"
    flow_score_correction: bool = True


@dataclasses.dataclass(frozen=True)
class DDIMScheduleConfig:
    """A model trained on a scaled_linear DDPM schedule and sampled with DDIM.

    The defaults are Stable Diffusion 1.x's (`steps_offset=1`, `set_alpha_to_one=False`);
    `eta` comes from the sampling options.
    """

    prediction_type: str = "epsilon"  # or "v_prediction"
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    steps_offset: int = 1
    set_alpha_to_one: bool = False

    def make_schedule(self, num_steps: int, sampling: SamplingOptions) -> Schedule:
        return make_ddim_schedule(num_steps, eta=sampling.eta, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class FlowScheduleConfig:
    """A rectified-flow (velocity) model; the shift and the SDE come from the sampling
    options, the model's timestep is `timestep_scale * sigma`."""

    timestep_scale: float = 1000.0

    @staticmethod
    def sde_options(sampling: SamplingOptions) -> dict:
        """The SDE keywords of `make_flow_schedule` / `flow_schedule_from_sigmas` from the
        sampling options, for every flow family; the SDE fields are optional there."""
        return dict(
            noise_level=sampling.noise_level,
            sde=getattr(sampling, "flow_sde", Sampling.flow_sde),
            score_correction=getattr(
                sampling, "flow_score_correction", Sampling.flow_score_correction
            ),
        )

    def make_schedule(self, num_steps: int, sampling: SamplingOptions) -> Schedule:
        return make_flow_schedule(
            num_steps,
            shift=sampling.shift,
            timestep_scale=self.timestep_scale,
            **self.sde_options(sampling),
        )


class FlowSigmasScheduleConfig:
    """A flow model whose family computes its own sigmas (`sigmas(num_steps)`: N + 1 values
    from 1 down to 0, as its pipeline's scheduler does); its timestep is
    `num_train_timesteps * sigma` and the sampling options give the SDE."""

    num_train_timesteps: int

    def sigmas(self, num_steps: int):
        raise NotImplementedError

    def make_schedule(self, num_steps: int, sampling: SamplingOptions) -> Schedule:
        if num_steps < 2:
            raise ValueError(f"a flow schedule needs at least 2 steps, got {num_steps}.")
        return flow_schedule_from_sigmas(
            self.sigmas(num_steps),
            timestep_scale=float(self.num_train_timesteps),
            **FlowScheduleConfig.sde_options(sampling),
        )


ScheduleConfig = DDIMScheduleConfig | FlowScheduleConfig | FlowSigmasScheduleConfig


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TextToImageModel:
    """A loaded model.

    `denoise` must be the same function object for the life of the model so that jitted
    code that takes it as a static argument compiles once. `params` are the trainable
    denoiser weights; the text encoder and decoder weights are closed over by
    `encode_prompts` and `decode` and never enter the optimizer. Families subclass this to
    add what their own tools read (the tiny model's prompt lists, SD's folder and UNet
    config); the trainer and the tree engine use only the fields here.
    """

    name: str
    # one sample: an image's latents channels first, (4, 64, 64) [C, H, W]; a video's
    # channels last, (21, 60, 104, 16) [T, H, W, C], as its decoded frames
    sample_shape: tuple[int, ...]
    params: PyTree
    denoise: DenoiseFn
    encode_prompts: Callable[[Sequence[str]], jax.Array]  # -> [P, L, D] float32
    # [B, *sample_shape] -> in [0, 1]: images [B, H, W, C] or videos [B, T, H, W, C], as
    # `media` says (the build checks it once, on shapes)
    decode: Callable[[jax.Array], jax.Array]
    schedule_config: ScheduleConfig  # the model side of its sampling schedule
    media: str = media_kinds.IMAGE  # "image", "video" or "latents" (see `models.media`)
    # Optional: told every prompt a run will encode, so the model may encode them ahead and
    # free its text encoders (SD3 releases its 4.7B T5); returns a line saying what it did.
    prepare_prompts: Callable[[Sequence[str]], str] | None = None
    # Not "none": `denoise` recomputes each of its blocks in the backward pass, as this
    # `REMAT_MODES` name (model.remat) asked the family, so the train step needs no
    # checkpoint around the whole denoiser.
    remat: str = "none"
    # True: a run's programs follow from the package's code, the run's config and the shapes
    # of its arrays alone (the tiny model, its architecture in its code), so a later run may
    # run them stored (`run.program_store`); a model whose architecture comes from a
    # folder's config files keeps False.
    programs_from_code: bool = False

    def __post_init__(self):
        media_kinds.check_media(self.media, f"model {self.name!r}")

    def make_schedule(self, num_steps: int, sampling: SamplingOptions) -> Schedule:
        """The schedule of `num_steps` steps; `sampling` is any object with `eta` (read by
        DDIM models), `noise_level` and `shift` (read by flow models), e.g. the config's
        `sampling` section or a `Sampling`."""
        return self.schedule_config.make_schedule(num_steps, sampling)


def schedule_for(model, num_steps: int, sampling, field: str) -> Schedule:
    """`model.make_schedule`, its refusal of `num_steps` naming the config field that set it
    (`sampling.num_steps` or `eval.num_steps`)."""
    try:
        return model.make_schedule(num_steps, sampling)
    except ValueError as e:
        message = str(e)
        if message.startswith("num_steps "):
            raise ValueError(f"{field}{message[len('num_steps') :]}") from None
        raise


# What `model.remat` may ask a block for: nothing; recompute the whole block in the backward
# pass; or recompute it but keep its attention's q, k, v and output (the attention, the
# costliest part to recompute, runs once).
REMAT_MODES = ("none", "block", "block_save_attention")


def remat_mode(value) -> str:
    """`model.remat` as one of REMAT_MODES: True is "block", False (or None) "none"."""
    if value is True:
        return "block"
    if value is False or value is None:
        return "none"
    if isinstance(value, str) and value in REMAT_MODES:
        return value
    raise ValueError(
        f"model.remat must be one of {', '.join(REMAT_MODES)} (or True / False), got {value!r}."
    )


# How the run lays out a batch's rows across its devices while a denoiser is traced (None:
# as the compiler likes). Set by the run around its denoiser; read by `constrain_rows`.
_ROW_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("row_layout", default=None)


@contextlib.contextmanager
def row_layout(constrain: Callable[[jax.Array], jax.Array] | None):
    """Within it, `constrain_rows(x)` is `constrain(x)`: a family's denoiser calls it on its
    activations between blocks, so that a sharded run keeps their rows split over the
    devices (and gathers weights) instead of splitting the activations' channels."""
    token = _ROW_LAYOUT.set(constrain)
    try:
        yield
    finally:
        _ROW_LAYOUT.reset(token)


def constrain_rows(x: jax.Array) -> jax.Array:
    """`x` [B, ...] laid out as the run's `row_layout` asks; `x` itself outside one."""
    constrain = _ROW_LAYOUT.get()
    return x if constrain is None else constrain(x)


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How `models.attention.attention` lays out its [B, L, heads, head_dim] arrays when a
    run splits each sample's tokens over devices (`mesh.sequence`): the blocks hold a slice
    of the tokens, attention needs every token. Where the axis divides the heads, q, k and v
    go to `heads` (every token, a slice of the heads) and the output back to `tokens`; the
    compiler moves the data between the two with all-to-alls (Ulysses). Otherwise each
    device keeps its queries and the keys and values travel around the `axis` of `mesh`
    (ring attention); None for both leaves that case to the compiler."""

    heads: Callable[[jax.Array], jax.Array]
    tokens: Callable[[jax.Array], jax.Array]
    mesh: jax.sharding.Mesh | None = None
    axis: str | None = None

    @property
    def size(self) -> int:
        """The devices a sample's tokens are split over."""
        return self.mesh.shape[self.axis]


_SEQUENCE_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("sequence_layout", default=None)


@contextlib.contextmanager
def sequence_layout(layout: SequenceLayout | None):
    """Within it, `attention_layout()` is `layout` (set by the run around its denoiser)."""
    token = _SEQUENCE_LAYOUT.set(layout)
    try:
        yield
    finally:
        _SEQUENCE_LAYOUT.reset(token)


def attention_layout() -> SequenceLayout | None:
    """The run's `SequenceLayout`, or None where tokens are not split."""
    return _SEQUENCE_LAYOUT.get()


def attention_heads(model) -> int | None:
    """The attention heads of a transformer model's blocks (None: not a transformer)."""
    module = getattr(model, "transformer", None)
    for field in ("num_attention_heads", "n_heads"):
        if isinstance(getattr(module, field, None), int):
            return getattr(module, field)
    return None


def training_denoise(model, remat) -> DenoiseFn:
    """The denoiser the train step differentiates: with `remat` (model.remat, not "none"),
    the backward pass recomputes the forward, block by block where the model does that
    itself (its `remat`), else around the whole denoiser (which still holds that whole
    forward's activations at once while it recomputes them)."""
    if remat_mode(remat) == "none" or getattr(model, "remat", "none") != "none":
        return model.denoise
    return jax.checkpoint(model.denoise)
