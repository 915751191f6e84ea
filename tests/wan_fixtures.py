"""A tiny random Wan2.1 text-to-video folder in the real diffusers layout, built with PyTorch.

The transformer (`WanTransformer3DModel`, saved in bfloat16 and sharded, as
Wan-AI/Wan2.1-T2V-*-Diffusers ship it), the video VAE (`AutoencoderKLWan`: 4x spatial and
4x temporal compression here, so the 4k + 1 frame rule holds), umT5 (`UMT5EncoderModel`,
sharded), a T5 tokenizer and the release's `UniPCMultistepScheduler` with flow sigmas are
diffusers' and transformers' PyTorch classes saved with `save_pretrained`, only tiny: the WAN
table of launch/tiny_architectures.py, the architecture launch/tiny_folders.py writes without
torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch
from sd3_fixtures import WORDS
from sd_fixtures import perturb

from launch.tiny_architectures import WAN, WAN_LATENT_CHANNELS, WAN_TEXT_WIDTH

# Other tests size their inputs by these.
TEXT_WIDTH = WAN_TEXT_WIDTH  # the tiny umT5's d_model, standing in for text_dim 4096
LATENT_CHANNELS = WAN_LATENT_CHANNELS
RESOLUTION = (16, 32)  # pixels: 4 per latent, 2x2 latents per token -> 2x4 tokens a frame
NUM_FRAMES = 9  # 3 latent frames


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
    model = UMT5EncoderModel(UMT5Config(vocab_size=len(t5_pieces()) + 6, **WAN["text_encoder"]))
    perturb(model, generator)
    model.eval().save_pretrained(
        root / "text_encoder", safe_serialization=True, max_shard_size="20KB"
    )


def make_tiny_wan_folder(path, seed: int = 0, table: dict = WAN) -> Path:
    """Writes a tiny random Wan text-to-video pipeline folder of `table`'s architecture
    (Wan2.1's; WAN22: Wan2.2's VAE; WAN22_MOE: two experts) at `path`; returns it."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    _save_umt5(path, generator)
    experts = ["transformer"]
    if table["model_index"].get("transformer_2", [None])[0] is not None:
        experts.append("transformer_2")
    for expert in experts:
        model = WanTransformer3DModel(**table["transformer"])
        perturb(model, generator)  # the zero-initialised tables and norms matter too
        # bfloat16 and sharded, as the releases: the index and its shards.
        model.to(torch.bfloat16).eval().save_pretrained(
            path / expert, safe_serialization=True, max_shard_size="20KB"
        )
    # The table's tuples as lists: AutoencoderKLWan concatenates `dim_mult` with a list.
    vae = AutoencoderKLWan(
        **{k: list(v) if isinstance(v, tuple) else v for k, v in table["vae"].items()}
    )
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    UniPCMultistepScheduler(**table["scheduler"]).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(table["model_index"], indent=2))
    return path


@contextlib.contextmanager
def euler_scheduler(pipe, sigmas):
    """Within it `pipe` samples with diffusers' Euler scheduler on our `sigmas` (shift 1:
    taken as they are) in place of its own (the release's UniPC multistep solver), so its
    steps are the deterministic sampler's."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    euler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    euler.set_timesteps = functools.partial(euler.set_timesteps, sigmas=list(sigmas[:-1]))
    pipe.scheduler, original = euler, pipe.scheduler
    try:
        yield pipe
    finally:
        pipe.scheduler = original


def image_to_video_latents(
    pipe, image, noise, sigmas, *, prompts, resolution, num_frames, tokens, guidance=1.0
):
    """What `WanImageToVideoPipeline` (`pipe`, with `expand_timesteps`) ends on for the first
    frame `image` (uint8 HWC, resized by the pipeline) and channels-last `noise`, with the
    Euler scheduler on our `sigmas` (`euler_scheduler`). Returned channels-last."""
    from PIL import Image

    with euler_scheduler(pipe, sigmas), torch.no_grad():
        out = pipe(
            image=Image.fromarray(image),
            prompt=prompts,
            negative_prompt="",
            height=resolution[0],
            width=resolution[1],
            num_frames=num_frames,
            num_inference_steps=len(sigmas) - 1,
            guidance_scale=guidance,
            latents=torch.from_numpy(noise.copy()).permute(0, 4, 1, 2, 3),
            output_type="latent",
            max_sequence_length=tokens,
        ).frames
    return out.permute(0, 2, 3, 4, 1).numpy()
