"""FLUX.2 (dev or klein) from a diffusers-layout folder, as a `Flux2Model`.

The folder holds `transformer/` (`Flux2Transformer2DModel`), `vae/` (`AutoencoderKLFlux2`),
`text_encoder/` and `tokenizer/`, and `scheduler/` (`FlowMatchEulerDiscreteScheduler`). The
text side is the pipeline's: a `text_encoder/config.json` of model_type "mistral3" (or a
`model_index.json` naming `Flux2Pipeline`) is FLUX.2-dev's Mistral Small 3.1 with its system
turn, "qwen3" (`Flux2KleinPipeline`) klein's Qwen3 (`text`). Weights are the PyTorch
safetensors the folder carries, converted in numpy (torch is never imported). Only the
transformer's weights are trainable `params`; the text encoder and the VAE decoder are frozen
and closed over by `encode_prompts` and `decode`.

The trainer's latents are the pipelines' own: [B, 128, h, w] channels first, 2x2 patches of
the VAE's 32 channels normalised by its batch-norm statistics, on a grid of 1/16 of the
image's side (`vae`). `denoise` flattens them row-major into tokens (the pipelines'
`_pack_latents`), passes the position ids, the timestep sigma (the transformer scales it by
1000 as the pipelines' `t / 1000` undoes the scheduler's) and, for dev, the distilled
guidance scale (`model.flux2.guidance`, 4 as the pipeline's default), and returns the
transformer's output as the latent grid: the flow velocity (noise minus data) the pipelines'
Euler scheduler steps with. Classifier-free guidance is not applied here: the denoiser is the
conditional prediction (klein's distilled releases ignore guidance; klein base's CFG against
the empty prompt is the package's sampling guidance). The conditioning is one array per
prompt, [text_max_length, joint_attention_dim]: the three stacked hidden states of every
token, padding included, as both pipelines hand the transformer all of them.

Editing (`reference_images` > 0): each prompt's input images are the pipelines' `image=`
references, prepared and encoded as `prepare_image_latents` does (`ReferenceEncoder`), and
carried as rows after the text states in the prompt's conditioning (`EditConditioning`);
`denoise` gives them to the transformer as extra image tokens and keeps the noisy tokens'
output.

The schedule is the pipelines': N sigmas `linspace(1, 1/N, N)` shifted by
`exp(mu) / (exp(mu) + 1/sigma - 1)` with the empirical mu of FLUX.2's sampling code, a
function of the image's token count and of N (`compute_empirical_mu`), then 0; the folder's
base and max shift are not used (the pipelines pass mu).

Measured against diffusers' PyTorch pipelines on tiny random folders
(tests/parity/test_flux2_model.py, float32 on CPU): the deterministic sampler (4 steps, the
empirical mu) differs by at most 1.1e-6 (dev, guidance 4) and 9.5e-7 (klein) from the
pipelines' `output_type="latent"` results on latents up to 4.8 and 6.1; the prompt states by
4.7e-7 (dev) and 6.7e-7 (klein) of their largest value from `encode_prompt`; the decoded
images by 1.8e-6; the schedule's sigmas by less than 1e-6.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from tree_grpo_jax.models import components, decoder_prompts, decoder_text, references
from tree_grpo_jax.models.base import Decoder, ModelLoadError, cast_floats
from tree_grpo_jax.models.flux2 import family, text, transformer, vae
from tree_grpo_jax.models.text_encoders import read_config
from tree_grpo_jax.weights import convert, files

POINT = "point --config.model.path at a local diffusers-layout FLUX.2-dev or FLUX.2-klein folder"
HUB_PATTERNS = components.PIPELINE_PATTERNS
DEFAULT_RESOLUTION = 1024  # the pipelines' default height and width
PATCH = vae.PATCH  # the latents are 2x2 patches of the VAE's channels

# The text path of each variant: the text encoder's model_type, the pipeline class that
# names it in model_index.json, the hidden states stacked, what the folder must hold.
DEV, KLEIN = "dev", "klein"
TEXT_PATHS = {
    DEV: dict(model_type="mistral3", pipeline="Flux2Pipeline", layers=text.DEV_LAYERS),
    KLEIN: dict(model_type="qwen3", pipeline="Flux2KleinPipeline", layers=text.KLEIN_LAYERS),
}
WHAT = {DEV: "FLUX.2-dev's Mistral 3 text encoder", KLEIN: "FLUX.2-klein's Qwen3 text encoder"}


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's time-shift mu: linear in the image's token count along two fitted lines (one
    for 10 steps, one for 200), interpolated linearly in the step count; past 4300 tokens
    the 200-step line alone. The constants are the pipelines' (from FLUX.2's sampling code)."""
    slope_10, intercept_10 = 8.73809524e-05, 1.89833333
    slope_200, intercept_200 = 0.00016927, 0.45666666
    mu_200 = slope_200 * image_seq_len + intercept_200
    if image_seq_len > 4300:
        return float(mu_200)
    mu_10 = slope_10 * image_seq_len + intercept_10
    per_step = (mu_200 - mu_10) / 190.0
    return float(per_step * num_steps + mu_200 - 200.0 * per_step)


