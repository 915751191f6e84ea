"""Wan2.1 text-to-video from a diffusers-layout folder, as a `WanModel`.

The folder is what `WanPipeline.save_pretrained` writes (Wan-AI/Wan2.1-T2V-1.3B-Diffusers,
-14B-Diffusers): `transformer/` (`WanTransformer3DModel`, its safetensors sharded, bfloat16),
`vae/` (`AutoencoderKLWan`), `text_encoder/` (umT5-XXL's encoder, `UMT5EncoderModel`,
sharded), `tokenizer/` and `scheduler/`. Weights are read in numpy (torch is never imported).
Only the transformer's weights are trainable `params`; umT5 and the VAE decoder are frozen
and closed over by `encode_prompts` and `decode`.

A sample is one video's latents channels last, [F, h, w, 16], the layout the transformer,
the VAE and the decoded videos share (WanPipeline holds them channels first, [16, F, h, w]),
with F = (frames - 1) / 4 + 1 latent frames and h, w the pixel sides / 8. The denoiser's
timestep is `1000 * sigma`, as the pipeline passes its scheduler's timesteps. A prompt's
conditioning is umT5's last hidden states over `t5_max_length` tokens, zero past the
prompt's own tokens (as `WanPipeline.encode_prompt` gives them); prompts are encoded once
and cached, so umT5 (5.7B parameters) can be released before training (`prepare_prompts`).

The schedule's sigmas are the folder's scheduler's: the release's `UniPCMultistepScheduler`
with `use_flow_sigmas` spaces N sigmas from 1 down to `1 / T` and shifts them by its
`flow_shift` (`s * sigma / (1 + (s - 1) * sigma)`), then 0; a folder with a
`FlowMatchEulerDiscreteScheduler` gets that scheduler's sigmas for its `shift`. The steps
between them are the library's flow steps (Euler for the deterministic sampler, the table's
SDEs for the stochastic ones), not UniPC's multistep corrector. `shift > 0` replaces the
folder's shift (Wan's own guidance: 3.0 at 480p, 5.0 at 720p). The pipeline hands the
transformer UniPC's timesteps rounded down to integers; here they are `1000 * sigma` unrounded,
as the GRPO codes' Euler schedulers give them.

Wan2.2 folders load the same way. Wan2.2-TI2V-5B's VAE is Wan2.2's (48 latent channels, 16
pixels per latent: `causal_vae`), and its pipeline's `expand_timesteps` gives every token the
step's timestep in text-to-video, which is the one timestep a row here. Wan2.2-T2V-A14B's
`model_index.json` sets `boundary_ratio` and the folder holds a second transformer,
`transformer_2/`: the params are then `{"transformer": high-noise expert, "transformer_2":
low-noise expert}` and the denoiser picks each row's expert by its timestep
(`make_expert_denoise`). UniPC hands the pipeline's experts integer timesteps; a `1000 * sigma`
within one of the boundary may fall on the other side here (not at the releases' settings).
tests/parity/test_wan22_pipeline.py measures both layouts against WanPipeline.

A TI2V folder (`expand_timesteps`) with `image_to_video` takes input images: each prompt's
one image is the video's first frame, as `WanImageToVideoPipeline` with `expand_timesteps`
animates it. The image is encoded by the VAE's encoder (`causal_vae_encoder.load_encoder`)
and packed after the text rows of the prompt's conditioning (`pack_first_frames`); the
denoiser holds it as the first latent frame at timestep 0 (`make_first_frame_denoise`), and
the guidance's empty prompt is the text rows only (`unconditional_rows`), so both passes see
the image.

Measured against diffusers' PyTorch WanPipeline on a tiny random folder
(tests/parity/test_wan_pipeline.py, float32 on CPU, its transformer stored in bfloat16 and
sharded): the deterministic sampler (4 and 20 steps, the pipeline's scheduler swapped for
the Euler one on these sigmas) differs by at most 4.8e-7 from `WanPipeline(latents=...,
output_type="latent")` on latents up to 4.2; the prompts by 1.2e-6 from `encode_prompt`
(states up to 2.5); the decoded videos by 1.6e-6; the sigmas by less than 2e-6 from the
release's UniPC scheduler.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import causal_vae, causal_vae_encoder, components, media, text_encoders
from tree_grpo_jax.models.base import (
    Decoder,
    FlowSigmasScheduleConfig,
    ModelLoadError,
    cast_floats,
)
from tree_grpo_jax.models.wan import family, transformer
from tree_grpo_jax.weights import files

POINT = "point --config.model.path at a local diffusers-layout Wan text-to-video folder"
# Prompts encoded ahead so that umT5 can be released (4 MB each at 512 tokens in bfloat16).
MAX_PREPARED_PROMPTS = 1024
UNIPC = "UniPCMultistepScheduler"
SCHEDULERS = (UNIPC, components.FLOW_SCHEDULER)
# The options of UniPC's flow sigmas the schedule implements, with the one value it assumes.
_UNIPC_FIXED = {
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
    "use_dynamic_shifting": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "shift_terminal": None,
    "final_sigmas_type": "zero",
}
_EULER_FIXED = {**components.FLOW_SCHEDULER_FIXED, "use_dynamic_shifting": False}


@dataclasses.dataclass(frozen=True)
class WanScheduleConfig(FlowSigmasScheduleConfig):
    """The sigmas of the folder's scheduler as WanPipeline sets it up for N steps (no
    `sigmas` passed): `grid="unipc"`, UniPC's flow sigmas, `linspace(1, 1/T, N + 1)[:-1]`
    shifted once; `grid="flow_match_euler"`, the Euler scheduler's, N sigmas from 1 down to
    its shifted `1/T`, shifted again. Both end with 0. UniPC nudges a first sigma of exactly
    1 to 1 - 1e-6 to keep its log finite; an Euler step needs no such nudge, so it starts
    at 1."""

    flow_shift: float = 3.0
    num_train_timesteps: int = 1000
    grid: str = "unipc"

    def shifted(self, sigma):
        s = self.flow_shift
        return s * sigma / (1.0 + (s - 1.0) * sigma)

    def sigmas(self, num_steps: int) -> np.ndarray:
        last = 1.0 / self.num_train_timesteps
        if self.grid == "unipc":
            base = np.linspace(1.0, last, num_steps + 1)[:-1]
        else:
            base = np.linspace(1.0, self.shifted(last), num_steps)
        return np.append(self.shifted(base), 0.0)


# What `load_wan` and `abstract.abstract_wan` take as keywords: `model.wan`'s fields
# (its record's defaults) and the shared run-time ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class WanModel(components.TransformerModel):
    """A loaded Wan2.1 folder; `decode` gives videos [B, T, H, W, 3] in [0, 1]; its
    `text_encoders` are a `WanTextEncoder`."""

    media: str = media.VIDEO
    num_frames: int  # the video frames `decode` gives (4k + 1)
    # Wan2.2-TI2V with `image_to_video`: `encode_prompts(prompts, input_images=...)` makes
    # each prompt's input image the first frame (`pack_first_frames`).
    takes_input_images: bool = False
    # Then the empty prompt's embedding for guidance is the text rows only: the
    # unconditional pass keeps each prompt's first frame (`core.guidance`).
    unconditional_rows: int | None = None


def build_transformer(config: dict, dtype, **options):
    """`transformer.transformer_module`, its blocks one by one unless `scan_layers` is
    asked for: the export checks params (unstacked) against this module's shapes."""
    return transformer.transformer_module(config, dtype, **{"scan_layers": False, **options})


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class=family.TRANSFORMER_CLASS,
    build=build_transformer,
    point=POINT,
    list_names=transformer.MODULE_LISTS,
)
abstract_params = components.abstract_params
load_transformer = TRANSFORMER.load


