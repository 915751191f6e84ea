"""The CLIP tokenizer files of a converted folder.

Built from open_clip's bundled BPE or copied from a Hugging Face folder, and checked against
the text tower.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tree_grpo_jax.rewards.convert.errors import ConversionError, _reason

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# open_clip's SimpleTokenizer names the two special tokens differently from transformers.
_OPEN_CLIP_SPECIALS = {"<start_of_text>": BOS_TOKEN, "<end_of_text>": EOS_TOKEN}
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
# Copied from --tokenizer when present; transformers rebuilds it from vocab/merges otherwise.
_OPTIONAL_TOKENIZER_FILES = ("tokenizer.json",)


def _tokenizer_config(context_length: int) -> dict:
    return {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": context_length,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "errors": "replace",
        "do_lower_case": True,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }


def _special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }


def open_clip_tokenizer_files(context_length: int = 77) -> dict[str, str]:
    """{file name: text} of a transformers CLIP tokenizer built from open_clip's bundled BPE.

    The vocabulary is open_clip's SimpleTokenizer's, in its order, with its two special tokens
    under transformers' names.
    """
    try:
        from open_clip.tokenizer import SimpleTokenizer
    except ImportError:
        raise ConversionError(
            "open_clip is not installed, so there is no BPE vocabulary to build the tokenizer "
            "from; pass --tokenizer=<a Hugging Face CLIP folder> "
            "(e.g. openai/clip-vit-large-patch14)."
        ) from None
    tokenizer = SimpleTokenizer(context_length=context_length)
    encoder = tokenizer.encoder
    contiguous = sorted(encoder.values()) == list(range(len(encoder)))
    if not contiguous or not set(_OPEN_CLIP_SPECIALS) <= set(encoder):
        raise ConversionError(
            "this open_clip version builds its vocabulary differently; pass --tokenizer=<a "
            "Hugging Face CLIP folder>."
        )
    vocab = {_OPEN_CLIP_SPECIALS.get(token, token): i for token, i in encoder.items()}
    merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.get)
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n",
        "tokenizer_config.json": json.dumps(_tokenizer_config(context_length), indent=2) + "\n",
        "special_tokens_map.json": json.dumps(_special_tokens_map(), indent=2) + "\n",
    }


def _tokenizer_folder(path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"tokenizer folder {folder} does not exist.")
    for candidate in (folder, folder / "tokenizer"):
        if (candidate / "vocab.json").is_file() and (candidate / "merges.txt").is_file():
            return candidate
    raise ConversionError(
        f"{folder} has no vocab.json and merges.txt, so it is not a Hugging Face CLIP "
        "tokenizer folder."
    )


def copied_tokenizer_files(path, context_length: int) -> dict[str, str]:
    """{file name: text} of the CLIP tokenizer in a Hugging Face folder (or its tokenizer/)."""
    folder = _tokenizer_folder(path)
    files = {}
    for name in TOKENIZER_FILES + _OPTIONAL_TOKENIZER_FILES:
        if (folder / name).is_file():
            try:
                files[name] = (folder / name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConversionError(f"could not read {folder / name} ({_reason(e)}).") from None
    files.setdefault(
        "tokenizer_config.json", json.dumps(_tokenizer_config(context_length), indent=2)
    )
    files.setdefault("special_tokens_map.json", json.dumps(_special_tokens_map(), indent=2))
    return files


def check_tokenizer(files: Mapping[str, str], hf_config: dict, where: str) -> None:
    """Refuses a vocabulary other than the text tower's (size, start- and end-of-text ids)."""
    try:
        vocab = json.loads(files["vocab.json"])
    except ValueError as e:
        raise ConversionError(f"the vocab.json of {where} is not JSON ({_reason(e)}).") from None
    if not isinstance(vocab, dict):
        raise ConversionError(f"the vocab.json of {where} does not hold a JSON object.")
    text = hf_config["text_config"]
    if len(vocab) != text["vocab_size"]:
        raise ConversionError(
            f"the tokenizer of {where} has {len(vocab)} tokens but the text tower has "
            f"{text['vocab_size']}."
        )
    if vocab.get(EOS_TOKEN) != text["eos_token_id"] or vocab.get(BOS_TOKEN) != text["bos_token_id"]:
        raise ConversionError(
            f"the tokenizer of {where} puts {BOS_TOKEN} and {EOS_TOKEN} at ids "
            f"{vocab.get(BOS_TOKEN)} and {vocab.get(EOS_TOKEN)}, not at "
            f"{text['bos_token_id']} and {text['eos_token_id']} as open_clip does."
        )
