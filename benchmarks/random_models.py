"""The models the accelerator benchmark times, as a table of public architectures.

Each entry builds a `TextToImageModel` of its architecture with random weights drawn on the
host and random conditioning of the shape its text encoders give: nothing is downloaded and
no text encoder or VAE runs (only the denoiser is timed; `decode` returns the latents). The
denoiser is the one the family's loader builds (`make_denoise` of `models.sd15.load`,
`models.sd3.load` and `models.flux.load`), in bfloat16 over float32 master weights, so what
is timed is what training a loaded model runs. Each entry also names the repository config whose
training settings (guidance, remat, dtypes) the benchmark keeps.

An architecture the library does not have yet would be a row with no builder and the reason
it is owed; every family here has its builder.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import text_encoders
from tree_grpo_jax.models.base import DDIMScheduleConfig, TextToImageModel

VAE_DOWNSCALE = 8  # pixels per latent, SD1.5's and SD3's VAEs alike

# Stable Diffusion 1.5's unet/config.json (stable-diffusion-v1-5/stable-diffusion-v1-5), the
# fields our UNet reads; sample_size is set from the resolution.
SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=(
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
)
# SD1.5's block types and conditioning at a tiny size (two levels): checks the code on a CPU.
SMOKE_UNET = dict(
    SD15_UNET,
    sample_size=8,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    attention_head_dim=2,
    cross_attention_dim=32,
)
SD15_TEXT_TOKENS = 77  # CLIP ViT-L/14's context

# stabilityai/stable-diffusion-3.5-medium transformer/config.json: the MMDiT-X, 24 joint
# blocks of width 1536 (24 heads of 64), dual attention in blocks 0-12, RMS qk-norm. Its
# sample_size (128) only sets the position table's base grid; latents come from the resolution.
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# A tiny MMDiT-X like tests/sd3_fixtures.py's, one block (the CPU compile grows with each):
# dual attention, RMS qk-norm, and the last block's text stream that ends before its MLP.
SMOKE_MMDIT = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=128,
    caption_projection_dim=16,
    pooled_projection_dim=40,
    pos_embed_max_size=12,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
# SD3's prompt tokens: CLIP-L/G's 77 then T5's 256 (the loader's t5_max_length default).
SD3_TEXT_TOKENS = 77 + 256
SMOKE_SD3_TEXT_TOKENS = 8
SD3_SHIFT = 3.0  # SD3.5's scheduler_config.json

# black-forest-labs/FLUX.1-dev transformer/config.json: 19 double-stream and 38 single-stream
# blocks of width 3072 (24 heads of 128), the distilled guidance embedded.
FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# A tiny FLUX like tests/flux_fixtures.py's: one block of each kind.
SMOKE_FLUX = dict(
    FLUX1_DEV,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
)
FLUX_TEXT_TOKENS = 512  # T5's tokens, FLUX.1-dev's max_sequence_length
SMOKE_FLUX_TEXT_TOKENS = 8
FLUX_GUIDANCE = 3.5  # the distilled guidance of configs/flux_branchgrpo.py
FLUX_SHIFT = 3.0  # its static sigma shift
POOL_SIZE = 1 << 25  # normals drawn once (SD3.5-M's largest kernel has 21M); weights are windows


@dataclasses.dataclass(frozen=True)
class Options:
    """How to build: the image side in pixels, tiny networks or real ones, attention choices."""

    resolution: int
    smoke: bool = False
    sd15_attention: dict = dataclasses.field(default_factory=dict)  # UNet module options
    mmdit_attention: str = "xla"  # model.attention's kernel for the transformers


@dataclasses.dataclass(frozen=True)
class Built:
    """A model ready for `train.setup(config, workdir, model=...)`."""

    model: TextToImageModel
    network: dict  # the denoiser's config as built
    cond_shape: tuple[int, int]  # one prompt's conditioning [L, D]
    params: int  # denoiser parameters


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One row of the table."""

    name: str  # the key in the results
    title: str
    build: Callable[[Options], Built] | None = None
    config: str = ""  # the repository config module whose training settings are kept
    train_rows: int = 0  # rows per train step at full size, on one device
    owed: str = ""  # why there is no builder yet