def schedule_config(config: dict, where: Path, static_shift: float = 0.0) -> WanScheduleConfig:
    """The schedule of a `scheduler/scheduler_config.json`, checked; `static_shift > 0`
    replaces its shift."""
    name = config.get("_class_name", UNIPC)
    if name not in SCHEDULERS:
        raise ModelLoadError(
            f"{where} describes a {name}, but Wan2.1 folders use {' or '.join(SCHEDULERS)} "
            "(its flow sigmas); " + POINT + "."
        )
    if name == UNIPC:
        if config.get("use_flow_sigmas") is not True:
            raise ModelLoadError(
                f"{where} does not set use_flow_sigmas=true, so its sigmas are not a flow "
                f"model's; {POINT}."
            )
        files.check_fixed(config, _UNIPC_FIXED, where)
        shift, grid = config.get("flow_shift", 1.0), "unipc"
    else:
        components.check_flow_scheduler(config, where, "Wan2.1", _EULER_FIXED)
        shift, grid = config.get("shift", 1.0), "flow_match_euler"
    steps = config.get("num_train_timesteps", 1000)
    if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not shift > 0:
        raise ModelLoadError(f"{where} has a shift of {shift!r}; it must be a number > 0.")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ModelLoadError(f"{where} has num_train_timesteps {steps!r}; it must be >= 2.")
    return WanScheduleConfig(
        flow_shift=float(static_shift if static_shift > 0 else shift),
        num_train_timesteps=steps,
        grid=grid,
    )


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(pixels per latent, frames per latent frame) of the VAE's decoder: 2 ** levels times
    its pixel patch, and 2 ** (levels that double time); (8, 4) for Wan2.1, (16, 4) for
    Wan2.2's VAE (WanPipeline reads the same numbers from the config's
    `scale_factor_spatial` and `scale_factor_temporal`)."""
    try:
        c = causal_vae.vae_config(vae_config)
    except ModelLoadError:  # its own check says what is wrong, where the decoder is built
        c = causal_vae.CausalVAEConfig()
    return c.spatial_factor, c.temporal_factor


# ---------------------------------------------------------------------------------------------
# Wan2.2-T2V-A14B's two experts: `transformer/` denoises the high-noise steps and
# `transformer_2/` the low-noise ones, switching at `boundary_ratio` (model_index.json).

EXPERTS = ("transformer", "transformer_2")  # high noise, low noise: the params' two keys


def boundary_of(model_index: dict | None, where: Path) -> float | None:
    """The pipeline's `boundary_ratio` (None: one transformer throughout), checked."""
    ratio = (model_index or {}).get("boundary_ratio")
    if ratio is None:
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ModelLoadError(
            f"{where} has boundary_ratio {ratio!r}; it must be a number in (0, 1); {POINT}."
        )
    return float(ratio)


