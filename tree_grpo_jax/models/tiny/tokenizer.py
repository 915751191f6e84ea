"""A word-level tokenizer over the tiny model's fixed vocabulary.

The tiny model's prompts come from a closed grammar ("a thick handwritten digit seven"), so a
fixed word list plays the part of CLIP's BPE tokenizer: every prompt becomes
`[bos, words..., eos, pad...]` of a fixed length, and the empty prompt (the unconditional
branch of classifier-free guidance) is `[bos, eos, pad...]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tree_grpo_jax.errors import PromptError, echo
from tree_grpo_jax.models.tiny.grammar import DIGIT_WORDS, FILLER_WORDS, STYLE_WORDS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# <eos> is not id 2: transformers' CLIP treats eos id 2 as a legacy config and pools at
# the largest id instead of at <eos>.
VOCAB = (PAD, UNK, BOS, EOS, *FILLER_WORDS, *STYLE_WORDS, *DIGIT_WORDS)
TOKEN_IDS = {word: i for i, word in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (TOKEN_IDS[w] for w in (PAD, BOS, EOS, UNK))
MAX_LENGTH = 8


def tokenize(prompts: Sequence[str], max_length: int = MAX_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """Returns `(input_ids, attention_mask)`, both `[P, max_length]` int32.

    Unknown words map to `<unk>` rather than failing, as a BPE tokenizer would still encode
    them; a prompt too long for `max_length` is an error, not a silent truncation.
    """
    if isinstance(prompts, str):
        raise TypeError("tokenize takes a list of prompts, not a single string.")
    ids = np.full((len(prompts), max_length), PAD_ID, np.int32)
    mask = np.zeros((len(prompts), max_length), np.int32)
    for row, prompt in enumerate(prompts):
        words = prompt.lower().split()
        tokens = [BOS_ID, *(TOKEN_IDS.get(w, UNK_ID) for w in words), EOS_ID]
        if len(tokens) > max_length:
            raise PromptError(
                f"prompt {echo(prompt)} has {len(words)} words; at most {max_length - 2} fit."
            )
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    return ids, mask
