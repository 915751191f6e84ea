"""Writes tiny random Stable Diffusion 1.5, SD3.5, FLUX.1, Wan2.1, Z-Image, Qwen-Image and
FLUX.2 (dev and klein) folders in the real diffusers layout, for a smoke run of those configs
without downloading any weights.

    python launch/tiny_folders.py --out=/tmp/tiny_sd   # -> /tmp/tiny_sd/{sd15,sd35,flux,wan,...}

Only the package's own dependencies are needed (`pip install -e .`): no torch. Each weight
file is the project's Flax module for that component (our UNet, SD3 MMDiT, FLUX, Z-Image and
Qwen-Image transformers and VAEs; transformers' Flax CLIP towers; our T5 and decoder text
encoders), given seeded random values and written under diffusers' and transformers' PyTorch
names and layouts (`weights.convert.flax_to_pytorch`, as `export` writes a trained denoiser)
in safetensors, beside the config.json files and tokenizers those PyTorch classes read. The
architectures are launch/tiny_architectures.py's tables, which the test fixtures build with
torch too (`tests/sd_fixtures.py`, `tests/sd3_fixtures.py`, `tests/flux_fixtures.py`,
`tests/wan_fixtures.py`, `tests/zimage_fixtures.py`, `tests/qwenimage_fixtures.py`): SD1.5's
UNet, VAE, CLIP text encoder, DDIM scheduler; SD3.5's MMDiT with dual-attention layers,
16-channel VAE, CLIP-L, CLIP-G, T5 and flow-matching scheduler; FLUX.1-dev's transformer with
guidance embedding, CLIP-L, T5 and the dynamically shifted scheduler; Wan2.1's transformer
(`WanTransformer3DModel`), video VAE, umT5 and UniPC flow scheduler; Z-Image-Turbo's
transformer, 16-channel VAE, Qwen3 text model and statically shifted scheduler; Qwen-Image's
transformer, causal VAE, Qwen2.5-VL and its scheduler (dynamic shift, terminal sigma);
Wan2.2-TI2V-5B's layout (`wan22`: Wan2.2's residual, patched VAE and `expand_timesteps`) and
Wan2.2-T2V-A14B's (`wan22-moe`: `transformer/` and `transformer_2/` switching at
`boundary_ratio`); FLUX.2's transformer, VAE decoder with its batch-norm statistics and flow
scheduler, with dev's Mistral 3 (`flux2`, a Mistral-shaped byte tokenizer) or klein's Qwen3
(`flux2-klein`) text encoder (tests/flux2_fixtures.py); a few thousand times smaller than
the releases. diffusers' `DiffusionPipeline.from_pretrained` reads the first three too
(tests/parity/test_tiny_folders_in_diffusers.py); the Wan, Qwen-Image and FLUX.2 folders'
VAEs hold their decoders only and their vision-language text encoders their language models
only (the halves the library runs), so they are read by the project's loaders. The samples
are noise: the folders check that a config runs, not what it learns.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the package (when it is not installed) and the tables
from launch.tiny_architectures import (  # noqa: E402
    FLUX,
    FLUX2,
    FLUX2_KLEIN,
    QWENIMAGE,
    SD15,
    SD35,
    WAN,
    WAN22,
    WAN22_MOE,
    ZIMAGE,
)
from tree_grpo_jax import interrupts  # noqa: E402
from tree_grpo_jax.cli.common import OneLineErrors, fail  # noqa: E402
from tree_grpo_jax.weights.staging import write_staged  # noqa: E402

KINDS = (
    "sd15",
    "sd35",
    "flux",
    "wan",
    "zimage",
    "qwenimage",
    "flux2",
    "flux2-klein",
    "wan22",
    "wan22-moe",
)

# ---------------------------------------------------------------------------------------------
# Tokenizers: a few letters and whole words, enough for prompts like "a photo of a cat".

WORDS = ("a", "photo", "of", "cat", "dog")
MERGES = ("c a", "ca t</w>", "d o", "do g</w>", "p h", "ph o", "pho t", "phot o</w>", "o f</w>")


def clip_vocab() -> dict[str, int]:
    """Like CLIP's: "!" first, the special tokens last (`<|endoftext|>` has the top id)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["!", "!</w>", *letters, *(c + "</w>" for c in letters)]
    tokens += [m.replace(" ", "") for m in MERGES] + [w + "</w>" for w in WORDS]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def sd15_vocab() -> dict[str, int]:
    """SD1.5's: the special tokens first, then letters, merges and whole words."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)]
    tokens += [m.replace(" ", "") for m in MERGES]
    tokens += [w + "</w>" for w in (*WORDS, "digit")]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def t5_pieces() -> list[tuple[str, float]]:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -2.0) for w in WORDS]
    return pieces + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]


def write_clip_tokenizer(folder: pathlib.Path, vocab: dict, pad: str, max_length: int) -> None:
    from transformers import CLIPTokenizer

    source = folder.parent / f"{folder.name}_src"
    source.mkdir()
    (source / "vocab.json").write_text(json.dumps(vocab))
    (source / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    CLIPTokenizer(
        str(source / "vocab.json"),
        str(source / "merges.txt"),
        pad_token=pad,
        model_max_length=max_length,
    ).save_pretrained(folder)
    shutil.rmtree(source)


def write_t5_tokenizer(folder: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    unigram = Tokenizer(models.Unigram(t5_pieces(), unk_id=2, byte_fallback=False))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    unigram.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    unigram.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    T5TokenizerFast(
        tokenizer_object=unigram,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=512,
    ).save_pretrained(folder)


# Z-Image's and Qwen-Image's Qwen2 tokenizer: one token a byte (no merges), the chat markers
# as special tokens, and a chat template in the shape of Qwen3's.
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
# One turn per message, then the assistant header; empty thinking only when it is disabled.
CHAT_TEMPLATE = (
    r"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    r"'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    r"{% if enable_thinking is defined and enable_thinking is false %}"
    r"{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def byte_characters() -> list[str]:
    """The 256 characters byte-level BPE writes the bytes as (printable bytes as themselves,
    the others shifted past 255)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer(padding_side: str = "right"):
    """A byte-level `Qwen2Tokenizer` of 259 tokens with a Qwen3-shaped chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(byte_characters())}}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_tokens([AddedToken(t, special=True) for t in CHAT_MARKERS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = padding_side
    return tokenizer


# FLUX.2-dev's tokenizer stands in for Mistral Small 3.1's: the byte tokenizer with Mistral's
# special tokens and a chat template in the shape of Mistral Small 3.1's (BOS, the system
# prompt in its markers, each user turn in the instruction markers, a content a string or a
# list of typed parts); its template token counts are not the real ones'.
MISTRAL_MARKERS = ("<s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
MISTRAL_TEMPLATE = (
    r"{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}"
    r"{%- for part in c if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    r"{%- endif -%}{%- endmacro -%}"
    r"{{ bos_token }}{%- for m in messages -%}"
    r"{%- if m['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + text(m['content']) + "
    r"'[/SYSTEM_PROMPT]' }}"
    r"{%- elif m['role'] == 'user' -%}{{ '[INST]' + text(m['content']) + '[/INST]' }}"
    r"{%- endif -%}{%- endfor -%}"
)


def mistral_byte_tokenizer():
    """`byte_tokenizer` with Mistral's markers as special tokens and a Mistral-shaped chat
    template (264 tokens)."""
    from tokenizers import AddedToken

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True) for t in MISTRAL_MARKERS])
    tokenizer.bos_token = "<s>"
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Weights: a Flax parameter tree's shapes, random values, PyTorch names, safetensors.


def random_params(shapes: dict, rng) -> dict:
    """Seeded values for a flat {path: shape} Flax tree: kernels scaled by 1/sqrt(fan-in) so
    activations stay of order one; norm scales near 1; biases and embeddings small."""
    import numpy as np

    flat = {}
    for path in sorted(shapes):
        shape, leaf = tuple(shapes[path]), path[-1]
        noise = rng.standard_normal(shape).astype(np.float32)
        if leaf == "kernel":
            fan_in = int(np.prod(shape[:-1])) or 1
            flat[path] = noise / np.float32(np.sqrt(fan_in))
        elif leaf in ("scale", "weight") and len(shape) == 1:
            flat[path] = 1 + 0.05 * noise
        elif leaf == "embedding":
            flat[path] = 0.1 * noise
        else:
            flat[path] = 0.05 * noise
    return flat


# Our VAE keeps the old attention names; diffusers' PyTorch files use the new ones.
_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def pytorch_state(flat: dict, list_names, renames=None) -> dict:
    """{PyTorch key: array} of a flat Flax tree, as `export` writes a denoiser."""
    from flax.traverse_util import unflatten_dict

    from tree_grpo_jax.weights import convert

    state = convert.flax_to_pytorch(unflatten_dict(flat), list_names=list_names)
    if not renames:
        return state
    renamed = {}
    for key, value in state.items():
        parts = key.split(".")
        parts[:-1] = [renames.get(p, p) for p in parts[:-1]]
        renamed[".".join(parts)] = value
    return renamed


def save_weights(folder: pathlib.Path, stem: str, state: dict) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})


def write_json(path: pathlib.Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def diffusers_config(pt_class: str, config: dict) -> dict:
    """A diffusers config.json: the class, the version, and the fields (lists, not tuples)."""
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    version = importlib.metadata.version("diffusers")
    return {"_class_name": pt_class, "_diffusers_version": version, **fields}


def write_denoiser(root: pathlib.Path, component, config: dict, rng, buffers=None) -> None:
    """`root/<component.folder>/`: config.json and the denoiser's random weights."""
    full = diffusers_config(component.pt_class, config)
    denoiser = component.denoiser(full)
    state = pytorch_state(random_params(denoiser.reference, rng), denoiser.list_names)
    state.update(buffers or {})
    write_json(root / component.folder / "config.json", full)
    save_weights(root / component.folder, "diffusion_pytorch_model", state)


