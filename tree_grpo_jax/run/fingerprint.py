"""The run fingerprint: every setting a resume must keep, and a saved one read today."""

from __future__ import annotations

import json

import ml_collections

from tree_grpo_jax.config import base_config

# Fields a resumed run may change: they decide how long it runs and what it reports, not
# what any finished iteration computed.
RESUME_MAY_CHANGE = (
    "name",
    "train.iterations",
    "model.remat",
    "model.compute_dtype",
    "prompts.eval_source",
    "prompts.eval_count",
    "eval.",
    "checkpoint.",
    "log.",
    "mesh.",
    "compile_cache.",
    "reward_models.",  # where the same reward weights live now
    "reward_options.chunk_size",
)


def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """Every setting a resume must keep, flat (`section.field` -> JSON value)."""

    def flat(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, ml_collections.ConfigDict):
                yield from flat(value, f"{path}.")
            elif not any(
                path == k or (k.endswith(".") and path.startswith(k)) for k in RESUME_MAY_CHANGE
            ):
                yield path, json.loads(json.dumps(value, default=str))

    return dict(flat(config))


def with_added_defaults(saved: dict) -> dict:
    """A saved run fingerprint with every field added to configs/base.py since it was
    written, at its default: a run that predates a field ran as its default does."""
    base = base_config()
    if base is None:
        return dict(saved)
    return {**fingerprint(base), **saved}
