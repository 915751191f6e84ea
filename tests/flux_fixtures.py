"""A tiny random FLUX.1 folder in the real diffusers layout, built with PyTorch.

The transformer (FLUX.1-dev style: guidance embedding; saved in bfloat16 and sharded, as
black-forest-labs/FLUX.1-dev ships it), the 16-channel VAE without quant convs, CLIP-L
(`CLIPTextModel`), T5 and the flow-matching scheduler with dynamic shifting are diffusers'
and transformers' PyTorch classes saved with `save_pretrained` (safetensors), only tiny.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from sd3_fixtures import MERGES, WORDS, clip_vocab
from sd_fixtures import perturb

T5_WIDTH = 32  # the tiny T5's d_model, standing in for FLUX's joint_attention_dim 4096
CLIP_WIDTH = 24  # the tiny CLIP-L's hidden size, standing in for pooled_projection_dim 768
RESOLUTION = 16  # pixels: the tiny VAE has two levels (2x), so 8x8 latents, 16 tokens
TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_WIDTH,
    pooled_projection_dim=CLIP_WIDTH,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
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
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# FLUX.1-dev's scheduler_config.json.
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "image_encoder": [None, None],
    "feature_extractor": [None, None],
}


def _save_clip(root: Path, generator) -> None:
    """CLIP-L as FLUX ships it: a `CLIPTextModel` (no projection), quick_gelu, padded with
    <|endoftext|>, legacy eos_token_id 2 (pooled at the highest id)."""
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
        model_max_length=77,
    ).save_pretrained(root / "tokenizer")
    shutil.rmtree(source)
    model = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
            eos_token_id=2,
            max_position_embeddings=77,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=CLIP_WIDTH,
            intermediate_size=37,
            hidden_act="quick_gelu",
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
    model = T5EncoderModel(
        T5Config(
            vocab_size=len(pieces) + 6,
            d_model=T5_WIDTH,
            d_kv=8,
            d_ff=40,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
        )
    )
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
    model = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
    perturb(model, generator)
    # bfloat16 and sharded, as the release: the index and its shards.
    model.to(torch.bfloat16).eval().save_pretrained(
        path / "transformer", safe_serialization=True, max_shard_size="100KB"
    )
    vae = AutoencoderKL(**VAE_CONFIG)
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
