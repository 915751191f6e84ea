"""The ImageReward release (`ImageReward.pt`): its state dict checked and its BERT tokenizer.

The release is the state dict of the package's `ImageReward` module: `blip.visual_encoder.*`
(BLIP's ViT), `blip.text_encoder.*` (BLIP's BERT with cross-attention), `mlp.layers.*` (the
head) and BLIP's contrastive projections `blip.{vision,text}_proj.*`, which the score does not
use. The sizes are read from the tensor shapes; the head counts, which shapes do not show,
follow the release's 64-wide heads (ViT-L/16: 1024 / 16, BERT-base: 768 / 12).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tree_grpo_jax.rewards.convert.dtypes import _cast, _check_dtype
from tree_grpo_jax.rewards.convert.errors import (
    ConversionError,
    _fit_message,
    _misshaped,
    _reason,
)
from tree_grpo_jax.rewards.convert.reading import (
    _looks_like_aesthetic,
    _looks_like_open_clip,
    to_numpy_state_dict,
)
from tree_grpo_jax.rewards.imagereward import BERT_TOKENIZER_FILES
from tree_grpo_jax.weights.files import tokenizer_class as tokenizer_class_of

HEAD_WIDTH = 64
HEAD_LINEARS = (0, 2, 4, 6, 7)
_VIT = "blip.visual_encoder."
_BERT = "blip.text_encoder."
# In the release but not read by the score.
_UNUSED = re.compile(r"blip\.(vision_proj|text_proj)\.(weight|bias)|.*\.position_ids")
# BLIP's `init_tokenizer`: bert-base-uncased plus a [DEC] start token and an [ENC] token.
BLIP_SPECIAL_TOKENS = ({"bos_token": "[DEC]"}, {"additional_special_tokens": ["[ENC]"]})


def _count(keys, pattern: str) -> int:
    indices = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(indices) + 1 if indices else 0


def _heads(width: int, what: str) -> int:
    if width % HEAD_WIDTH:
        raise ConversionError(
            f"{what}'s width {width} is not a multiple of the release's {HEAD_WIDTH}-wide heads."
        )
    return width // HEAD_WIDTH


def release_config(state: Mapping[str, np.ndarray], what: str = "the checkpoint") -> dict:
    """The model's sizes (the loader's config.json) read from the release's tensor shapes."""
    needed = {
        "patch": _VIT + "patch_embed.proj.weight",
        "pos": _VIT + "pos_embed",
        "fc1": _VIT + "blocks.0.mlp.fc1.weight",
        "words": _BERT + "embeddings.word_embeddings.weight",
        "positions": _BERT + "embeddings.position_embeddings.weight",
        "ffn": _BERT + "encoder.layer.0.intermediate.dense.weight",
    }
    needed |= {f"head{i}": f"mlp.layers.{i}.weight" for i in HEAD_LINEARS}
    missing = [k for k in needed.values() if k not in state]
    if missing:
        raise ConversionError(
            f"{what} does not look like the ImageReward release ({_fit_message(missing, [], [])})."
        )
    shape = {name: tuple(state[key].shape) for name, key in needed.items()}
    patch, pos, words = shape["patch"], shape["pos"], shape["words"]
    if len(patch) != 4 or patch[1] != 3 or patch[2] != patch[3] or len(pos) != 3:
        raise ConversionError(f"{what} has a patch embedding {patch} that is not BLIP's ViT's.")
    side = int(round(np.sqrt(pos[1] - 1)))
    if side * side != pos[1] - 1 or pos[2] != patch[0]:
        raise ConversionError(f"{what}'s pos_embed {pos} is not a square grid plus one token.")
    vision, text = patch[0], words[1]
    widths = [shape["head0"][1]] + [shape[f"head{i}"][0] for i in HEAD_LINEARS]
    return {
        "model_type": "imagereward",
        "image_size": side * patch[2],
        "patch_size": patch[2],
        "vision_width": vision,
        "vision_layers": _count(state, r"blip\.visual_encoder\.blocks\.(\d+)\."),
        "vision_heads": _heads(vision, "the ViT"),
        "vision_mlp_width": shape["fc1"][0],
        "vision_eps": 1e-6,
        "vocab_size": words[0],
        "text_width": text,
        "text_layers": _count(state, r"blip\.text_encoder\.encoder\.layer\.(\d+)\."),
        "text_heads": _heads(text, "the BERT"),
        "text_mlp_width": shape["ffn"][0],
        "max_positions": shape["positions"][0],
        "text_eps": 1e-12,
        "mlp_widths": widths,
        "max_length": 35,
        "score_mean": 0.16717362830052426,
        "score_std": 1.0333394966054072,
    }


