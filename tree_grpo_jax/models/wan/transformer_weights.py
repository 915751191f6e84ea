"""The Wan transformer's weights at the diffusers boundary, both ways, in numpy (torch is never
imported): a `transformer/` state dict (PyTorch names and layouts) -> the Flax params of a
`WanTransformer`, its blocks stacked on a layer axis when the module scans them; and params
(scanned or not) -> the state dict diffusers' `WanTransformer3DModel.load_state_dict` takes.
The names need no table (`weights.convert`); the scanned blocks go through
`weights.stacking`."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from tree_grpo_jax.models import dit_layers
from tree_grpo_jax.models.wan.transformer import MODULE_LISTS, WanTransformer


def abstract_params(module: WanTransformer) -> dict:
    """The module's params as shape structs (nothing is computed)."""
    return jax.eval_shape(module.init_weights, jax.random.key(0))


def params_from_state_dict(module: WanTransformer, state: Mapping[str, np.ndarray]) -> dict:
    """The params of `module` from a diffusers state dict of numpy arrays, blocks stacked
    where the module scans them (`dit_layers.params_from_state_dict`)."""
    return dit_layers.params_from_state_dict(module, state)


def state_dict_from_params(params: Mapping) -> dict[str, np.ndarray]:
    """The diffusers state dict (PyTorch names and layouts, numpy) of params, scanned or
    not."""
    return dit_layers.state_dict_from_params(params, MODULE_LISTS)