# ---------------------------------------------------------------------------------------------
# Random weights and conditioning.


def random_params(shapes, seed: int = 0):
    """Float32 weights in the shapes of `shapes` (a tree of ShapeDtypeStructs): kernels
    standard normal over the square root of their fan-in, norm scales 1, biases 0.

    Timing needs no trained values, and billions of fresh normals would take longer than
    the compile: each kernel is a window, at a random offset, of one pool of normals."""
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes))
    pool = rng.standard_normal(min(POOL_SIZE, total), dtype=np.float32)

    def draw(path, leaf):
        name = path[-1].key
        if name != "kernel":
            return jnp.full(leaf.shape, 1.0 if name == "scale" else 0.0, jnp.float32)
        scale = np.float32(1.0 / np.sqrt(np.prod(leaf.shape[:-1])))
        values = _window(pool, rng, int(np.prod(leaf.shape))) * scale
        return jnp.asarray(values.reshape(leaf.shape))

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _window(pool: np.ndarray, rng, size: int) -> np.ndarray:
    """`size` consecutive values of `pool` from a random start: a view when they fit, else
    a copy that wraps around."""
    if size <= pool.size:
        start = int(rng.integers(pool.size - size + 1))
        return pool[start : start + size]
    start = int(rng.integers(pool.size))
    out = np.empty(size, np.float32)
    filled, position = 0, start
    while filled < size:
        n = min(size - filled, pool.size - position)
        out[filled : filled + n] = pool[position : position + n]
        filled, position = filled + n, 0
    return out


def prompt_draw(prompt: str, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normals seeded by the prompt's text: the same prompt, the same embedding."""
    rng = np.random.default_rng(zlib.crc32(prompt.encode()))
    return rng.standard_normal(shape, dtype=np.float32)


def count_params(params) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(params)))


def latent_side(options: Options, multiple: int, what: str) -> int:
    """The latent side for the resolution; a resolution the network cannot take is one
    sentence."""
    step = VAE_DOWNSCALE * multiple
    if options.resolution % step:
        raise ValueError(
            f"{what} needs a resolution that is a multiple of {step} px, not {options.resolution}."
        )
    return options.resolution // VAE_DOWNSCALE


# ---------------------------------------------------------------------------------------------
# The builders.


def build_sd15(options: Options) -> Built:
    from tree_grpo_jax.models.sd15.load import make_denoise
    from tree_grpo_jax.models.sd15.unet import unet_module

    base = SMOKE_UNET if options.smoke else SD15_UNET
    levels = 2 ** (len(base["block_out_channels"]) - 1)  # each level halves the latents
    config = dict(base, sample_size=latent_side(options, levels, "the SD1.5 UNet"))
    unet = unet_module(config, jnp.bfloat16, **options.sd15_attention)
    params = random_params(jax.eval_shape(unet.init_weights, jax.random.PRNGKey(0)))
    width = config["cross_attention_dim"]

    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        return jnp.asarray(np.stack([prompt_draw(p, (SD15_TEXT_TOKENS, width)) for p in prompts]))

    size = config["sample_size"]
    model = TextToImageModel(
        name="sd15-architecture-random",
        sample_shape=(config["in_channels"], size, size),
        params=params,
        denoise=make_denoise(unet),
        encode_prompts=encode_prompts,
        decode=lambda latents: latents,
        media="latents",  # nothing decoded: the benchmark times the denoiser alone
        schedule_config=DDIMScheduleConfig(),  # SD1.5's
    )
    return Built(model, config, (SD15_TEXT_TOKENS, width), count_params(params))


def _sd3_abstract_params(module, config: dict):
    """The MMDiT's params as ShapeDtypeStructs, from a one-patch init (nothing computed)."""
    patch = config.get("patch_size", 2)
    x = jnp.zeros((1, config.get("in_channels", 16), 2 * patch, 2 * patch))
    context = jnp.zeros((1, 1, config.get("joint_attention_dim", 4096)))
    pooled = jnp.zeros((1, config.get("pooled_projection_dim", 2048)))
    t = jnp.zeros((1,))
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x, context, pooled, t))[
        "params"
    ]


