"""A tiny random Z-Image folder in the real diffusers layout, built with PyTorch.

The transformer (`ZImageTransformer2DModel`), the 16-channel VAE without quant convs (FLUX's
latent statistics, which Z-Image reuses), the text encoder (a transformers `Qwen3Model`, as
Tongyi-MAI/Z-Image-Turbo ships Qwen3-4B) and the flow-matching scheduler (the release's
static shift 3) are saved with `save_pretrained` (safetensors), only tiny. No Qwen tokenizer
is stored offline: `byte_tokenizer` builds a byte-level `Qwen2Tokenizer` (one token a byte,
the chat markers as special tokens, a chat template in the shape of Qwen3's), saved as the
folder's `tokenizer/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sd_fixtures import perturb

RESOLUTION = 32  # pixels: the tiny VAE has two levels (2x), so 16x16 latents, 64 patches
TEXT_WIDTH = 32  # the Qwen3 hidden size, the transformer's cap_feat_dim (2560 released)
TEXT_ENCODER = dict(
    vocab_size=260,  # the 256 byte tokens, <|endoftext|> and the chat markers
    hidden_size=TEXT_WIDTH,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 300.0},
)
TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=48,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=TEXT_WIDTH,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(8, 8, 8),
    axes_lens=(128, 16, 16),
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=RESOLUTION,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=False, shift=3.0)
MODEL_INDEX = {
    "_class_name": "ZImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3Model"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "ZImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
SPECIAL = ("<|im_start|>", "<|im_end|>")
# One turn per message, then the assistant header; empty thinking only when it is disabled.
CHAT_TEMPLATE = (
    r"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    r"'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    r"{% if enable_thinking is defined and enable_thinking is false %}"
    r"{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def _byte_characters() -> list[str]:
    """The 256 characters byte-level BPE writes the bytes as (printable bytes as themselves,
    the others shifted past 255)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer(padding_side: str = "right"):
    """A byte-level `Qwen2Tokenizer` of 259 tokens with a Qwen3-shaped chat template."""
    import transformers
    from tokenizers import AddedToken

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(_byte_characters())}}
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = padding_side
    return tok


def make_tiny_zimage_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random Z-Image pipeline folder at `path`; returns it."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    byte_tokenizer().save_pretrained(path / "tokenizer")
    text = transformers.Qwen3Model(transformers.Qwen3Config(**TEXT_ENCODER))
    perturb(text, generator)
    text.eval().save_pretrained(path / "text_encoder", safe_serialization=True)
    model = ZImageTransformer2DModel(**TRANSFORMER)
    perturb(model, generator)
    model.eval().save_pretrained(path / "transformer", safe_serialization=True)
    vae = AutoencoderKL(**VAE)
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
