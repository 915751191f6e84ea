"""The package's UNet (`models.unet`, `models.unet_layers`) against diffusers' PyTorch
`UNet2DConditionModel` built tiny and random, its weights converted by `weights.convert`:
with its default numerics our UNet computes what it computes; with `FLAX_NUMERICS` it
computes what it computes once its GEGLU takes the tanh GELU and its transformers' GroupNorm
eps 1e-5, and nothing else differs. (Against diffusers' former Flax UNet, which
`FLAX_NUMERICS` reproduces bit for bit: tests/parity/test_flax_references.py.)
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tree_grpo_jax.models import unet, unet_layers
from tree_grpo_jax.models.tiny.networks import UNET_CONFIG
from tree_grpo_jax.weights import convert

ATOL = 1e-4  # against PyTorch in float32, as tests/parity/test_sd_loading.py
# Against torch changed as an option says: the default numerics come within 3e-6 of plain
# torch (float32 noise); the tanh GELU alone moves the output by 1.4e-4.
CHANGED_ATOL = 2e-5


def _randn(seed: int, *shapes):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


# ---------------------------------------------------------------------------------------------
# The chunked attention's maths.


def test_memory_efficient_attention_over_several_key_chunks():
    """More keys than one chunk: the chunks' partial softmaxes combine to the whole one."""
    q, k, v = _randn(0, (12, 3, 8), (40, 3, 8), (40, 3, 8))
    chunked = unet_layers.memory_efficient_attention(q, k, v, query_chunk=4, key_chunk=8)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(8)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(chunked), np.einsum("hqk,khd->qhd", probs, v), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Against diffusers' PyTorch UNet.


@pytest.fixture(scope="module")
def torch_unet():
    """The tiny model's architecture as diffusers' PyTorch UNet, random and perturbed."""
    torch = pytest.importorskip("torch")
    from diffusers import UNet2DConditionModel

    from tests.sd_fixtures import perturb

    torch.manual_seed(0)
    model = UNet2DConditionModel(**UNET_CONFIG)
    perturb(model, torch.Generator().manual_seed(0))
    return model.eval()


def _torch_output(model, x, t, cond):
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(x), torch.from_numpy(t).long(), torch.from_numpy(cond))
    return out.sample.numpy()


def _ours(module, params, x, t, cond):
    return np.asarray(jax.jit(lambda p: module.apply({"params": p}, x, t, cond).sample)(params))


@pytest.fixture(scope="module")
def converted(torch_unet):
    """(the torch UNet's weights through `convert.pytorch_to_flax`, inputs, torch's output)."""
    module = unet.unet_module(UNET_CONFIG)
    reference = convert.shapes_of(jax.eval_shape(module.init_weights, jax.random.key(0)))
    state = {k: v.numpy() for k, v in torch_unet.state_dict().items()}
    params = convert.pytorch_to_flax(state, reference)
    x, cond = _randn(0, (3, 1, 8, 8), (3, 16, 32))
    t = np.asarray([1, 421, 981], np.int32)
    return params, (x, t, cond)


def test_unet_matches_torch(torch_unet, converted):
    params, inputs = converted
    theirs = _torch_output(torch_unet, *inputs)
    ours = _ours(unet.unet_module(UNET_CONFIG), params, *inputs)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def _with_flax_numerics(model, gelu_tanh: bool, norm_eps: float | None):
    """`model` with tanh GELU in its GEGLUs and/or `norm_eps` in its transformers' input
    GroupNorm: what `FLAX_NUMERICS` says diffusers' Flax UNet computes differently."""
    import copy

    import torch.nn.functional as F
    from diffusers.models.activations import GEGLU
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    model = copy.deepcopy(model)
    for layer in model.modules():
        if isinstance(layer, GEGLU) and gelu_tanh:
            layer.gelu = lambda gate: F.gelu(gate, approximate="tanh")
        if isinstance(layer, Transformer2DModel) and norm_eps is not None:
            layer.norm.eps = norm_eps
    return model


def test_flax_numerics_are_torch_with_tanh_gelu_and_eps_1e5(torch_unet, converted):
    """Each option makes the one change it names: torch so changed is matched as closely as
    plain torch is by the default numerics; and together they move the UNet's output
    visibly further from plain torch than that."""
    params, inputs = converted
    plain = _torch_output(torch_unet, *inputs)
    noise = np.abs(_ours(unet.unet_module(UNET_CONFIG), params, *inputs) - plain).max()
    assert noise < CHANGED_ATOL / 4
    cases = [
        (dict(gelu_approximate=True), dict(gelu_tanh=True, norm_eps=None)),
        (dict(transformer_norm_eps=1e-5), dict(gelu_tanh=False, norm_eps=1e-5)),
        (unet.FLAX_NUMERICS, dict(gelu_tanh=True, norm_eps=1e-5)),
    ]
    for options, change in cases:
        ours = _ours(unet.unet_module(UNET_CONFIG, **options), params, *inputs)
        theirs = _torch_output(_with_flax_numerics(torch_unet, **change), *inputs)
        np.testing.assert_allclose(ours, theirs, atol=CHANGED_ATOL, rtol=0, err_msg=str(options))
    flax_numerics = ours
    assert np.abs(flax_numerics - plain).max() > 10 * noise


def test_transformer_norm_eps_is_torch_group_norm_eps():
    """On inputs of small variance, where the GroupNorm's eps matters, our spatial transformer
    with `norm_eps` e computes what diffusers' PyTorch one computes with eps e, and the two
    eps (PyTorch's 1e-6, diffusers' Flax 1e-5) give different outputs."""
    torch = pytest.importorskip("torch")
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from tests.sd_fixtures import perturb

    torch.manual_seed(0)
    theirs = Transformer2DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=32,
        cross_attention_dim=24,
        norm_num_groups=32,
    ).eval()
    perturb(theirs, torch.Generator().manual_seed(0))
    x, context = _randn(0, (2, 32, 4, 4), (2, 6, 24))
    x = 0.003 * x
    nhwc = x.transpose(0, 2, 3, 1)
    init = lambda: unet_layers.Transformer2D(32, 4, 8).init(jax.random.key(0), nhwc, context)
    reference = convert.shapes_of(jax.eval_shape(init)["params"])
    state = {k: v.numpy() for k, v in theirs.state_dict().items()}
    params = {"params": convert.pytorch_to_flax(state, reference)}
    outputs = {}
    for eps in (unet_layers.TRANSFORMER_NORM_EPS, unet.FLAX_NUMERICS["transformer_norm_eps"]):
        theirs.norm.eps = eps
        with torch.no_grad():
            expected = theirs(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(context))
        ours = unet_layers.Transformer2D(32, 4, 8, norm_eps=eps).apply(params, nhwc, context)
        outputs[eps] = np.asarray(ours)
        expected = expected.sample.numpy().transpose(0, 2, 3, 1)
        np.testing.assert_allclose(outputs[eps], expected, atol=1e-5, rtol=0, err_msg=str(eps))
    first, second = outputs.values()
    assert np.abs(first - second).max() > 0.1
