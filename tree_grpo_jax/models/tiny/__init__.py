"""The tiny digits world: a text-to-image model small enough for a laptop CPU.

Stable Diffusion's parts at 8x8 pixels, trained on scikit-learn's bundled `load_digits` by
`python -m tree_grpo_jax.models.tiny.train`, in two twins: `ddim` (epsilon prediction on SD's
scaled_linear schedule) and `flow` (rectified flow, velocity prediction). The weights ship in
`tree_grpo_jax/assets/` and load through the same code that loads any saved checkpoint.

    grammar     prompts: "a [thin|thick] handwritten digit <zero..nine>"
    tokenizer   the word-level tokenizer over that grammar's vocabulary
    data        the fixed train/test split of `load_digits`
    networks    text encoder, UNet, their random weights, `decode`
    weights     the msgpack weight files in `assets/`
    model       `TinyModel`, `load_tiny`, `build_tiny`
    classifier  the digit classifier behind the digit rewards
    train       the pretraining and evaluation script
"""

from tree_grpo_jax.models.tiny.data import digits_dataset
from tree_grpo_jax.models.tiny.grammar import (
    DIGIT_PROMPTS,
    DIGIT_WORDS,
    STYLE_WORDS,
    STYLED_PROMPTS,
    digit_prompt,
    prompt_digit,
)
from tree_grpo_jax.models.tiny.model import TinyModel, build_tiny, load_tiny, model_from_weights
from tree_grpo_jax.models.tiny.networks import SAMPLE_SHAPE, decode
from tree_grpo_jax.models.tiny.weights import (
    ASSETS_DIR,
    KINDS,
    load_weights,
    save_weights,
    weights_path,
)

__all__ = [
    "ASSETS_DIR",
    "DIGIT_PROMPTS",
    "DIGIT_WORDS",
    "KINDS",
    "SAMPLE_SHAPE",
    "STYLED_PROMPTS",
    "STYLE_WORDS",
    "TinyModel",
    "build_tiny",
    "decode",
    "digit_prompt",
    "digits_dataset",
    "load_tiny",
    "load_weights",
    "model_from_weights",
    "prompt_digit",
    "save_weights",
    "weights_path",
]