def expected_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """{release key: shape} of every tensor the score reads, for the sizes in `config`."""
    c = config
    v, t, p = c["vision_width"], c["text_width"], c["patch_size"]
    patches = (c["image_size"] // p) ** 2
    shapes = {
        _VIT + "cls_token": (1, 1, v),
        _VIT + "pos_embed": (1, patches + 1, v),
        _VIT + "patch_embed.proj.weight": (v, 3, p, p),
        _VIT + "patch_embed.proj.bias": (v,),
        _VIT + "norm.weight": (v,),
        _VIT + "norm.bias": (v,),
        _BERT + "embeddings.word_embeddings.weight": (c["vocab_size"], t),
        _BERT + "embeddings.position_embeddings.weight": (c["max_positions"], t),
        _BERT + "embeddings.LayerNorm.weight": (t,),
        _BERT + "embeddings.LayerNorm.bias": (t,),
    }

    def linear(key, out, inp):
        shapes[f"{key}.weight"] = (out, inp)
        shapes[f"{key}.bias"] = (out,)

    def norm(key, width):
        shapes[f"{key}.weight"] = (width,)
        shapes[f"{key}.bias"] = (width,)

    for i in range(c["vision_layers"]):
        block = f"{_VIT}blocks.{i}."
        norm(block + "norm1", v)
        norm(block + "norm2", v)
        linear(block + "attn.qkv", 3 * v, v)
        linear(block + "attn.proj", v, v)
        linear(block + "mlp.fc1", c["vision_mlp_width"], v)
        linear(block + "mlp.fc2", v, c["vision_mlp_width"])
    for i in range(c["text_layers"]):
        layer = f"{_BERT}encoder.layer.{i}."
        for attention, source in (("attention", t), ("crossattention", v)):
            linear(f"{layer}{attention}.self.query", t, t)
            linear(f"{layer}{attention}.self.key", t, source)
            linear(f"{layer}{attention}.self.value", t, source)
            linear(f"{layer}{attention}.output.dense", t, t)
            norm(f"{layer}{attention}.output.LayerNorm", t)
        linear(layer + "intermediate.dense", c["text_mlp_width"], t)
        linear(layer + "output.dense", t, c["text_mlp_width"])
        norm(layer + "output.LayerNorm", t)
    widths = c["mlp_widths"]
    for i, inp, out in zip(HEAD_LINEARS, widths[:-1], widths[1:], strict=True):
        linear(f"mlp.layers.{i}", out, inp)
    return shapes


def convert_imagereward(
    state_dict: Mapping, dtype: str = "float32", what: str = "the checkpoint"
) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, the tensors the score reads, cast to `dtype`; the head in float32)."""
    out_dtype = _check_dtype(dtype)
    state = to_numpy_state_dict(state_dict, what)
    if _looks_like_open_clip(state):
        raise ConversionError(
            f"{what} looks like an open_clip CLIP checkpoint, not the ImageReward release; "
            "convert it with the `hpsv2` subcommand."
        )
    if _looks_like_aesthetic(state):
        raise ConversionError(
            f"{what} looks like the LAION aesthetic predictor's MLP, not the ImageReward "
            "release; convert it with the `aesthetic` subcommand."
        )
    config = release_config(state, what)
    if config["mlp_widths"][0] != config["text_width"] or config["mlp_widths"][-1] != 1:
        raise ConversionError(
            f"{what}'s head has widths {config['mlp_widths']}, which do not run from the BERT's "
            f"width {config['text_width']} to one score."
        )
    expected = expected_shapes(config)
    kept = {k: v for k, v in state.items() if not _UNUSED.fullmatch(k)}
    missing = [k for k in expected if k not in kept]
    unexpected = sorted(k for k in kept if k not in expected)
    misshaped = _misshaped(kept, expected)
    if missing or unexpected or misshaped:
        raise ConversionError(
            f"{what} does not fit ImageReward's layout "
            f"({_fit_message(missing, unexpected, misshaped)})."
        )
    head = np.dtype(np.float32)
    weights = {k: _cast(v, head if k.startswith("mlp.") else out_dtype) for k, v in kept.items()}
    return config, weights


def _tokenizer_folder(path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"tokenizer folder {folder} does not exist.")
    for candidate in (folder, folder / "tokenizer"):
        if any((candidate / name).is_file() for name in BERT_TOKENIZER_FILES):
            return candidate
    raise ConversionError(
        f"{folder} has no vocab.txt (nor tokenizer.json), so it is not a BERT tokenizer folder "
        "(bert-base-uncased)."
    )


def blip_tokenizer(path):
    """bert-base-uncased's tokenizer from a local folder, with BLIP's two added tokens."""
    from transformers import BertTokenizer, BertTokenizerFast

    folder = _tokenizer_folder(path)
    tokenizer_class = tokenizer_class_of(
        folder, BERT_TOKENIZER_FILES[:1], BertTokenizer, BertTokenizerFast
    )
    try:
        tokenizer = tokenizer_class.from_pretrained(str(folder))
    except Exception as e:  # a broken vocabulary or config
        raise ConversionError(
            f"could not read the BERT tokenizer in {folder} ({_reason(e)})."
        ) from None
    for tokens in BLIP_SPECIAL_TOKENS:
        tokenizer.add_special_tokens(tokens)
    return tokenizer


def tokenizer_files(tokenizer, vocab_size: int, where: str) -> dict[str, str]:
    """{file name: text} of the tokenizer, refused unless it fills the embedding exactly."""
    if len(tokenizer) != vocab_size:
        raise ConversionError(
            f"the tokenizer in {where} has {len(tokenizer)} tokens with BLIP's [DEC] and [ENC], "
            f"but the release's BERT embeds {vocab_size}; pass bert-base-uncased's tokenizer."
        )
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_text(encoding="utf-8") for p in Path(tmp).iterdir() if p.is_file()}