def write_unet(root: pathlib.Path, config: dict, rng) -> None:
    from tree_grpo_jax.models.sd15.export import unet_denoiser
    from tree_grpo_jax.weights import convert

    full = diffusers_config("UNet2DConditionModel", config)
    denoiser = unet_denoiser(full)
    state = pytorch_state(random_params(denoiser.reference, rng), convert.DIFFUSERS_LIST_NAMES)
    write_json(root / "unet" / "config.json", full)
    save_weights(root / "unet", "diffusion_pytorch_model", state)


def write_vae(root: pathlib.Path, config: dict, rng) -> None:
    """The whole AutoencoderKL (encoder included, as the releases hold it)."""
    import jax

    from tree_grpo_jax.models.autoencoder_kl import module_from_config
    from tree_grpo_jax.weights import convert

    module = module_from_config(config, "the tiny VAE config", jax.numpy.float32, fixed={})
    shapes = convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.PRNGKey(0)))
    state = pytorch_state(
        random_params(shapes, rng), convert.DIFFUSERS_LIST_NAMES, renames=_VAE_ATTENTION
    )
    write_json(root / "vae" / "config.json", diffusers_config("AutoencoderKL", config))
    save_weights(root / "vae", "diffusion_pytorch_model", state)


def write_clip(root, encoder, tokenizer, vocab, pad, projection, rng, **config) -> None:
    """A transformers CLIPTextModel (or ...WithProjection) folder and its tokenizer."""
    from transformers import CLIPTextConfig

    from tree_grpo_jax.models import clip
    from tree_grpo_jax.weights import convert

    write_clip_tokenizer(root / tokenizer, vocab, pad, config["max_position_embeddings"])
    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        bos_token_id=vocab["<|startoftext|>"],
        pad_token_id=vocab[pad],
        **config,
    )
    pt_class = "CLIPTextModelWithProjection" if projection else "CLIPTextModel"
    text_config.architectures = [pt_class]
    module_class = clip.CLIPTextModelWithProjection if projection else clip.CLIPTextModel
    shapes = clip.param_shapes(clip.init_text, module_class(text_config))
    state = pytorch_state(random_params(convert.shapes_of(shapes), rng), ())
    text_config.save_pretrained(root / encoder)
    save_weights(root / encoder, "model", state)


