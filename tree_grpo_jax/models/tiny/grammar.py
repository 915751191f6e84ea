"""The tiny model's prompt grammar: "a [thin|thick] handwritten digit <zero..nine>"."""

from __future__ import annotations

from tree_grpo_jax.errors import PromptError, echo

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
STYLE_WORDS = ("thin", "thick")
# The words besides digits and styles, in the tokenizer's vocabulary order.
FILLER_WORDS = ("a", "handwritten", "digit")

DIGIT_PROMPTS = tuple(f"a handwritten digit {word}" for word in DIGIT_WORDS)
STYLED_PROMPTS = tuple(
    f"a {style} handwritten digit {word}" for style in STYLE_WORDS for word in DIGIT_WORDS
)


def digit_prompt(digit: int, style: str | None = None) -> str:
    """`digit_prompt(7, "thick") == "a thick handwritten digit seven"`."""
    if style is None:
        return DIGIT_PROMPTS[digit]
    if style not in STYLE_WORDS:
        raise ValueError(f"style must be one of {STYLE_WORDS} or None, got {style!r}.")
    return f"a {style} handwritten digit {DIGIT_WORDS[digit]}"


def prompt_digit(prompt: str) -> int:
    """The digit a prompt asks for (the last digit word in it)."""
    found = [DIGIT_WORDS.index(w) for w in prompt.lower().split() if w in DIGIT_WORDS]
    if not found:
        raise PromptError(f"prompt {echo(prompt)} names no digit; expected one of {DIGIT_WORDS}.")
    return found[-1]