@dataclasses.dataclass(frozen=True)
class Flux2ScheduleConfig(components.ShiftedFlowScheduleConfig):
    """FlowMatchEulerDiscreteScheduler as the FLUX.2 pipelines set it up: dynamic shifting
    with `compute_empirical_mu(image_seq_len, num_steps)` for mu, whatever the folder's
    base and max shift; `static_shift > 0` (or a folder without dynamic shifting) replaces
    it as for the other families."""

    def sigmas(self, num_steps: int) -> np.ndarray:
        if self.static_shift > 0 or not self.use_dynamic_shifting:
            return super().sigmas(num_steps)
        base = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32).astype(np.float64)
        mu = compute_empirical_mu(self.image_seq_len, num_steps)
        return np.append(np.exp(mu) / (np.exp(mu) + (1.0 / base - 1.0)), 0.0)


# What `load_flux2` takes as keywords: `model.flux2`'s fields and the shared run-time ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))


@dataclasses.dataclass(eq=False, kw_only=True)
class Flux2TextEncoder(decoder_prompts.CachedPromptStates):
    """`decoder_prompts.CachedPromptStates` of FLUX.2's prompts: `run` gives the picked
    hidden states; `encode` returns, per prompt, what the pipeline's `encode_prompt` gives
    for it: [max_length, len(layers) * hidden] over every token, padding included. Cached in
    the encoder's dtype (a prompt is `max_length` states wide: 31 MB in float32 for dev)."""

    variant: str = KLEIN

    def batch_states(self, prompts: list[str]) -> list[np.ndarray]:
        inputs = text.dev_prompt_inputs if self.variant == DEV else text.klein_prompt_inputs
        ids, mask = inputs(self.tokenizer, prompts, self.max_length)
        states = text.stacked_embeds(self.run(self.params, jnp.asarray(ids), jnp.asarray(mask)))
        return list(np.asarray(states))

    def conditioning(self, prompts) -> jax.Array:
        """[P, max_length, width] float32: the prompts' states side by side."""
        return jnp.asarray(np.stack(self.encode(list(prompts))), jnp.float32)


def text_variant(root: Path) -> str:
    """DEV or KLEIN from the folder's `text_encoder/config.json` model_type, else from
    `model_index.json`'s pipeline class; one sentence when neither says."""
    config = root / decoder_prompts.ENCODER_FOLDER / "config.json"
    if config.is_file():
        found = files.read_json(config, POINT).get("model_type")
        for variant, path in TEXT_PATHS.items():
            if found == path["model_type"]:
                return variant
        if found is not None:
            raise ModelLoadError(
                f"{config} has model_type {found!r}; FLUX.2 folders hold a 'mistral3' (dev) "
                f"or 'qwen3' (klein) text encoder; {POINT}."
            )
    index = root / "model_index.json"
    pipeline = files.read_json(index, POINT).get("_class_name") if index.is_file() else None
    for variant, path in TEXT_PATHS.items():
        if pipeline == path["pipeline"]:
            return variant
    raise ModelLoadError(
        f"{root} says neither by its text encoder's model_type nor by its model_index.json "
        f"whether it is FLUX.2-dev or klein; {POINT}."
    )


