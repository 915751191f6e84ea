"""A tiny random Stable Diffusion 3.5 folder in the real diffusers layout, built with PyTorch.

The transformer (with dual-attention layers and RMS qk-norm, as SD3.5 has), the 16-channel
VAE without quant convs, CLIP-L, CLIP-G, a sharded T5 and the flow-matching scheduler are
diffusers' and transformers' PyTorch classes saved with `save_pretrained` (safetensors),
exactly as stabilityai/stable-diffusion-3.5-medium holds them, only tiny: the SD35 table of
launch/tiny_architectures.py, the architecture launch/tiny_folders.py writes without torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from sd_fixtures import MERGES, perturb

from launch.tiny_architectures import SD35, SD35_T5_WIDTH

# Other tests size their inputs by these.
T5_WIDTH = SD35_T5_WIDTH  # the tiny T5's d_model, standing in for SD3's joint_attention_dim
TRANSFORMER_CONFIG = SD35["transformer"]

WORDS = ("a", "photo", "of", "cat", "dog")


def clip_vocab() -> dict[str, int]:
    """Like CLIP's: "!" first, the special tokens last (so `<|endoftext|>` has the top id)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["!", "!</w>", *letters, *(c + "</w>" for c in letters)]
    tokens += [m.replace(" ", "") for m in MERGES] + [w + "</w>" for w in WORDS]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def _save_clip(root: Path, vocab, encoder: str, tokenizer: str, pad: str, generator, **config):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    source = root / f"{tokenizer}_src"
    source.mkdir()
    (source / "vocab.json").write_text(json.dumps(vocab))
    (source / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    CLIPTokenizer(
        str(source / "vocab.json"),
        str(source / "merges.txt"),
        pad_token=pad,
        model_max_length=config["max_position_embeddings"],
    ).save_pretrained(root / tokenizer)
    shutil.rmtree(source)
    model = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            pad_token_id=vocab[pad],
            **config,
        )
    )
    perturb(model, generator)
    model.eval().save_pretrained(root / encoder, safe_serialization=True)


def _save_t5(root: Path, generator):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -2.0) for w in WORDS] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
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
    ).save_pretrained(root / "tokenizer_3")
    model = T5EncoderModel(T5Config(vocab_size=len(pieces) + 6, **SD35["text_encoder_3"]))
    perturb(model, generator)
    with torch.no_grad():
        # T5's outputs at a few tenths rather than a few units: XLA's and PyTorch's float32
        # rounding differ by ~3e-6 relative over this model, which must stay below 1e-5.
        model.encoder.final_layer_norm.weight.mul_(0.2)
    # Sharded, as SD3's text_encoder_3 is: model.safetensors.index.json and its shards.
    model.eval().save_pretrained(
        root / "text_encoder_3", safe_serialization=True, max_shard_size="40KB"
    )


def make_tiny_sd3_text(root: Path, seed: int = 0) -> Path:
    """The text half of a diffusers-layout SD3 folder, tiny and random."""
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = clip_vocab()
    # CLIP-L padded with <|endoftext|>; CLIP-G padded with "!" and pooled at its real eos id.
    _save_clip(
        root, vocab, "text_encoder", "tokenizer", "<|endoftext|>", generator, **SD35["text_encoder"]
    )
    _save_clip(
        root,
        vocab,
        "text_encoder_2",
        "tokenizer_2",
        "!",
        generator,
        eos_token_id=vocab["<|endoftext|>"],
        **SD35["text_encoder_2"],
    )
    _save_t5(root, generator)
    return root


def make_tiny_sd3_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random SD3.5 pipeline folder at `path` and returns it as a Path."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    path = Path(path)
    make_tiny_sd3_text(path, seed=seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, model in (
        ("transformer", SD3Transformer2DModel(**SD35["transformer"])),
        ("vae", AutoencoderKL(**SD35["vae"])),
    ):
        perturb(model, generator)
        model.eval().save_pretrained(path / name, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SD35["scheduler"]).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(SD35["model_index"], indent=2))
    return path
