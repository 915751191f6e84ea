"""The tiny family's record: the embedded digits model in its two twins, trained
("tiny", "tiny_flow") or with random weights ("random_tiny", "random_tiny_flow"), with its
prompt set ("digits") and its classifier's rewards (`digit_alignment`, ...)."""

from __future__ import annotations

from tree_grpo_jax.models import registry
from tree_grpo_jax.models.tiny.grammar import DIGIT_PROMPTS


def _kind(request: registry.LoadRequest) -> str:
    return "flow" if request.name.endswith("flow") else "ddim"


def _load(request: registry.LoadRequest):
    from tree_grpo_jax.models.tiny.model import build_tiny, load_tiny

    kind = _kind(request)
    if request.name.startswith("random_"):
        return build_tiny(kind, seed=request.seed, dtype=request.dtype)
    return load_tiny(kind, dtype=request.dtype)


def _abstract(request: registry.LoadRequest):
    from tree_grpo_jax.models.tiny.model import abstract_tiny

    return abstract_tiny(_kind(request), request.dtype)


FAMILY = registry.register(
    registry.ModelFamily(
        name="tiny",
        model_names=("tiny", "tiny_flow", "random_tiny", "random_tiny_flow"),
        load=_load,
        # its UNet is SD's in miniature: the same attention projections
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        prompt_sets={"digits": DIGIT_PROMPTS},
        rewards=registry.deferred("tree_grpo_jax.models.tiny.rewards:REWARDS"),
        abstract=_abstract,
        image_features=registry.deferred("tree_grpo_jax.models.tiny.classifier:digit_features"),
        # the package's default run: the embedded DDIM model on its digits, a few minutes on
        # a laptop CPU
        default_run={
            "model.name": "tiny",
            "prompts.source": "digits",
            "rewards": "digit_alignment",
        },
    )
)
