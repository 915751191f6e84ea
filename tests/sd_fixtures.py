"""A tiny random Stable Diffusion folder in the real diffusers layout, built with PyTorch.

The components are diffusers' and transformers' PyTorch classes saved with `save_pretrained`
(safetensors), exactly as a Stable Diffusion 1.5 folder holds them, only a few thousand
times smaller: launch/tiny_architectures.py's SD15 table, the architecture
launch/tiny_folders.py writes without torch. Tests that need torch import this module; the
library never does.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch.tiny_architectures import SD15

# Letters and a few whole words, enough for prompts like "a photo of a cat".
WORDS = ("a", "photo", "of", "cat", "dog", "digit")
MERGES = ("c a", "ca t</w>", "d o", "do g</w>", "p h", "ph o", "pho t", "phot o</w>", "o f</w>")


def make_vocab() -> dict[str, int]:
    tokens = ["<|startoftext|>", "<|endoftext|>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += letters + [c + "</w>" for c in letters]
    tokens += [m.replace(" ", "") for m in MERGES]
    tokens += [w + "</w>" for w in WORDS if w + "</w>" not in tokens]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def perturb(module, generator) -> None:
    """Adds noise to every weight so that ones/zeros (norm scales, biases) are not special."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def make_tiny_sd_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random SD pipeline folder at `path` and returns it as a Path."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)

    tok_dir = path / "tokenizer_src"
    tok_dir.mkdir(exist_ok=True)
    vocab = make_vocab()
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    tokenizer = CLIPTokenizer(
        str(tok_dir / "vocab.json"),
        str(tok_dir / "merges.txt"),
        model_max_length=SD15["text_encoder"]["max_position_embeddings"],
    )
    tokenizer.save_pretrained(path / "tokenizer")
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()

    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **SD15["text_encoder"],
    )
    models = {
        "unet": UNet2DConditionModel(**SD15["unet"]),
        "vae": AutoencoderKL(**SD15["vae"]),
        "text_encoder": CLIPTextModel(text_config),
    }
    for name, model in models.items():
        perturb(model, generator)
        model.eval().save_pretrained(path / name, safe_serialization=True)
    DDIMScheduler(**SD15["scheduler"]).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(SD15["model_index"], indent=2))
    return path