def write_t5(root, encoder, tokenizer, rng, **config) -> None:
    """A transformers T5EncoderModel folder (one `shared.weight`, as save_pretrained ties
    `encoder.embed_tokens.weight` to it) and its fast tokenizer."""
    import jax
    import jax.numpy as jnp
    from transformers import T5Config

    from tree_grpo_jax.models.text_encoders import T5Encoder, t5_config
    from tree_grpo_jax.weights import convert

    write_t5_tokenizer(root / tokenizer)
    t5 = T5Config(vocab_size=len(t5_pieces()) + 6, **config)
    t5.architectures = ["T5EncoderModel"]
    t5.save_pretrained(root / encoder)
    module = T5Encoder(t5_config(root / encoder, "a tiny folder"), jnp.float32)
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids)["params"])
    flat = random_params(convert.shapes_of(shapes), rng)
    # Outputs of a few tenths, as the test fixtures' T5 (float32 rounding stays small).
    flat[("encoder", "final_layer_norm", "weight")] *= 0.2
    save_weights(root / encoder, "model", pytorch_state(flat, ()))


def write_scheduler(root: pathlib.Path, pt_class: str, config: dict) -> None:
    write_json(root / "scheduler" / "scheduler_config.json", diffusers_config(pt_class, config))


def write_model_index(root: pathlib.Path, index: dict) -> None:
    version = importlib.metadata.version("diffusers")
    write_json(root / "model_index.json", {**index, "_diffusers_version": version})


