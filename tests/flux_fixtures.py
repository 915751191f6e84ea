"""A tiny random FLUX.1 folder in the real diffusers layout, built with PyTorch.

The transformer (FLUX.1-dev style: guidance embedding; saved in bfloat16 and sharded, as
black-forest-labs/FLUX.1-dev ships it), the 16-channel VAE without quant convs, CLIP-L
(`CLIPTextModel`), T5 and the flow-matching scheduler with dynamic shifting are diffusers'
and transformers' PyTorch classes saved with `save_pretrained` (safetensors), only tiny: the
FLUX table of launch/tiny_architectures.py, the architecture launch/tiny_folders.py writes
without torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from sd3_fixtures import MERGES, WORDS, clip_vocab
from sd_fixtures import perturb

from launch.tiny_architectures import FLUX

RESOLUTION = 16  # pixels: the tiny VAE has two levels (2x), so 8x8 latents, 16 tokens
SCHEDULER_CONFIG = FLUX["scheduler"]  # FLUX.1-dev's, which other tests vary


def _save_clip(root: Path, generator) -> None:
    """CLIP-L as FLUX ships it: a `CLIPTextModel` (no projection), padded with <|endoftext|>."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = clip_vocab()
    source = root / "tokenizer_src"
    source.mkdir()
    (source / "vocab.json").write_text(json.dumps(vocab))
    (source / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    CLIPTokenizer(
        str(source / "vocab.json"),
        str(source / "merges.txt"),
        pad_token="<|endoftext|>",
        model_max_length=FLUX["text_encoder"]["max_position_embeddings"],
    ).save_pretrained(root / "tokenizer")
    shutil.rmtree(source)
    model = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
            **FLUX["text_encoder"],
        )
    )
    perturb(model, generator)
    model.eval().save_pretrained(root / "text_encoder", safe_serialization=True)


def _save_t5(root: Path, generator) -> None:
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
    ).save_pretrained(root / "tokenizer_2")
    model = T5EncoderModel(T5Config(vocab_size=len(pieces) + 6, **FLUX["text_encoder_2"]))
    perturb(model, generator)
    with torch.no_grad():  # outputs of a few tenths keep float32 rounding below 1e-5
        model.encoder.final_layer_norm.weight.mul_(0.2)
    model.eval().save_pretrained(root / "text_encoder_2", safe_serialization=True)


def make_tiny_flux_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random FLUX.1-dev style pipeline folder at `path`; returns it."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    _save_clip(path, generator)
    _save_t5(path, generator)
    model = FluxTransformer2DModel(**FLUX["transformer"])
    perturb(model, generator)
    # bfloat16 and sharded, as the release: the index and its shards.
    model.to(torch.bfloat16).eval().save_pretrained(
        path / "transformer", safe_serialization=True, max_shard_size="100KB"
    )
    vae = AutoencoderKL(**FLUX["vae"])
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**FLUX["scheduler"]).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(FLUX["model_index"], indent=2))
    return path
