"""The one interface every text-to-image model sits behind.

The tree engine and the trainer see only this: a denoiser function over trainable params,
a prompt encoder, a decoder and a schedule factory. Which library the networks come from
(diffusers' and transformers' Flax classes today) stays inside `models/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tree_grpo_jax import sampling

PyTree = Any
# (params, x [B, *sample_shape], t [B], cond [B, L, D]) -> eps / v / velocity, shaped like x.
DenoiseFn = Callable[[PyTree, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class TextToImageModel:
    """A loaded model.

    `denoise` must be the same function object for the life of the model so that jitted
    code that takes it as a static argument compiles once. `params` are the trainable
    denoiser weights; the text encoder and decoder weights are closed over by
    `encode_prompts` and `decode` and never enter the optimizer.
    """

    name: str
    sample_shape: tuple[int, ...]  # one sample, channels first, e.g. (4, 64, 64)
    params: PyTree
    denoise: DenoiseFn
    encode_prompts: Callable[[Sequence[str]], jax.Array]  # -> [P, L, D] float32
    decode: Callable[[jax.Array], jax.Array]  # [B, *sample_shape] -> [B, H, W, C] in [0, 1]
    schedule_kind: str = "ddim"  # "ddim" or "flow"
    prediction_type: str = "epsilon"  # "epsilon" / "v_prediction" (ddim); flow predicts velocity
    extras: dict = dataclasses.field(default_factory=dict)

    def make_schedule(self, num_steps: int, **kwargs) -> sampling.Schedule:
        """kwargs: `eta` for DDIM; `noise_level` and `shift` for flow."""
        if self.schedule_kind == "ddim":
            return sampling.make_ddim_schedule(
                num_steps, prediction_type=self.prediction_type, **kwargs
            )
        if self.schedule_kind == "flow":
            return sampling.make_flow_schedule(num_steps, **kwargs)
        raise ValueError(f"unknown schedule kind {self.schedule_kind!r}; use 'ddim' or 'flow'.")
