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
    rewards     the digit rewards
    family      the family's record (`model.name="tiny"`)
    train       the pretraining and evaluation script

Modules are imported by name (`from tree_grpo_jax.models.tiny.model import load_tiny`), so that
importing the package (as finding the families does) reads nothing heavy.
"""