def check_experts(high: dict, low: dict, where: Path) -> None:
    """The experts are applied by one module: their configs must agree."""
    ignored = {"_name_or_path", "_diffusers_version"}
    differ = sorted(k for k in (set(high) | set(low)) - ignored if high.get(k) != low.get(k))
    if differ:
        raise ModelLoadError(
            f"{where}'s transformer/ and transformer_2/ configs differ in {', '.join(differ)}; "
            f"the two experts must share one architecture; {POINT}."
        )


def make_expert_denoise(module, boundary_timestep: float):
    """The denoiser of two experts, params `{"transformer": high, "transformer_2": low}`:
    a row whose timestep is >= `boundary_timestep` (boundary_ratio * num_train_timesteps)
    goes through the high-noise expert, the others through the low-noise one, as
    WanPipeline picks per step. When every row is on one side (a rollout's tree level, whose
    rows share a step, or a minibatch drawn from one side) only that expert runs
    (`lax.cond`); a minibatch mixing both sides runs both on all rows and keeps each row's
    own, twice one expert's compute (forward and backward)."""
    one = make_denoise(module)

    def denoise(params, x, t, cond):
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
        high = t >= boundary_timestep

        def run(name):
            return lambda: one(params[name], x, t, cond)

        def mixed():
            pick = high.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.where(pick, run(EXPERTS[0])(), run(EXPERTS[1])())

        low_or_mixed = lambda: jax.lax.cond(jnp.any(high), mixed, run(EXPERTS[1]))  # noqa: E731
        return jax.lax.cond(jnp.all(high), run(EXPERTS[0]), low_or_mixed)

    return denoise


# ---------------------------------------------------------------------------------------------
# Wan2.2-TI2V-5B's image-to-video (`WanImageToVideoPipeline` with `expand_timesteps`): the
# first latent frame is the encoded image, its tokens get timestep 0, and the pipeline puts
# the image's latents back in place of that frame before every call and at the end.


