"""A tiny random Stable Diffusion 3.5 folder in the real diffusers layout, built with PyTorch.

The transformer (with dual-attention layers and RMS qk-norm, as SD3.5 has), the 16-channel
VAE without quant convs, CLIP-L, CLIP-G, a sharded T5 and the flow-matching scheduler are
diffusers' and transformers' PyTorch classes saved with `save_pretrained` (safetensors),
exactly as stabilityai/stable-diffusion-3.5-medium holds them, only tiny.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from sd_fixtures import MERGES, perturb

T5_WIDTH = 128  # the tiny T5's d_model, standing in for SD3's joint_attention_dim 4096


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
        str(source / "vocab.json"), str(source / "merges.txt"), pad_token=pad, model_max_length=77
    ).save_pretrained(root / tokenizer)
    shutil.rmtree(source)
    model = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            pad_token_id=vocab[pad],
            max_position_embeddings=77,
            num_hidden_layers=2,
            num_attention_heads=4,
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
    config = T5Config(
        vocab_size=len(pieces) + 6,
        d_model=T5_WIDTH,
        d_kv=16,
        d_ff=72,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
    )
    model = T5EncoderModel(config)
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
    # CLIP-L as SD3 ships it (legacy eos_token_id 2: pooled at the highest id, quick_gelu,
    # padded with <|endoftext|>); CLIP-G padded with "!" and pooled at its real eos id.
    _save_clip(
        root,
        vocab,
        "text_encoder",
        "tokenizer",
        "<|endoftext|>",
        generator,
        hidden_size=32,
        intermediate_size=37,
        projection_dim=16,
        hidden_act="quick_gelu",
        eos_token_id=2,
    )
    _save_clip(
        root,
        vocab,
        "text_encoder_2",
        "tokenizer_2",
        "!",
        generator,
        hidden_size=48,
        intermediate_size=53,
        projection_dim=24,
        hidden_act="gelu",
        eos_token_id=vocab["<|endoftext|>"],
    )
    _save_t5(root, generator)
    return root


POOLED = 16 + 24  # the tiny CLIP-L and CLIP-G projections, concatenated
TRANSFORMER_CONFIG = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=T5_WIDTH,
    caption_projection_dim=16,
    pooled_projection_dim=POOLED,
    pos_embed_max_size=12,
    dual_attention_layers=(0, 1),
    qk_norm="rms_norm",
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=16,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0)
MODEL_INDEX = {
    "_class_name": "StableDiffusion3Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "tokenizer_3": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "image_encoder": [None, None],
    "feature_extractor": [None, None],
}


def make_tiny_sd3_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random SD3.5 pipeline folder at `path` and returns it as a Path."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    path = Path(path)
    make_tiny_sd3_text(path, seed=seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, model in (
        ("transformer", SD3Transformer2DModel(**TRANSFORMER_CONFIG)),
        ("vae", AutoencoderKL(**VAE_CONFIG)),
    ):
        perturb(model, generator)
        model.eval().save_pretrained(path / name, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