def check_max_length(max_length: int) -> None:
    if max_length < 1:
        raise ModelLoadError(f"the text max_length must be at least 1, got {max_length}.")


def check_text_config(raw: dict, where: Path, variant: str, width: int) -> None:
    """The encoder's three picked states must exist and sit side by side as wide as the
    transformer's `joint_attention_dim` (`width`)."""
    try:
        config = decoder_text.config_from_transformers(raw)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {POINT}.") from None
    layers = TEXT_PATHS[variant]["layers"]
    if max(layers) > config.num_layers:
        raise ModelLoadError(
            f"{where} has {config.num_layers} layers, but the pipeline stacks hidden states "
            f"{', '.join(map(str, layers))}; {POINT}."
        )
    if len(layers) * config.hidden_size != width:
        raise ModelLoadError(
            f"{where} has hidden_size {config.hidden_size}, but the transformer's "
            f"joint_attention_dim {width} is {len(layers)} hidden states wide; {POINT}."
        )


def load_text_encoder(
    root: Path, dtype=jnp.float32, *, max_length: int, width: int, batch_size: int = 8
) -> Flux2TextEncoder:
    """The text side of a FLUX.2 folder at `root`: `dtype` is the encoder's param and compute
    dtype (and the cache's); `width` the transformer's joint_attention_dim."""
    variant = text_variant(root)
    path = TEXT_PATHS[variant]
    folder = files.component_dir(root, decoder_prompts.ENCODER_FOLDER, ("config.json",), POINT)
    raw = read_config(folder, path["model_type"], WHAT[variant], POINT)
    check_text_config(raw, folder / "config.json", variant, width)
    layers = path["layers"]
    encoder = decoder_prompts.load_cached_states(
        Flux2TextEncoder,
        root,
        dtype,
        max_length=max_length,
        width=("joint_attention_dim / 3", width // len(layers)),
        batch_size=batch_size,
        check_max_length=check_max_length,
        model_type=path["model_type"],
        what=WHAT[variant],
        layer=layers,
        point=POINT,
        chat_template=True,
    )
    encoder.variant, encoder.width = variant, width
    return encoder


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class=family.TRANSFORMER_CLASS,
    build=transformer.transformer_module,
    point=POINT,
    list_names=transformer.MODULE_LISTS,
)


def schedule_config(
    config: dict, where: Path, image_seq_len: int, static_shift: float = 0.0
) -> Flux2ScheduleConfig:
    """The schedule of a `scheduler/scheduler_config.json`, checked."""
    return components.shifted_flow_schedule(
        Flux2ScheduleConfig, config, where, "FLUX.2", image_seq_len, static_shift
    )


def latent_tokens(x: jax.Array) -> jax.Array:
    """[B, C, h, w] -> [B, h * w, C], row-major (the pipelines' `_pack_latents`)."""
    batch, channels, rows, columns = x.shape
    return jnp.transpose(x.reshape(batch, channels, rows * columns), (0, 2, 1))