# ---------------------------------------------------------------------------------------------
# The four folders (launch/tiny_architectures.py's tables).


def write_sd15(root: pathlib.Path, rng) -> None:
    vocab = sd15_vocab()
    write_clip(
        root, "text_encoder", "tokenizer", vocab, "<|endoftext|>", False, rng,
        eos_token_id=vocab["<|endoftext|>"], **SD15["text_encoder"],
    )  # fmt: skip
    write_unet(root, SD15["unet"], rng)
    write_vae(root, SD15["vae"], rng)
    write_scheduler(root, "DDIMScheduler", SD15["scheduler"])
    write_model_index(root, SD15["model_index"])


def write_sd35(root: pathlib.Path, rng) -> None:
    from tree_grpo_jax.models.sd3 import mmdit
    from tree_grpo_jax.models.sd3.load import TRANSFORMER

    vocab = clip_vocab()
    # CLIP-L padded with <|endoftext|>; CLIP-G padded with "!" and pooled at its real eos id.
    write_clip(
        root, "text_encoder", "tokenizer", vocab, "<|endoftext|>", True, rng,
        **SD35["text_encoder"],
    )  # fmt: skip
    write_clip(
        root, "text_encoder_2", "tokenizer_2", vocab, "!", True, rng,
        eos_token_id=vocab["<|endoftext|>"], **SD35["text_encoder_2"],
    )  # fmt: skip
    write_t5(root, "text_encoder_3", "tokenizer_3", rng, **SD35["text_encoder_3"])
    config = SD35["transformer"]
    inner = config["attention_head_dim"] * config["num_attention_heads"]
    table = mmdit.sincos_position_table(
        inner, config["pos_embed_max_size"], config["sample_size"] // config["patch_size"]
    )  # diffusers' fixed `pos_embed.pos_embed` buffer, stored in its files
    write_denoiser(root, TRANSFORMER, config, rng, {mmdit.BUFFERS[0]: table[None]})
    write_vae(root, SD35["vae"], rng)
    write_scheduler(root, "FlowMatchEulerDiscreteScheduler", SD35["scheduler"])
    write_model_index(root, SD35["model_index"])


def write_flux(root: pathlib.Path, rng) -> None:
    from tree_grpo_jax.models.flux.load import TRANSFORMER

    vocab = clip_vocab()
    # CLIP-L padded with <|endoftext|>, as FLUX ships it.
    write_clip(
        root, "text_encoder", "tokenizer", vocab, "<|endoftext|>", False, rng,
        **FLUX["text_encoder"],
    )  # fmt: skip
    write_t5(root, "text_encoder_2", "tokenizer_2", rng, **FLUX["text_encoder_2"])
    write_denoiser(root, TRANSFORMER, FLUX["transformer"], rng)
    write_vae(root, FLUX["vae"], rng)
    write_scheduler(root, "FlowMatchEulerDiscreteScheduler", FLUX["scheduler"])
    write_model_index(root, FLUX["model_index"])