def first_frame_rows(frame_shape: Sequence[int], width: int) -> int:
    """Rows of `width` values that a prompt's conditioning gains for its first frame: a flag
    (1: an image was given) then the frame's h * w * z latents, zero-padded to whole rows."""
    return -(-(1 + math.prod(frame_shape)) // width)


def pack_first_frames(text, first, given) -> np.ndarray:
    """A TI2V prompt's conditioning: the text states [P, L, D] followed by
    `first_frame_rows` rows that hold, in order, the flag `given` [P] (1.0 or 0.0) and the
    first frame's normalised latents `first` [P, h, w, z], row-major, then zeros."""
    text = np.asarray(text, np.float32)
    count, _, width = text.shape
    rows = first_frame_rows(first.shape[1:], width)
    flat = np.zeros((count, rows * width), np.float32)
    flat[:, 0] = np.asarray(given, np.float32)
    flat[:, 1 : 1 + math.prod(first.shape[1:])] = np.asarray(first, np.float32).reshape(count, -1)
    return np.concatenate([text, flat.reshape(count, rows, width)], axis=1)


def unpack_first_frames(cond, text_length: int, frame_shape: Sequence[int]):
    """`pack_first_frames` undone on device: (text [B, L, D], first [B, h, w, z], given
    [B] bool)."""
    batch = cond.shape[0]
    flat = cond[:, text_length:].reshape(batch, -1).astype(jnp.float32)
    first = flat[:, 1 : 1 + math.prod(frame_shape)].reshape(batch, *frame_shape)
    return cond[:, :text_length], first, flat[:, 0] > 0.5


def make_first_frame_denoise(module, text_length: int, timestep_scale: float):
    """The TI2V denoiser: conditioning packed by `pack_first_frames`. In a row whose prompt
    gave an image, the transformer sees the image's latents as the first frame with timestep
    0 on its tokens (whatever x holds there), as the pipeline calls it; the other frames'
    velocity is the transformer's. The first frame's velocity is `(x - image) / sigma`, the
    flow whose clean sample is the image: an Euler step to sigma' keeps that frame at
    `image + sigma' / sigma (x - image)`, so the deterministic sampler ends (sigma' = 0) on
    the image, as the pipeline's final re-imposition does, and no parameter reaches that
    frame (its loss terms are constant). Rows without an image are text-to-video."""

    def denoise(params, x, t, cond):
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
        text, first, given = unpack_first_frames(cond, text_length, x.shape[2:])
        clean = given.reshape(-1, 1, 1, 1)
        x_in = x.at[:, 0].set(jnp.where(clean, first.astype(x.dtype), x[:, 0]))
        out = module.apply(
            {"params": params},
            x_in.astype(module.dtype),
            t,
            text.astype(module.dtype),
            clean_first_frame=given,
        ).astype(jnp.float32)
        sigma = jnp.maximum(t / timestep_scale, 1e-6).reshape(-1, 1, 1, 1)
        towards_image = (x[:, 0].astype(jnp.float32) - first) / sigma
        out = out.at[:, 0].set(jnp.where(clean, towards_image, out[:, 0]))
        return out.astype(x.dtype)

    return denoise


def is_ti2v(model_index: dict | None) -> bool:
    """Whether the pipeline is Wan2.2-TI2V's: `expand_timesteps` in model_index.json."""
    return bool((model_index or {}).get("expand_timesteps", False))


def make_encode_prompts(text_conditioning, encode_images, frame_shape, resolution):
    """`encode_prompts(prompts, input_images=None)` of a TI2V model: the text states and,
    per prompt, its input image (at most one: the first frame) resized to `resolution` and
    encoded by `encode_images` (pixels [N, H, W, 3] in [-1, 1] -> latents [N, h, w, z]),
    packed by `pack_first_frames`. A prompt without an image is text-to-video."""
    height, width = resolution

    def encode_prompts(prompts, input_images=None):
        prompts = list(prompts)
        text = np.asarray(text_conditioning(prompts))
        first = np.zeros((len(prompts), *frame_shape), np.float32)
        given = np.zeros(len(prompts), np.float32)
        images = list(input_images) if input_images is not None else [[]] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} input image lists for {len(prompts)} prompts.")
        rows = [i for i, row in enumerate(images) if len(row)]
        for i in rows:
            if len(images[i]) > 1:
                raise ValueError(
                    f"prompt {prompts[i]!r} names {len(images[i])} input images; Wan2.2-TI2V "
                    "starts a video from one (its first frame)."
                )
        if rows:
            pixels = np.stack(
                [causal_vae_encoder.image_to_pixels(images[i][0], height, width) for i in rows]
            )
            first[rows] = np.asarray(encode_images(pixels))
            given[rows] = 1.0
        return jnp.asarray(pack_first_frames(text, first, given))

    return encode_prompts


