"""A tiny random Wan2.1 text-to-video folder in the real diffusers layout, built with PyTorch.

The transformer (`WanTransformer3DModel`, saved in bfloat16 and sharded, as
Wan-AI/Wan2.1-T2V-*-Diffusers ship it), the video VAE (`AutoencoderKLWan`: 4x spatial and
4x temporal compression here, so the 4k + 1 frame rule holds), umT5 (`UMT5EncoderModel`,
sharded), a T5 tokenizer and the release's `UniPCMultistepScheduler` with flow sigmas are
diffusers' and transformers' PyTorch classes saved with `save_pretrained`, only tiny.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sd3_fixtures import WORDS
from sd_fixtures import perturb

TEXT_WIDTH = 16  # the tiny umT5's d_model, standing in for text_dim 4096
LATENT_CHANNELS = 4
RESOLUTION = (16, 32)  # pixels: 4 per latent, 2x2 latents per token -> 2x4 tokens a frame
NUM_FRAMES = 9  # 3 latent frames
TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    text_dim=TEXT_WIDTH,
    freq_dim=8,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)
VAE_CONFIG = dict(
    base_dim=8,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    latents_mean=[0.3, -0.2, 0.1, 0.5],
    latents_std=[1.5, 0.8, 2.0, 1.2],
)
# The release's scheduler_config.json (flow_shift 3.0: the 480p value).
SCHEDULER_CONFIG = dict(
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    num_train_timesteps=1000,
    flow_shift=3.0,
)
MODEL_INDEX = {
    "_class_name": "WanPipeline",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "transformer_2": [None, None],
    "vae": ["diffusers", "AutoencoderKLWan"],
    "boundary_ratio": None,
    "expand_timesteps": False,
}


def t5_pieces() -> list[tuple[str, float]]:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    return (
        pieces
        + [("▁" + w, -2.0) for w in WORDS]
        + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    )


def save_tokenizer(folder: Path) -> None:
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


def _save_umt5(root: Path, generator) -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    save_tokenizer(root / "tokenizer")
    model = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(t5_pieces()) + 6,
            d_model=TEXT_WIDTH,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
        )
    )
    perturb(model, generator)
    model.eval().save_pretrained(
        root / "text_encoder", safe_serialization=True, max_shard_size="20KB"
    )


def make_tiny_wan_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random Wan2.1 text-to-video pipeline folder at `path`; returns it."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    _save_umt5(path, generator)
    model = WanTransformer3DModel(**TRANSFORMER_CONFIG)
    perturb(model, generator)  # the zero-initialised tables and norms matter too
    # bfloat16 and sharded, as the releases: the index and its shards.
    model.to(torch.bfloat16).eval().save_pretrained(
        path / "transformer", safe_serialization=True, max_shard_size="20KB"
    )
    vae = AutoencoderKLWan(**VAE_CONFIG)
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    UniPCMultistepScheduler(**SCHEDULER_CONFIG).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