# The Wan VAE decoder's module lists; its RMS norms' `gamma` keep PyTorch's broadcast shape.
_WAN_VAE_LISTS = frozenset(
    {"up_blocks", "down_blocks", "resnets", "attentions", "upsamplers", "resample"}
)


def write_umt5(root, rng, **config) -> None:
    """A transformers UMT5EncoderModel folder (every block its own relative bias table) and
    a T5 fast tokenizer."""
    from transformers import UMT5Config

    from tree_grpo_jax.models.wan import text
    from tree_grpo_jax.weights import convert

    write_t5_tokenizer(root / "tokenizer")
    umt5 = UMT5Config(vocab_size=len(t5_pieces()) + 6, **config)
    umt5.architectures = ["UMT5EncoderModel"]
    umt5.save_pretrained(root / "text_encoder")
    raw = json.loads((root / "text_encoder" / "config.json").read_text())
    module = text.umt5_module(text.umt5_config(raw, root / "text_encoder", "a tiny folder"))
    flat = random_params(convert.shapes_of(text.umt5_shapes(module)), rng)
    flat[("encoder", "final_layer_norm", "weight")] *= 0.2  # outputs of a few tenths
    save_weights(root / "text_encoder", "model", pytorch_state(flat, ()))


def write_causal_vae(
    root: pathlib.Path, pt_class: str, config: dict, rng, encoder: bool = False
) -> None:
    """The causal VAE's decoder and post-quant conv (`AutoencoderKLWan`, or Qwen-Image's
    `AutoencoderKLQwenImage`, the same decoder), under its PyTorch names; with `encoder`,
    the encoder and quant conv that encode an image-to-video model's first frame."""
    from tree_grpo_jax.models import causal_vae, causal_vae_encoder
    from tree_grpo_jax.weights import convert

    full = diffusers_config(pt_class, config)
    shapes = convert.shapes_of(causal_vae.decoder_shapes(causal_vae.decoder_module(full)))
    if encoder:  # the first-frame encoder too (its temporal time convs never run on it)
        module = causal_vae_encoder.encoder_module(full)
        shapes.update(convert.shapes_of(causal_vae_encoder.encoder_shapes(module)))
    flat = random_params(shapes, rng)
    state = pytorch_state({k: v for k, v in flat.items() if k[-1] != "scale"}, _WAN_VAE_LISTS)
    for path, value in flat.items():
        if path[-1] == "scale":  # WanRMS_norm's gamma: [C, 1, 1] in attentions, else [C, 1, 1, 1]
            name = next(iter(pytorch_state({path[:-1] + ("bias",): value}, _WAN_VAE_LISTS)))
            ones = (1, 1) if "attentions" in path[-3] else (1, 1, 1)
            state[name.removesuffix(".bias") + ".gamma"] = value.reshape(-1, *ones)
    write_json(root / "vae" / "config.json", full)
    save_weights(root / "vae", "diffusion_pytorch_model", state)


def write_wan(root: pathlib.Path, rng, table: dict = WAN) -> None:
    """A Wan folder of `table`'s architecture (Wan2.1's, or a Wan2.2 one): a second,
    low-noise expert in `transformer_2/` when its model index names one."""
    import dataclasses

    from tree_grpo_jax.models.wan.load import EXPERTS, TRANSFORMER

    write_umt5(root, rng, **table["text_encoder"])
    write_denoiser(root, TRANSFORMER, table["transformer"], rng)
    if table["model_index"].get(EXPERTS[1], [None])[0] is not None:
        low = dataclasses.replace(TRANSFORMER, folder=EXPERTS[1])
        write_denoiser(root, low, table["transformer"], rng)
    # TI2V (expand_timesteps) encodes each prompt's input image: its VAE's encoder too.
    ti2v = bool(table["model_index"].get("expand_timesteps"))
    write_causal_vae(root, "AutoencoderKLWan", table["vae"], rng, encoder=ti2v)
    write_scheduler(root, "UniPCMultistepScheduler", table["scheduler"])
    write_model_index(root, table["model_index"])