def check_channels(transformer_config: dict, vae_config: dict, where: Path) -> None:
    latent = vae_config.get("z_dim", 16)
    for field in ("in_channels", "out_channels"):
        value = transformer_config.get(field, 16)
        if value is not None and value != latent:
            raise ModelLoadError(
                f"{where}'s transformer has {field} {value}, not its VAE's {latent} latent "
                f"channels (z_dim); {POINT}."
            )


def sample_shape(
    transformer_config: dict, vae_config: dict, resolution, num_frames: int
) -> tuple[int, int, int, int]:
    """One video's latents, channels last: ((frames - 1) / t + 1, H / s, W / s, z_dim) for
    the VAE's spatial factor s and temporal factor t; the sides must be multiples of s times
    the transformer's patch, the frames t k + 1, and the tokens along each axis at most the
    rotary embedding's positions, `rope_max_seq_len` (one sentence otherwise)."""
    size = family.resolution_of(resolution)
    if size is None:
        raise ModelLoadError(f"model.wan.resolution must be (height, width), got {resolution!r}.")
    spatial, temporal = vae_factors(vae_config)
    patch = tuple(transformer_config.get("patch_size", (1, 2, 2)))
    multiple = spatial * patch[1]
    if min(size) <= 0 or any(s % multiple for s in size):
        raise ModelLoadError(
            f"model.wan.resolution {size[0]}x{size[1]} must have both sides multiples of "
            f"{multiple} ({spatial} pixels per latent, {patch[1]}x{patch[2]} latents per "
            "token)."
        )
    if num_frames < 1 or (num_frames - 1) % (temporal * patch[0]):
        raise ModelLoadError(
            f"model.wan.num_frames {num_frames} must be {temporal}k + 1 (the VAE makes one "
            f"latent frame of every {temporal} frames after the first)."
        )
    # The transformer gives each token a rotary position per axis: past its table the
    # tokens have none (and a long video's prompt check alone would not fit in memory).
    positions = transformer_config.get("rope_max_seq_len", 1024)
    most_frames = temporal * (positions * patch[0] - 1) + 1
    if num_frames > most_frames:
        raise ModelLoadError(
            f"model.wan.num_frames {num_frames} is more than the {most_frames} this "
            f"transformer can place ({positions} rotary positions along time, its "
            f"rope_max_seq_len, of {patch[0]} latent frame each)."
        )
    most_side = positions * multiple
    if max(size) > most_side:
        raise ModelLoadError(
            f"model.wan.resolution {size[0]}x{size[1]} is larger than the {most_side} pixels "
            f"a side this transformer can place ({positions} rotary positions per axis, its "
            f"rope_max_seq_len, of {multiple} pixels each)."
        )
    channels = vae_config.get("z_dim", 16)
    return ((num_frames - 1) // temporal + 1, size[0] // spatial, size[1] // spatial, channels)


def make_denoise(module):
    """`(params, x [B, F, h, w, C], t [B] (1000 sigma), cond [B, L, text_dim]) -> velocity
    [B, F, h, w, C]`, as WanPipeline calls its transformer (there channels first)."""

    def denoise(params, x, t, cond):
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
        out = module.apply({"params": params}, x.astype(module.dtype), t, cond.astype(module.dtype))
        return out.astype(x.dtype)

    return denoise


def abstract_decoder(vae_config: dict, where: Path, dtype, batch_size: int):
    """`(decode, decoder params as ShapeDtypeStructs in dtype)` of a `vae/config.json`, for
    the plan; nothing is computed. `decode` is the VAE's `decode_fn`: latents [B, F, h, w, C]
    (the samples' own layout) -> videos [B, T, H, W, 3]."""
    try:
        module = causal_vae.decoder_module(vae_config, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {POINT}.") from None
    shapes = jax.eval_shape(lambda p: cast_floats(p, dtype), causal_vae.decoder_shapes(module))
    return causal_vae.decode_fn(module, vae_config, dtype, batch_size), shapes


# ---------------------------------------------------------------------------------------------
# The prompts: umT5 as WanPipeline runs it, each prompt once.


@dataclasses.dataclass(eq=False, kw_only=True)
class WanTextEncoder(text_encoders.PromptCache):
    """umT5 with a host cache of every prompt encoded so far. `t5(prompts)` gives the
    states [B, t5_max_length, width], zero past each prompt's tokens; `drop_t5` releases
    it, after which only cached prompts can be encoded."""

    t5: Callable[[list[str]], Any] | None
    t5_max_length: int
    width: int  # umT5's d_model, the transformer's text_dim
    batch_size: int = 8
    cache: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def _compute(self, prompts: list[str]) -> None:
        for chunk, padded in self._batches(prompts):
            states = np.asarray(self.t5(padded))
            for i, prompt in enumerate(chunk):
                self.cache[prompt] = states[i]

    def encode(self, prompts: Sequence[str]) -> np.ndarray:
        """prompts -> [P, t5_max_length, width] float32, as `WanPipeline.encode_prompt`."""
        prompts = self._cached(prompts)
        return np.stack([self.cache[p] for p in prompts]).astype(np.float32)

    def conditioning(self, prompts: Sequence[str]) -> jax.Array:
        return jnp.asarray(self.encode(list(prompts)))


def load_text_encoder(
    root: Path, dtype, *, t5_max_length: int, width: int, batch_size: int = 8
) -> WanTextEncoder:
    """umT5 and its tokenizer of the folder at `root` (`text.load_prompt_encoder`); its
    d_model must be `width`, the transformer's text_dim."""
    from tree_grpo_jax.models.wan import text

    try:
        text_encoders.check_t5_max_length(t5_max_length)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    umt5 = text.load_prompt_encoder(root, dtype, POINT, max_length=t5_max_length, width=width)
    return WanTextEncoder(t5=umt5, t5_max_length=t5_max_length, width=width, batch_size=batch_size)


def load_wan(path: str, dtype=jnp.float32, **options) -> WanModel:
    """Loads a Wan2.1 text-to-video pipeline folder (or hub id) as a video model.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`.
    """
    options = load_options(**options)
    root, folders = TRANSFORMER.pipeline(path)
    transformer_config = files.read_json(folders["transformer"] / "config.json", POINT)
    vae_config = files.read_json(folders["vae"] / "config.json", POINT)
    check_channels(transformer_config, vae_config, root)
    shape = sample_shape(transformer_config, vae_config, options.resolution, options.num_frames)
    schedule = schedule_config(*TRANSFORMER.scheduler(folders), options.shift)
    index = root / "model_index.json"
    model_index = files.read_json(index, POINT) if index.is_file() else None
    boundary = boundary_of(model_index, index)
    loaded = TRANSFORMER.load_from(folders, dtype, options)
    module = loaded[0]
    denoise = make_denoise(module)
    first_frame = is_ti2v(model_index) and options.image_to_video
    if first_frame:
        denoise = make_first_frame_denoise(
            module, options.t5_max_length, float(schedule.num_train_timesteps)
        )
    if boundary is not None:  # Wan2.2-T2V-A14B: the low-noise expert beside the high-noise one
        low = files.component_dir(root, EXPERTS[1], ("config.json",), POINT)
        check_experts(transformer_config, files.read_json(low / "config.json", POINT), root)
        _, low_params, _ = TRANSFORMER.load(low, dtype, **options.module_options())
        params = {EXPERTS[0]: loaded[1], EXPERTS[1]: low_params}
        loaded = (module, params, transformer_config)
        denoise = make_expert_denoise(module, boundary * schedule.num_train_timesteps)
    decoder, decoder_params, _ = causal_vae.load_decoder(folders["vae"], dtype, POINT)
    decode_latents = causal_vae.decode_fn(decoder, vae_config, dtype, options.decode_batch_size)
    encoder = load_text_encoder(
        root, dtype, t5_max_length=options.t5_max_length, width=module.text_dim
    )
    fields = components.model_fields(root, loaded, vae_config, encoder, options)
    if first_frame:
        image_encoder, image_params, _ = causal_vae_encoder.load_encoder(
            folders["vae"], dtype, POINT
        )
        encode_images = functools.partial(
            causal_vae_encoder.encode_fn(image_encoder, vae_config), image_params
        )
        fields["encode_prompts"] = make_encode_prompts(
            encoder.conditioning, encode_images, shape[1:], family.resolution_of(options.resolution)
        )
    return WanModel(
        **fields,
        takes_input_images=first_frame,
        unconditional_rows=options.t5_max_length if first_frame else None,
        sample_shape=shape,
        denoise=denoise,
        decode=Decoder(decode_latents, decoder_params),
        schedule_config=schedule,
        prepare_prompts=functools.partial(encoder.encode_ahead, limit=MAX_PREPARED_PROMPTS),
        num_frames=options.num_frames,
    )
