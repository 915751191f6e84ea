"""Tiny random reward-model folders built with PyTorch, laid out as the real ones are.

`make_clip_folder` saves a transformers `CLIPModel` with `save_pretrained` (safetensors),
a CLIP tokenizer and an image processor config, like yuvalkirstain/PickScore_v1 or
openai/clip-vit-large-patch14, only tiny. Tests that need torch import this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from sd_fixtures import MERGES, make_vocab, perturb

VISION = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
TEXT = dict(
    hidden_size=24,
    intermediate_size=29,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
)


def make_clip_folder(path, *, projection_dim=16, hidden_act="gelu", seed=0, logit_scale=3.0):
    """A tiny random CLIP folder at `path`; returns `(path, the PyTorch CLIPModel)`."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_vocab()
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    tokenizer = CLIPTokenizer(
        str(path / "vocab.json"),
        str(path / "merges.txt"),
        model_max_length=TEXT["max_position_embeddings"],
    )
    tokenizer.save_pretrained(path)
    size = VISION["image_size"]
    CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(path)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
            hidden_act=hidden_act,
            **TEXT,
        ),
        vision_config=dict(hidden_act=hidden_act, **VISION),
        projection_dim=projection_dim,
        logit_scale_init_value=logit_scale,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config)
    perturb(model, torch.Generator().manual_seed(seed))
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model


def swap_tokenizer_layout(folder) -> str:
    """Rewrites the CLIP tokenizer in `folder` in the other layout a folder may carry:
    transformers 5's `tokenizer.json` alone becomes the hub's `vocab.json` and `merges.txt`,
    and the reverse. Returns the layout it wrote ("vocab" or "json")."""
    import tempfile

    from transformers import CLIPTokenizerFast

    folder = Path(folder)
    fast = CLIPTokenizerFast.from_pretrained(str(folder))
    if (folder / "tokenizer.json").is_file():
        fast.backend_tokenizer.model.save(str(folder))  # the BPE's vocab.json and merges.txt
        (folder / "tokenizer.json").unlink()
        return "vocab"
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        (folder / "tokenizer.json").write_bytes((Path(tmp) / "tokenizer.json").read_bytes())
    for name in ("vocab.json", "merges.txt"):
        (folder / name).unlink()
    return "json"


def swap_text_naming(weights_file) -> bool:
    """Renames a CLIP text tower's tensors in `weights_file` (safetensors) the other way a
    file may name them: with the `text_model.` prefix (the hub's files, transformers 4) or
    without (transformers 5's `CLIPTextModel`). Returns whether the result has the prefix."""
    from safetensors.numpy import load_file, save_file

    state = load_file(weights_file)
    prefixed = any(key.startswith("text_model.") for key in state)
    renamed = {
        (key.removeprefix("text_model.") if prefixed else f"text_model.{key}"): value
        for key, value in state.items()
    }
    save_file(renamed, weights_file, metadata={"format": "pt"})
    return not prefixed


def pil_image_processor():
    """transformers' CLIP image processor class that resizes with PIL, as the scorers'
    authors ran it: `CLIPImageProcessor` in transformers 4, `CLIPImageProcessorPil` in
    transformers 5 (whose `CLIPImageProcessor` resizes with torchvision)."""
    import transformers

    return getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)


def features(output):
    """The projected embeddings of `CLIPModel.get_text_features` / `get_image_features`: the
    tensor transformers 4 returns, or the `pooler_output` of the output transformers 5
    returns."""
    return getattr(output, "pooler_output", output)


def smooth_images(rng, count, height, width):
    """Real-looking test images: smooth colour blobs and gradients with mild noise, in [0, 1]."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    images = []
    for _ in range(count):
        image = np.zeros((height, width, 3))
        for _ in range(6):
            cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.4)
            blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))
            image += blob[..., None] * rng.uniform(-0.6, 0.9, 3)
        image += rng.uniform(-0.3, 0.3, 3) * x[..., None] + 0.3
        image += 0.03 * rng.standard_normal(image.shape)
        images.append(np.clip(image, 0.0, 1.0))
    return np.stack(images).astype(np.float32)
