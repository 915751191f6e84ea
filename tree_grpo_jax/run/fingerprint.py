"""The run fingerprint: every setting a resume must keep, and a saved one read today."""

from __future__ import annotations

import json

import ml_collections

from tree_grpo_jax.config import base_config, flatten

# Fields a resumed run may change: they decide how long it runs and what it reports, not
# what any finished iteration computed.
RESUME_MAY_CHANGE = (
    "name",
    "train.iterations",
    "model.remat",
    "model.attention",
    # the same numbers; a checkpoint's param tree says which, and a restore that finds the
    # other one names the flag to set
    "model.scan_layers",
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
    "sampling.denoise_rows",  # how the denoiser's rows are batched, not what it computes
)


def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """Every setting a resume must keep, flat (`section.field` -> JSON value)."""
    return {
        path: json.loads(json.dumps(value, default=str))
        for path, value in flatten(config, leaves_only=True).items()
        if not any(path == k or (k.endswith(".") and path.startswith(k)) for k in RESUME_MAY_CHANGE)
    }


def with_added_defaults(saved: dict) -> dict:
    """A saved run fingerprint with every field added to the schema since it was written, at
    its default: a run that predates a field ran as its default does."""
    return {**fingerprint(base_config()), **saved}