def write_decoder_text(root: pathlib.Path, text_config, prefix: str, rng, tokenizer=None) -> None:
    """A transformers decoder text model folder (`text_config` saved as it is) with our
    `DecoderTextModel`'s random weights under `prefix` + transformers' names, and the byte
    tokenizer. Only the language model is written: the project's encoder reads no more."""
    from flax.traverse_util import unflatten_dict

    from tree_grpo_jax.models import decoder_text
    from tree_grpo_jax.weights import convert, stacking

    (tokenizer or byte_tokenizer()).save_pretrained(root / "tokenizer")
    text_config.save_pretrained(root / "text_encoder")
    raw = json.loads((root / "text_encoder" / "config.json").read_text())
    module = decoder_text.DecoderTextModel(decoder_text.config_from_transformers(raw))
    per_layer = stacking.unstack(dict(decoder_text.param_shapes(module)))
    flat = random_params(convert.shapes_of(per_layer), rng)
    state = convert.flax_to_pytorch(unflatten_dict(flat), list_names=("layers",))
    save_weights(root / "text_encoder", "model", {prefix + k: v for k, v in state.items()})


def write_zimage(root: pathlib.Path, rng) -> None:
    from transformers import Qwen3Config

    from tree_grpo_jax.models.zimage.load import TRANSFORMER

    text_config = Qwen3Config(**ZIMAGE["text_encoder"])
    text_config.architectures = ["Qwen3Model"]
    write_decoder_text(root, text_config, "", rng)  # Qwen3Model's keys have no prefix
    write_denoiser(root, TRANSFORMER, ZIMAGE["transformer"], rng)
    write_vae(root, ZIMAGE["vae"], rng)
    write_scheduler(root, "FlowMatchEulerDiscreteScheduler", ZIMAGE["scheduler"])
    write_model_index(root, ZIMAGE["model_index"])


def write_qwenimage(root: pathlib.Path, rng) -> None:
    from transformers import Qwen2_5_VLConfig

    from tree_grpo_jax.models.qwenimage.load import TRANSFORMER

    text_config = Qwen2_5_VLConfig(
        text_config=QWENIMAGE["text_encoder"], vision_config=QWENIMAGE["vision"]
    )
    text_config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    write_decoder_text(root, text_config, "model.", rng)  # the keys save_pretrained writes
    write_denoiser(root, TRANSFORMER, QWENIMAGE["transformer"], rng)
    write_causal_vae(root, "AutoencoderKLQwenImage", QWENIMAGE["vae"], rng)
    write_scheduler(root, "FlowMatchEulerDiscreteScheduler", QWENIMAGE["scheduler"])
    write_model_index(root, QWENIMAGE["model_index"])


def write_flux2_vae(root: pathlib.Path, config: dict, rng) -> None:
    """AutoencoderKLFlux2 whole: the encoder and its quant conv (reference images of an
    edit), the post-quant conv and the decoder, and the batch-norm statistics of the patch
    channels."""
    import jax
    import numpy as np

    from tree_grpo_jax.models.flux2 import vae
    from tree_grpo_jax.weights import convert

    full = diffusers_config("AutoencoderKLFlux2", config)
    shapes = {}
    for module in (vae.module_from_config(full), vae.encoder_from_config(full)):
        tree = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
        shapes.update(convert.shapes_of(tree))
    flat = random_params({k: v for k, v in shapes.items() if len(k) > 1}, rng)
    state = pytorch_state(flat, convert.DIFFUSERS_LIST_NAMES, renames=_VAE_ATTENTION)
    (features,) = shapes[("running_mean",)]
    noise = rng.standard_normal((2, features)).astype(np.float32)
    state["bn.running_mean"] = 0.5 * noise[0]
    state["bn.running_var"] = 1.0 + 0.5 * np.abs(noise[1])  # positive, as a variance is
    state["bn.num_batches_tracked"] = np.zeros((), np.int64)  # the buffer diffusers keeps
    write_json(root / "vae" / "config.json", full)
    save_weights(root / "vae", "diffusion_pytorch_model", state)