def make_denoise(
    module, guidance: float | None, timestep_scale: float = 1000.0, text_tokens: int | None = None
):
    """`(params, x [B, C, h, w], t [B] (sigma * timestep_scale), cond [B, L, D],
    references=None) -> velocity [B, C, h, w]`, as the FLUX.2 pipelines call their
    transformer (without classifier-free guidance). `references`, when given, is
    (tokens [B, M, C], ids [B, M, 4]) of more image tokens the transformer attends to
    after the latent's (the pipelines' reference images), their outputs dropped. With
    `text_tokens`, a `cond` longer than that carries them itself: its rows past the text are
    `reference_rows`."""

    def denoise(params, x, t, cond, references=None):
        batch, _, rows, columns = x.shape
        if text_tokens is not None and cond.shape[1] > text_tokens and references is None:
            cond, references = split_references(cond, text_tokens, module.in_channels)
        sigma = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (batch,)) / timestep_scale
        tokens = latent_tokens(x.astype(module.dtype))
        ids = jnp.broadcast_to(
            jnp.asarray(transformer.image_ids(rows, columns)), (batch, rows * columns, 4)
        )
        if references is not None:
            extra, extra_ids = references
            tokens = jnp.concatenate([tokens, extra.astype(module.dtype)], axis=1)
            ids = jnp.concatenate([ids, jnp.asarray(extra_ids, jnp.float32)], axis=1)
        out = module.apply(
            {"params": params},
            tokens,
            cond.astype(module.dtype),
            sigma,
            ids,
            jnp.asarray(transformer.text_ids(cond.shape[1])),
            None if guidance is None else jnp.full((batch,), guidance, jnp.float32),
        )
        latent = vae.tokens_to_latents(out[:, : rows * columns], rows, columns)
        return latent.astype(x.dtype)

    return denoise


# ---------------------------------------------------------------------------------------------
# Editing: reference images inside the conditioning array (`models.references`): the
# prompt's text states [text_max_length, D], then one row per reference token, its C latent
# channels, its 4 position ids (time, row, column, 0) and zeros (7680 >= 132 for klein 4B).

ID_COLUMNS = transformer.ID_AXES
reference_rows = references.reference_rows
EditConditioning = references.EditConditioning


def split_references(cond: jax.Array, text_tokens: int, channels: int):
    """`references.split_references` with FLUX.2's 4 id columns."""
    return references.split_references(cond, text_tokens, channels, ID_COLUMNS)


def vae_scale_factor(vae_config: dict) -> int:
    """Pixels per VAE latent: 2 ** (levels - 1), as the pipelines compute it (8 released);
    a packed latent is twice that."""
    return 2 ** (len(vae_config.get("block_out_channels", (0, 0, 0, 0))) - 1)


def sample_shape(transformer_config: dict, vae_config: dict, resolution: int | None = None):
    """One packed latent, channels first, for square images of `resolution` pixels (default
    1024), which must be a multiple of a packed latent (16 pixels released)."""
    side_pixels = vae_scale_factor(vae_config) * PATCH
    pixels = int(resolution or DEFAULT_RESOLUTION)
    if pixels < side_pixels or pixels % side_pixels:
        raise ModelLoadError(
            f"model.flux2.resolution {pixels} must be a positive multiple of {side_pixels} "
            "pixels (one 2x2 patch of latents)."
        )
    side = pixels // side_pixels
    return (transformer_config.get("in_channels", 128), side, side)


def image_tokens(shape: tuple[int, ...]) -> int:
    """The pipelines' image_seq_len for mu: the packed latent's h * w tokens."""
    return shape[1] * shape[2]


def check_latent_channels(transformer_config: dict, vae_config: dict, where: Path) -> None:
    """The transformer takes and gives 2x2 patches of the VAE's latent channels."""
    packed = transformer_config.get("in_channels", 128)
    out = transformer_config.get("out_channels") or packed
    latent = vae_config.get("latent_channels", 32)
    if transformer_config.get("patch_size", 1) != 1:
        raise ModelLoadError(f"{where}'s transformer has patch_size != 1; {POINT}.")
    if packed != PATCH * PATCH * latent or out != packed:
        raise ModelLoadError(
            f"{where}'s transformer takes {packed} channels and gives {out}, not 2x2 patches "
            f"of its VAE's {latent} latent channels ({PATCH * PATCH * latent}); {POINT}."
        )


FOLDER = components.ImageFolder(
    TRANSFORMER, check_latent_channels, sample_shape, image_tokens, schedule_config
)


# Reference images (editing): the pipelines shrink one of more pixels to this area (LANCZOS),
# then crop it about its centre to a multiple of a packed latent.
MAX_REFERENCE_AREA = 1024 * 1024