def build_sd35m(options: Options) -> Built:
    from tree_grpo_jax.models.sd3 import load, mmdit

    config = dict(SMOKE_MMDIT if options.smoke else SD35_MEDIUM)
    side = latent_side(options, config["patch_size"], "the SD3.5 MMDiT")
    module = mmdit.transformer_module(config, jnp.bfloat16, attention=options.mmdit_attention)
    params = random_params(_sd3_abstract_params(module, config))
    width, pooled = config["joint_attention_dim"], config["pooled_projection_dim"]
    tokens = SMOKE_SD3_TEXT_TOKENS if options.smoke else SD3_TEXT_TOKENS

    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        # The text encoders' two outputs, packed into one array as the loader packs them.
        embeds = np.stack([prompt_draw(p, (tokens, width)) for p in prompts])
        vectors = np.stack([prompt_draw(p + " (pooled)", (pooled,)) for p in prompts])
        return text_encoders.pack_conditioning(jnp.asarray(embeds), jnp.asarray(vectors))

    model = TextToImageModel(
        name="sd35m-architecture-random",
        sample_shape=(config.get("in_channels", 16), side, side),
        params=params,
        denoise=load.make_denoise(module, width, pooled),
        encode_prompts=encode_prompts,
        decode=lambda latents: latents,
        media="latents",  # nothing decoded: the benchmark times the denoiser alone
        schedule_config=load.FlowMatchScheduleConfig(shift=SD3_SHIFT),
    )
    return Built(model, config, (tokens + 1, max(width, pooled)), count_params(params))


def build_flux1_dev(options: Options) -> Built:
    from tree_grpo_jax.models.flux import load, transformer

    config = dict(SMOKE_FLUX if options.smoke else FLUX1_DEV)
    side = latent_side(options, transformer.LATENT_PATCH, "the FLUX transformer")
    module = transformer.transformer_module(config, jnp.bfloat16, attention=options.mmdit_attention)
    params = random_params(load.abstract_params(module))
    width, pooled = config["joint_attention_dim"], config["pooled_projection_dim"]
    tokens = SMOKE_FLUX_TEXT_TOKENS if options.smoke else FLUX_TEXT_TOKENS

    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        # T5's tokens and CLIP-L's pooled vector, packed into one array as the loader does.
        embeds = np.stack([prompt_draw(p, (tokens, width)) for p in prompts])
        vectors = np.stack([prompt_draw(p + " (pooled)", (pooled,)) for p in prompts])
        return text_encoders.pack_conditioning(jnp.asarray(embeds), jnp.asarray(vectors))

    model = TextToImageModel(
        name="flux1-dev-architecture-random",
        sample_shape=(config["in_channels"] // transformer.LATENT_PATCH**2, side, side),
        params=params,
        denoise=load.make_denoise(module, FLUX_GUIDANCE),
        encode_prompts=encode_prompts,
        decode=lambda latents: latents,
        media="latents",  # nothing decoded: the benchmark times the denoiser alone
        schedule_config=load.FluxScheduleConfig(
            image_seq_len=(side // transformer.LATENT_PATCH) ** 2, static_shift=FLUX_SHIFT
        ),
    )
    return Built(model, config, (tokens + 1, max(width, pooled)), count_params(params))


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="sd15",
        title="Stable Diffusion 1.5 (UNet, 860M)",
        config="configs.sd15",
        train_rows=8,
        build=build_sd15,
    ),
    Architecture(
        name="sd35m",
        title="Stable Diffusion 3.5 Medium (MMDiT-X, 2.2B)",
        config="configs.sd35m",
        # 4 MMDiT rows with guidance; XLA's attention keeps every layer's [heads, N, N]
        # probabilities for the backward pass (N = 1358 tokens at 512 px)
        train_rows=2,
        build=build_sd35m,
    ),
    Architecture(
        name="flux1_dev",
        title="FLUX.1-dev (MMDiT, 12B)",
        config="configs.flux_branchgrpo",
        train_rows=1,  # one 1024-token row at 512 px (2025 at 720: --resolution 720)
        build=build_flux1_dev,
    ),
)


def by_name() -> dict[str, Architecture]:
    return {a.name: a for a in ARCHITECTURES}