def write_flux2_parts(root: pathlib.Path, table: dict, rng) -> None:
    from tree_grpo_jax.models.flux2.load import TRANSFORMER

    write_denoiser(root, TRANSFORMER, table["transformer"], rng)
    write_flux2_vae(root, table["vae"], rng)
    write_scheduler(root, "FlowMatchEulerDiscreteScheduler", table["scheduler"])
    write_model_index(root, table["model_index"])


def write_flux2(root: pathlib.Path, rng) -> None:
    """FLUX.2-dev: a Mistral 3 text encoder (its language model's weights only)."""
    from transformers import Mistral3Config

    text_config = Mistral3Config(
        text_config=dict(FLUX2["text_encoder"]),
        vision_config=dict(FLUX2["vision"]),
        image_token_index=FLUX2["text_encoder"]["vocab_size"] - 1,
    )
    text_config.architectures = ["Mistral3ForConditionalGeneration"]
    write_decoder_text(
        root, text_config, "model.language_model.", rng, tokenizer=mistral_byte_tokenizer()
    )
    write_flux2_parts(root, FLUX2, rng)


def write_flux2_klein(root: pathlib.Path, rng) -> None:
    """FLUX.2-klein: a Qwen3 text encoder (`Qwen3ForCausalLM`, its LM head left out)."""
    from transformers import Qwen3Config

    text_config = Qwen3Config(**FLUX2_KLEIN["text_encoder"])
    text_config.architectures = ["Qwen3ForCausalLM"]
    write_decoder_text(root, text_config, "model.", rng)  # the keys save_pretrained writes
    write_flux2_parts(root, FLUX2_KLEIN, rng)


WRITERS = {
    "sd15": write_sd15,
    "sd35": write_sd35,
    "flux": write_flux,
    "wan": write_wan,
    "wan22": functools.partial(write_wan, table=WAN22),
    "wan22-moe": functools.partial(write_wan, table=WAN22_MOE),
    "zimage": write_zimage,
    "qwenimage": write_qwenimage,
    "flux2": write_flux2,
    "flux2-klein": write_flux2_klein,
}


def write_folder(kind: str, folder, seed: int = 0) -> pathlib.Path:
    """Writes the tiny `kind` folder at `folder` (which must not hold anything); returns it."""
    import numpy as np

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # One stream per kind, so --kinds=flux writes the same FLUX folder as all three do.
    WRITERS[kind](folder, np.random.default_rng([seed, KINDS.index(kind)]))
    return folder


# ---------------------------------------------------------------------------------------------
# The command line.


def parse_args(argv=None):
    p = OneLineErrors(
        prog="launch/tiny_folders.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--out", default="/tmp/tiny_sd", help="parent folder of sd15/, sd35/, ...")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace folders that already exist")
    return p.parse_args(argv)


def _stopped(name: str) -> str:
    return f"{name} stopped launch/tiny_folders.py; the folders it listed are whole."


def main(argv=None) -> dict[str, pathlib.Path]:
    args = parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        fail(f"unknown kind(s) {unknown}; choose from {', '.join(KINDS)}.", 2)
    if not kinds:
        fail(f"--kinds names no kind; choose from {', '.join(KINDS)}.", 2)
    out = pathlib.Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file, not a folder; pass a folder.", 2)
    for kind in kinds:  # every refusal before anything is written
        folder = out / kind
        if folder.exists() and not folder.is_dir():
            fail(f"{folder} is a file; pass another --out.", 2)
        if folder.is_dir() and any(folder.iterdir()) and not args.force:
            fail(f"{folder} exists and is not empty; --force replaces it.", 2)
    written = {}
    for kind in kinds:
        folder = out / kind
        start = time.perf_counter()
        # built beside its place and moved in whole: a stop or a failure leaves no half folder
        written[kind] = write_staged(folder, functools.partial(write_folder, kind, seed=args.seed))
        interrupts.set_stop_line(_stopped)  # the staged write set its own
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(
            f"{kind}: {folder} ({size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return written


if __name__ == "__main__":
    # Ctrl-C and SIGTERM: one line and exit 130 / 143 at any moment, the folder being built
    # removed; the folders already moved into place are kept.
    interrupts.install()
    interrupts.set_stop_line(_stopped)
    main()
