"""The files of a CLIP tokenizer or text tower folder, as either transformers generation
writes them.

- Tokenizer: the hub's folders carry `vocab.json` and `merges.txt` (what transformers 4's
  `CLIPTokenizer` reads); transformers 5 saves `tokenizer.json` alone (what every fast
  tokenizer reads). Either is enough.
- Text tower weights: transformers 5 saves a `CLIPTextModel` without the `text_model.`
  prefix that earlier releases and the hub's files carry; our Flax tree keeps the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.weights import files

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_VOCAB = ("vocab.json", "merges.txt")
_TEXT_PREFIX = "text_model."
_PROJECTION_PREFIX = "text_projection."


def missing_tokenizer_file(folder: Path) -> str | None:
    """The first of `vocab.json` / `merges.txt` that `folder` lacks when it has no
    `tokenizer.json` either; None when transformers can read a tokenizer there."""
    folder = Path(folder)
    if (folder / TOKENIZER_JSON).is_file():
        return None
    return next((name for name in TOKENIZER_VOCAB if not (folder / name).is_file()), None)


def check_tokenizer(root: Path, name: str, hint: str) -> None:
    """One ModelLoadError sentence when the model folder `root`'s `name/` holds no tokenizer
    that transformers can read."""
    missing = missing_tokenizer_file(Path(root) / name)
    if missing is not None:
        raise ModelLoadError(
            f"model folder {root} has no {name}/{missing} (nor {name}/{TOKENIZER_JSON}, "
            f"which would do instead); {hint}."
        )


def load_tokenizer(folder: Path, hint: str):
    """transformers' CLIP tokenizer of `folder`; one ModelLoadError sentence if it cannot be
    read."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    tokenizer_class = files.tokenizer_class(
        folder, TOKENIZER_VOCAB, CLIPTokenizer, CLIPTokenizerFast
    )
    try:
        return tokenizer_class.from_pretrained(str(folder))
    except Exception as e:  # a broken tokenizer folder is a load error
        raise ModelLoadError(f"could not read the tokenizer in {folder}: {e}; {hint}.") from None


def with_text_prefix(state: Mapping[str, object]) -> dict:
    """A text tower's PyTorch state dict named as the hub's files name it: `text_model.`
    before every tensor but the projection, when no tensor has it yet."""
    if any(key.startswith(_TEXT_PREFIX) for key in state):
        return dict(state)
    return {
        key if key.startswith(_PROJECTION_PREFIX) else _TEXT_PREFIX + key: value
        for key, value in state.items()
    }
