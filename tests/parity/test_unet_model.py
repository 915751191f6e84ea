"""The package's UNet (`models.unet`, `models.unet_layers`) against two independent references.

- diffusers' Flax UNet classes (while the installed diffusers has them: 0.40 removed them):
  each of our layers holds the same parameter tree, draws the same initial values from the
  same key and gives the same bits in float32 and bfloat16 as the Flax class it stands for;
  so does the whole UNet with `FLAX_NUMERICS`, the tiny model's.
- diffusers' PyTorch `UNet2DConditionModel` built tiny and random, its weights converted by
  `weights.convert`: with its default numerics our UNet computes what it computes; with
  `FLAX_NUMERICS` it computes what it computes once its GEGLU takes the tanh GELU and its
  transformers' GroupNorm eps 1e-5, and nothing else differs.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from tree_grpo_jax.models import unet, unet_layers
from tree_grpo_jax.models.dit_layers import TimestepEmbedding
from tree_grpo_jax.models.tiny.networks import UNET_CONFIG
from tree_grpo_jax.weights import convert

DTYPES = (jnp.float32, jnp.bfloat16)
ATOL = 1e-4  # against PyTorch in float32, as tests/parity/test_sd_loading.py
# Against torch changed as an option says: the default numerics come within 3e-6 of plain
# torch (float32 noise); the tanh GELU alone moves the output by 1.4e-4.
CHANGED_ATOL = 2e-5


@pytest.fixture(scope="module")
def flax_classes():
    """diffusers' Flax UNet classes; a plain skip (not a missing package) once diffusers
    no longer has them."""
    try:
        from diffusers.models import attention_flax, embeddings_flax, resnet_flax
        from diffusers.models.unets import unet_2d_blocks_flax, unet_2d_condition_flax
    except ImportError:
        pytest.skip("the installed diffusers has no Flax UNet classes (removed in 0.40)")
    return types.SimpleNamespace(
        attention=attention_flax,
        embeddings=embeddings_flax,
        resnet=resnet_flax,
        blocks=unet_2d_blocks_flax,
        unet=unet_2d_condition_flax.FlaxUNet2DConditionModel,
    )


def _randn(seed: int, *shapes):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


def _perturbed(params, seed: int = 1):
    """Init params plus noise, so that zero biases and unit scales are not special."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: np.asarray(a) + 0.1 * rng.standard_normal(a.shape).astype(np.float32), params
    )


def _flat(tree) -> dict:
    return {k: np.asarray(v, np.float32) for k, v in flatten_dict(dict(tree)).items()}


def _assert_same_init(ours, theirs, inputs, seed: int = 7):
    """The same parameter tree (names and shapes) and the same initial values from one key."""
    key = jax.random.key(seed)
    ours_params = _flat(jax.jit(ours.init)(key, *inputs)["params"])
    theirs_params = _flat(jax.jit(theirs.init)(key, *inputs)["params"])
    assert set(ours_params) == set(theirs_params)
    for name, value in theirs_params.items():
        np.testing.assert_array_equal(ours_params[name], value, err_msg=str(name))
    return theirs_params