def reference_pixels(image: np.ndarray, multiple: int) -> np.ndarray:
    """One reference image [H, W, 3] uint8 -> [h, w, 3] float32 in [-1, 1] as the pipelines
    prepare it: shrunk to MAX_REFERENCE_AREA pixels when larger, then centre-cropped to
    multiples of `multiple` pixels (a packed latent's side)."""
    picture = Image.fromarray(np.asarray(image, np.uint8)).convert("RGB")
    width, height = picture.size
    if width * height > MAX_REFERENCE_AREA:
        scale = np.sqrt(MAX_REFERENCE_AREA / (width * height))
        picture = picture.resize(
            (int(width * scale), int(height * scale)), Image.Resampling.LANCZOS
        )
        width, height = picture.size
    kept_width, kept_height = width // multiple * multiple, height // multiple * multiple
    if not kept_width or not kept_height:
        raise ValueError(
            f"a reference image of {width}x{height} pixels is smaller than one packed latent "
            f"({multiple}x{multiple})."
        )
    left, top = (width - kept_width) // 2, (height - kept_height) // 2
    picture = picture.crop((left, top, left + kept_width, top + kept_height))
    return np.asarray(picture, np.float32) / np.float32(255.0) * 2.0 - 1.0


def reference_ids(grids: list[tuple[int, int]]) -> np.ndarray:
    """[sum(rows * columns), 4] float32 ids of reference images with these patch grids, in
    order: image i at time `transformer.reference_time(i)` (`_prepare_image_ids`)."""
    return np.concatenate(
        [
            transformer.image_ids(rows, columns, transformer.reference_time(i))
            for i, (rows, columns) in enumerate(grids)
        ]
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ReferenceEncoder:
    """The pipelines' `prepare_image_latents` for one prompt: its reference images
    ([H, W, 3] uint8 each) -> (tokens [M, 4 * latent], ids [M, 4]) float32, each image's
    normalised patch latents row-major, one image after another."""

    module: vae.Flux2VAEEncoder
    params: dict
    multiple: int  # pixels per packed latent

    @functools.cached_property
    def _encode(self):
        return jax.jit(lambda params, pixels: self.module.apply({"params": params}, pixels))

    def __call__(self, images) -> tuple[np.ndarray, np.ndarray]:
        tokens, grids = [], []
        for image in images:
            pixels = reference_pixels(image, self.multiple)
            grid = np.asarray(self._encode(self.params, jnp.asarray(pixels)[None])[0])
            rows, columns, features = grid.shape
            tokens.append(grid.reshape(rows * columns, features).astype(np.float32))
            grids.append((rows, columns))
        return np.concatenate(tokens), reference_ids(grids)


def load_reference_encoder(folder: Path, dtype=jnp.float32) -> ReferenceEncoder:
    """The `vae/` folder's encoder half as a `ReferenceEncoder`."""
    where = folder / "config.json"
    config = files.read_json(where, POINT)
    vae_module(config, where, dtype)  # the class and the shared fields, checked
    try:
        module = vae.encoder_from_config(config, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {POINT}.") from None
    state = files.read_weights(folder, "diffusion_pytorch_model", POINT)
    with convert.weights_of(folder, POINT):
        params = vae.encoder_params_from_state_dict(state, module)
    return ReferenceEncoder(module, cast_floats(params, dtype), vae_scale_factor(config) * PATCH)


def vae_module(vae_config: dict, where: Path, dtype) -> vae.Flux2VAEDecoder:
    if vae_config.get("_class_name", "AutoencoderKLFlux2") != "AutoencoderKLFlux2":
        raise ModelLoadError(
            f"{where} describes a {vae_config.get('_class_name')}, not an AutoencoderKLFlux2; "
            f"{POINT}."
        )
    try:
        return vae.module_from_config(vae_config, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {POINT}.") from None


def decoder_shapes(module: vae.Flux2VAEDecoder, dtype):
    return jax.eval_shape(lambda: cast_floats(module.init_weights(jax.random.PRNGKey(0)), dtype))


def image_decoder(module: vae.Flux2VAEDecoder, batch_size: int):
    """`(params, latents [B, C, h, w]) -> images [B, H, W, 3]` in [0, 1], jitted:
    `vae.decode_fn`, `batch_size` latents at a time."""
    decode_some = vae.decode_fn(module)

    @jax.jit
    def decode(params, latents):
        return jax.lax.map(
            lambda z: decode_some(params, z[None])[0], latents, batch_size=batch_size
        )

    return decode


def load_decoder(folder: Path, dtype, batch_size: int) -> Decoder:
    """The `vae/` folder's decoder (its encoder is never read) as a model's `decode`."""
    where = folder / "config.json"
    module = vae_module(files.read_json(where, POINT), where, dtype)
    state = files.read_weights(folder, "diffusion_pytorch_model", POINT)
    with convert.weights_of(folder, POINT):
        params = vae.params_from_state_dict(state, module)
    return Decoder(image_decoder(module, batch_size), cast_floats(params, dtype))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Flux2Model(components.TransformerModel):
    """A loaded FLUX.2 folder; its `text_encoders` are a `Flux2TextEncoder`."""

    variant: str  # DEV or KLEIN: the text path
    guidance: float | None  # the distilled guidance scale `denoise` passes (None: klein)
    # Editing (model.flux2.reference_images > 0): each prompt's input images condition it.
    takes_input_images: bool = False
    input_image_size: tuple[int, int] | None = None
    # Editing: the guidance's empty prompt is the text rows only, so the unconditional pass
    # keeps each prompt's reference rows, as the pipelines feed both passes the references.
    unconditional_rows: int | None = None


def guidance_of(module, options) -> float | None:
    return float(options.guidance) if module.guidance_embeds else None


def load_flux2(path: str, dtype=jnp.float32, **options) -> Flux2Model:
    """Loads a FLUX.2 pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`
    (`text_max_length`: the pipelines' max_sequence_length, `guidance` (dev only),
    `resolution`, `shift`; `remat` is what `model.remat` asks for).
    """
    options = load_options(**options)
    opened = FOLDER.open(path, dtype, options)
    module = opened.module
    decode = load_decoder(opened.folders["vae"], dtype, options.decode_batch_size)
    encoder = load_text_encoder(
        opened.root, dtype, max_length=options.text_max_length, width=module.joint_attention_dim
    )
    guidance = guidance_of(module, options)
    fields = opened.model_fields(encoder, options)
    editing = {}
    if options.reference_images:
        side = reference_side(options, opened.vae_config)
        fields["encode_prompts"] = EditConditioning(
            encoder,
            load_reference_encoder(opened.folders["vae"], dtype),
            count=options.reference_images,
            side=side,
            width=module.joint_attention_dim,
            settings="model.flux2",
        )
        editing = dict(
            takes_input_images=True,
            input_image_size=(side, side),
            unconditional_rows=options.text_max_length,
        )
    return Flux2Model(
        **fields,
        denoise=make_denoise(
            module,
            guidance,
            float(opened.schedule.num_train_timesteps),
            text_tokens=options.text_max_length if editing else None,
        ),
        decode=decode,
        variant=encoder.variant,
        guidance=guidance,
        **editing,
    )


def reference_side(options, vae_config: dict) -> int:
    """The side in pixels of an editing model's input images: `reference_resolution`, or
    the output's `resolution` when 0; a multiple of a packed latent, at most 1024 (larger
    references the pipelines shrink)."""
    side = int(options.reference_resolution or options.resolution or DEFAULT_RESOLUTION)
    multiple = vae_scale_factor(vae_config) * PATCH
    if side % multiple or side * side > MAX_REFERENCE_AREA:
        raise ModelLoadError(
            f"model.flux2.reference_resolution {side} must be a multiple of {multiple} pixels "
            "and at most 1024."
        )
    return side