def _assert_same_bits(make_ours, make_theirs, inputs, uncast=()):
    """Same init, then, for perturbed params, bit-identical outputs in float32 and bfloat16
    (jitted, as the runs call them). `make_*(dtype)` builds a module; params and inputs are
    cast to the dtype, but for the inputs at the positions `uncast` (timesteps)."""
    initial = _assert_same_init(make_ours(jnp.float32), make_theirs(jnp.float32), inputs)
    params = unflatten_dict(_perturbed(initial))
    for dtype in DTYPES:
        cast = lambda tree, dtype=dtype: jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)
        args = tuple(x if i in uncast else cast(x) for i, x in enumerate(inputs))
        outputs = []
        for module in (make_ours(dtype), make_theirs(dtype)):
            apply = jax.jit(lambda p, a, m=module: m.apply({"params": p}, *a))
            outputs.append(jax.tree.leaves(apply(cast(params), args)))
        for ours, theirs in zip(*outputs, strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            np.testing.assert_array_equal(
                np.asarray(ours, np.float32), np.asarray(theirs, np.float32), err_msg=str(dtype)
            )


# ---------------------------------------------------------------------------------------------
# Against diffusers' Flax classes.


def test_timestep_sinusoid_is_the_flax_one(flax_classes):
    t = jnp.asarray([0.0, 1.0, 17.5, 421.0, 999.0])
    for flip, shift in ((True, 0), (False, 1)):
        ours = unet_layers.timestep_sinusoid(t, 32, flip_sin_to_cos=flip, freq_shift=shift)
        theirs = flax_classes.embeddings.get_sinusoidal_embeddings(
            t, 32, flip_sin_to_cos=flip, freq_shift=shift
        )
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    ints = jnp.asarray([3, 500], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(unet_layers.timestep_sinusoid(ints, 8)),
        np.asarray(
            flax_classes.embeddings.get_sinusoidal_embeddings(
                ints, 8, flip_sin_to_cos=True, freq_shift=0
            )
        ),
    )


def test_timestep_embedding_is_the_flax_one(flax_classes):
    _assert_same_bits(
        lambda dtype: TimestepEmbedding(dim=64, dtype=dtype),
        lambda dtype: flax_classes.embeddings.FlaxTimestepEmbedding(64, dtype=dtype),
        _randn(0, (3, 32)),
    )


@pytest.mark.parametrize("widths", [(32, 64), (64, 64)], ids=["shortcut", "same_width"])
def test_resnet_block_is_the_flax_one(flax_classes, widths):
    x, temb = _randn(0, (2, 4, 4, widths[0]), (2, 128))
    _assert_same_bits(
        lambda dtype: unet_layers.ResnetBlock2D(*widths, dtype=dtype),
        lambda dtype: flax_classes.resnet.FlaxResnetBlock2D(*widths, dtype=dtype),
        (x, temb),
    )


def test_resnet_dropout_draws_the_flax_mask(flax_classes):
    """In training the dropout layer's name decides its random stream: the same mask."""
    x, temb = _randn(0, (2, 4, 4, 32), (2, 128))
    ours = unet_layers.ResnetBlock2D(32, 32, dropout_prob=0.5)
    theirs = flax_classes.resnet.FlaxResnetBlock2D(32, 32, dropout_prob=0.5)
    params = theirs.init(jax.random.key(0), x, temb)
    rngs = {"dropout": jax.random.key(3)}
    outputs = [m.apply(params, x, temb, False, rngs=rngs) for m in (ours, theirs)]
    np.testing.assert_array_equal(*map(np.asarray, outputs))
    deterministic = ours.apply(params, x, temb)
    assert not np.allclose(np.asarray(outputs[0]), np.asarray(deterministic))


@pytest.mark.parametrize("kind", ["Downsample2D", "Upsample2D"])
def test_resampling_is_the_flax_one(flax_classes, kind):
    (x,) = _randn(0, (2, 4, 4, 32))
    _assert_same_bits(
        lambda dtype: getattr(unet_layers, kind)(64, dtype=dtype),
        lambda dtype: getattr(flax_classes.resnet, f"Flax{kind}")(64, dtype=dtype),
        (x,),
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"split_head_dim": True}, {"use_memory_efficient_attention": True}],
    ids=["heads_in_batch", "split_head_dim", "memory_efficient"],
)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_attention_is_the_flax_one(flax_classes, options, cross):
    x, context = _randn(0, (2, 32, 32), (2, 6, 24))
    inputs = (x, context) if cross else (x,)
    _assert_same_bits(
        lambda dtype: unet_layers.Attention(32, heads=4, dim_head=8, dtype=dtype, **options),
        lambda dtype: flax_classes.attention.FlaxAttention(
            32, heads=4, dim_head=8, dtype=dtype, **options
        ),
        inputs,
    )


def test_memory_efficient_attention_over_several_key_chunks():
    """More keys than one chunk: the chunks' partial softmaxes combine to the whole one."""
    q, k, v = _randn(0, (12, 3, 8), (40, 3, 8), (40, 3, 8))
    chunked = unet_layers.memory_efficient_attention(q, k, v, query_chunk=4, key_chunk=8)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(8)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(chunked), np.einsum("hqk,khd->qhd", probs, v), atol=1e-5)


@pytest.mark.parametrize("variant", [False, True], ids=["conv_in_out", "linear_cross_only"])
def test_spatial_transformer_with_flax_numerics_is_the_flax_one(flax_classes, variant):
    x, context = _randn(0, (2, 4, 4, 32), (2, 6, 24))
    fields = dict(
        in_channels=32,
        n_heads=4,
        d_head=8,
        depth=2,
        use_linear_projection=variant,
        only_cross_attention=variant,
    )
    _assert_same_bits(
        lambda dtype: unet_layers.Transformer2D(
            **fields, dtype=dtype, gelu_approximate=True, norm_eps=1e-5
        ),
        lambda dtype: flax_classes.attention.FlaxTransformer2DModel(**fields, dtype=dtype),
        (x, context),
    )


def test_down_block_is_the_flax_one(flax_classes):
    x, temb = _randn(0, (2, 8, 8, 32), (2, 128))
    fields = dict(in_channels=32, out_channels=64, num_layers=2)
    _assert_same_bits(
        lambda dtype: unet_layers.DownBlock2D(**fields, dtype=dtype),
        lambda dtype: flax_classes.blocks.FlaxDownBlock2D(**fields, dtype=dtype),
        (x, temb),
    )


def test_up_block_is_the_flax_one(flax_classes):
    x, skip_in, skip_out, temb = _randn(0, (2, 4, 4, 64), (2, 4, 4, 32), (2, 4, 4, 64), (2, 128))
    fields = dict(in_channels=32, out_channels=64, prev_output_channel=64, num_layers=2)
    _assert_same_bits(
        lambda dtype: unet_layers.UpBlock2D(**fields, dtype=dtype),
        lambda dtype: flax_classes.blocks.FlaxUpBlock2D(**fields, dtype=dtype),
        (x, (skip_in, skip_out), temb),
    )


def test_tiny_unet_is_the_flax_unet(flax_classes):
    """The tiny model's UNet (`FLAX_NUMERICS`) and `FlaxUNet2DConditionModel(**UNET_CONFIG)`:
    one tree, one init, the same bits."""
    x, cond = _randn(0, (3, 1, 8, 8), (3, 16, 32))
    t = np.asarray([1.0, 421.0, 981.0], np.float32)
    _assert_same_bits(
        lambda dtype: unet.unet_module(UNET_CONFIG, dtype, **unet.FLAX_NUMERICS),
        lambda dtype: flax_classes.unet(**UNET_CONFIG, dtype=dtype),
        (x, t, cond),
        uncast=(1,),
    )


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
