"""LoRA on param trees: each family's default targets select exactly the attention
projections (SD3's as Flow-GRPO's PEFT config does), PEFT's initialisation, `merge` exact at
init and differentiated correctly, and the PEFT file diffusers' `load_lora_weights` reads
makes the PyTorch model compute what our model computes with the merged params."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from tree_grpo_jax import lora
from tree_grpo_jax.models.registry import family_of
from tree_grpo_jax.models.tiny import networks
from tree_grpo_jax.weights import stacking

RANK, ALPHA = 4, 8.0
SD_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out_0")
SD_ATTENTIONS = (
    "down_blocks_0/attentions_0",
    "mid_block/attentions_0",
    "up_blocks_1/attentions_0",
    "up_blocks_1/attentions_1",
)
SD3_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out_0", "add_q_proj", "add_k_proj", "add_v_proj")
# The PEFT targets of diffusers' SD LoRA scripts and of Flow-GRPO's SD3 training.
PEFT_SD_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
PEFT_SD3_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]


def _sd_expected():
    return {
        (*block.split("/"), "transformer_blocks_0", attn, proj, "kernel")
        for block in SD_ATTENTIONS
        for attn in ("attn1", "attn2")
        for proj in SD_PROJECTIONS
    }


def _sd3_expected(num_layers=3):
    paths = {
        (f"transformer_blocks_{i}", "attn", proj, "kernel")
        for i in range(num_layers)
        for proj in SD3_PROJECTIONS
    }
    # The last block only projects the context in: it has no `to_add_out`.
    paths |= {(f"transformer_blocks_{i}", "attn", "to_add_out", "kernel") for i in range(2)}
    return paths


def _random_factors(key, params, paths, scale=0.1):
    """Factors with random non-zero `a` (PEFT's init) and `b` (normal * scale)."""
    factors = lora.init_lora(key, params, paths, RANK)
    flat = flatten_dict(factors)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(flat))
    for k, path in zip(keys, sorted(flat)):
        if path[-1] == "b":
            flat[path] = scale * jax.random.normal(k, flat[path].shape)
    return unflatten_dict(flat)


def _lora_module_names(module) -> set[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name for name, m in module.named_modules() if isinstance(m, BaseTunerLayer)}


def _pt_names(paths) -> set[str]:
    """Our kernel paths in diffusers' PyTorch module spelling."""
    from tree_grpo_jax.weights import convert

    tree = unflatten_dict({p: np.zeros((1, 1), np.float32) for p in paths})
    return {k.removesuffix(".weight") for k in convert.flax_to_pytorch(tree)}


# ---------------------------------------------------------------------------------------------
# Fixtures: the tiny SD1.5 UNet and SD3.5 transformer, in Flax and (for the export) PyTorch.


@pytest.fixture(scope="module")
def sd_unet(sd_folder):
    from tree_grpo_jax.models.sd15.load import load_unet

    module, params, _ = load_unet(sd_folder / "unet", jnp.float32)
    return module, params


@pytest.fixture(scope="module")
def sd3_transformer(sd3_folder):
    from tree_grpo_jax.models.sd3.load import load_transformer

    module, params, _ = load_transformer(sd3_folder / "transformer", jnp.float32)
    return module, params


@pytest.fixture(scope="module")
def sd3_scanned(sd3_folder):
    """The same transformer with its blocks 0 and 1 (SD3.5's MMDiT-X) scanned, stacked."""
    from tree_grpo_jax.models.sd3.load import load_transformer

    module, params, _ = load_transformer(sd3_folder / "transformer", jnp.float32, scan_layers=True)
    assert "transformer_blocks_0_to_1" in params
    return module, params


# ---------------------------------------------------------------------------------------------
# Targets.


def test_default_targets_select_the_attention_projections(sd_unet, sd3_transformer):
    tiny = jax.eval_shape(networks.init_weights, jax.random.key(0))["unet"]
    assert set(lora.target_paths(tiny, family_of("tiny").lora_targets)) == _sd_expected()

    _, sd = sd_unet
    paths = lora.target_paths(sd, family_of("sd").lora_targets)
    assert paths == tuple(sorted(paths)) and set(paths) == _sd_expected()

    _, sd3 = sd3_transformer
    paths = lora.target_paths(sd3, family_of("sd3").lora_targets)
    assert set(paths) == _sd3_expected() and len(paths) == 23
    # SD3.5's dual-attention `attn2` layers exist but are not adapted (as in Flow-GRPO).
    assert ("transformer_blocks_0", "attn2", "to_q", "kernel") in flatten_dict(sd3)


def test_target_patterns(sd_unet, sd3_transformer):
    _, sd3 = sd3_transformer
    blocks = lora.target_paths(sd3, "transformer_blocks_*/attn/to_q")
    assert blocks == tuple((f"transformer_blocks_{i}", "attn", "to_q", "kernel") for i in range(3))
    second = lora.target_paths(sd3, ["attn2/to_*"])
    assert len(second) == 8 and all(p[1] == "attn2" for p in second)
    # A pattern matches the end of the path: `ff/net_2` is not `ff_context/net_2`.
    assert {p[:2] for p in lora.target_paths(sd3, ["ff/net_2"])} == {
        (f"transformer_blocks_{i}", "ff") for i in range(3)
    }
    _, sd = sd_unet
    assert len(lora.target_paths(sd, ["attn1/to_[qk]"])) == 8


@pytest.mark.parametrize(
    "targets, match",
    [
        (["to_qq", "attn3/to_q"], "to_qq, attn3/to_q"),
        (["conv_in"], "conv_in"),  # a 4-D conv kernel is not a Dense kernel
        (["to_out.0"], "has a '.'"),
        ([], "at least one"),
        (["attn//to_q"], "empty path segment"),
    ],
)
def test_empty_or_bad_selection_is_one_sentence(sd_unet, targets, match):
    _, params = sd_unet
    with pytest.raises(ValueError, match=match) as info:
        lora.target_paths(params, targets)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Initialisation and merge.


def test_init_is_peft_kaiming_uniform():
    torch = pytest.importorskip("torch")
    fan_in, rank = 48, 4096
    params = {"attn": {"to_q": {"kernel": jnp.zeros((fan_in, 8), jnp.bfloat16)}}}
    factors = lora.init_lora(jax.random.key(0), params, [("attn", "to_q", "kernel")], rank)
    a, b = (np.asarray(factors["attn"]["to_q"][k]) for k in ("a", "b"))
    assert a.shape == (fan_in, rank) and b.shape == (rank, 8)
    assert a.dtype == b.dtype == np.float32 and not b.any()
    # PEFT's lora_A [rank, in]: torch's kaiming_uniform_ with a = sqrt(5).
    theirs = torch.empty(rank, fan_in)
    torch.nn.init.kaiming_uniform_(theirs, a=math.sqrt(5))
    bound = 1 / math.sqrt(fan_in)
    assert np.abs(a).max() <= bound and theirs.abs().max().item() <= bound * (1 + 1e-6)
    assert np.abs(a).max() > 0.999 * bound
    np.testing.assert_allclose(a.std(), theirs.std().item(), rtol=0.02)
    np.testing.assert_allclose(a.std(), bound / math.sqrt(3), rtol=0.02)
    assert abs(a.mean()) < 0.01 * bound


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_merge_at_init_is_the_base_bit_for_bit(family, sd_unet, sd3_transformer):
    _, params = sd_unet if family == "sd" else sd3_transformer
    paths = lora.target_paths(params, family_of(family).lora_targets)
    factors = lora.init_lora(jax.random.key(1), params, paths, RANK)
    base = flatten_dict(params)
    for merged in (
        lora.merge(params, factors, ALPHA, RANK),
        jax.jit(lora.merge, static_argnums=(2, 3))(params, factors, ALPHA, RANK),
    ):
        merged = flatten_dict(merged)
        assert merged.keys() == base.keys()
        for path, leaf in base.items():
            assert merged[path].dtype == leaf.dtype
            assert np.asarray(merged[path]).tobytes() == np.asarray(leaf).tobytes(), path
    eager = flatten_dict(lora.merge(params, factors, ALPHA, RANK))
    untouched = [p for p in base if p not in paths]
    assert untouched and all(eager[p] is base[p] for p in untouched)


def test_merge_values_and_bfloat16_base():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    a = rng.standard_normal((6, 2)).astype(np.float32)
    b = rng.standard_normal((2, 5)).astype(np.float32)
    params = {"to_q": {"kernel": jnp.asarray(w, jnp.bfloat16), "bias": jnp.ones(5, jnp.bfloat16)}}
    merged = lora.merge(params, {"to_q": {"a": a, "b": b}}, alpha=3.0, rank=2)
    kernel = merged["to_q"]["kernel"]
    assert kernel.dtype == jnp.bfloat16 and merged["to_q"]["bias"] is params["to_q"]["bias"]
    expected = np.asarray(params["to_q"]["kernel"], np.float64) + 1.5 * (
        a.astype(np.float64) @ b.astype(np.float64)
    )
    np.testing.assert_allclose(np.asarray(kernel, np.float64), expected, rtol=2**-8, atol=1e-6)
    with pytest.raises(ValueError, match="no leaf to_k/kernel"):
        lora.merge(params, {"to_k": {"a": a, "b": b}}, 3.0, 2)
    with pytest.raises(ValueError, match="needs both"):
        lora.merge(params, {"to_q": {"a": a}}, 3.0, 2)
    with pytest.raises(AssertionError):  # chex: a factor of the wrong rank
        lora.merge(params, {"to_q": {"a": a, "b": b}}, 3.0, 3)


def _toy_params(dtype):
    rng = np.random.default_rng(1)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape) / math.sqrt(shape[0]), dtype)

    return {
        "block_0": {
            "attn": {
                "to_q": {"kernel": arr(6, 8), "bias": arr(8)},
                "to_out_0": {"kernel": arr(8, 6), "bias": arr(6)},
            },
            "conv": {"kernel": arr(3, 3, 6, 6)},
        }
    }


def _toy_loss(params, x):
    attn = params["block_0"]["attn"]
    h = jnp.tanh(x @ attn["to_q"]["kernel"] + attn["to_q"]["bias"])
    y = h @ attn["to_out_0"]["kernel"] + attn["to_out_0"]["bias"]
    return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[-1]))


def test_gradients_are_the_chain_rule_and_finite_differences():
    scale = ALPHA / RANK
    params = _toy_params(jnp.float32)
    paths = lora.target_paths(params, SD_PROJECTIONS)
    assert paths == (
        ("block_0", "attn", "to_out_0", "kernel"),
        ("block_0", "attn", "to_q", "kernel"),
    )
    factors = _random_factors(jax.random.key(2), params, paths, scale=0.5)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 6)), jnp.float32)

    def loss_of_factors(f, p):
        return _toy_loss(lora.merge(p, f, ALPHA, RANK), x)

    grads = jax.jit(jax.grad(loss_of_factors))(factors, params)
    merged = lora.merge(params, factors, ALPHA, RANK)
    grad_w = jax.grad(_toy_loss)(merged, x)
    for path in paths:
        module = path[:-1]
        g = np.asarray(flatten_dict(grad_w)[path], np.float64)
        a = np.asarray(flatten_dict(factors)[module + ("a",)], np.float64)
        b = np.asarray(flatten_dict(factors)[module + ("b",)], np.float64)
        got = flatten_dict(grads)
        np.testing.assert_allclose(got[module + ("a",)], scale * g @ b.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[module + ("b",)], scale * a.T @ g, rtol=1e-5, atol=1e-6)

    # Central differences in float64 on a few entries of every factor.
    with jax.enable_x64(True):
        params64 = jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float64), params)
        f64 = jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float64), factors)
        x64 = jnp.asarray(x, jnp.float64)

        @jax.jit
        def loss64(f):
            return _toy_loss(lora.merge(params64, f, ALPHA, RANK), x64)

        grads64 = flatten_dict(jax.grad(loss64)(f64))
        np.testing.assert_allclose(
            np.asarray(grads64[paths[1][:-1] + ("a",)]),
            np.asarray(flatten_dict(grads)[paths[1][:-1] + ("a",)]),
            rtol=1e-4,
            atol=1e-5,
        )
        flat = {k: np.asarray(v) for k, v in flatten_dict(f64).items()}
        eps = 1e-6
        for leaf in sorted(flat):
            for index in [(0, 0), (1, 2), (-1, -1)]:
                up, down = dict(flat), dict(flat)
                up[leaf], down[leaf] = flat[leaf].copy(), flat[leaf].copy()
                up[leaf][index] += eps
                down[leaf][index] -= eps
                numeric = (loss64(unflatten_dict(up)) - loss64(unflatten_dict(down))) / (2 * eps)
                np.testing.assert_allclose(grads64[leaf][index], numeric, rtol=1e-7, atol=1e-9)


def test_counts():
    params = _toy_params(jnp.float32)
    paths = lora.target_paths(params, ["to_q", "to_out_0"])
    trainable, base = lora.lora_summary(params, paths, RANK)
    assert base == 6 * 8 + 8 + 8 * 6 + 6 + 3 * 3 * 6 * 6
    assert trainable == RANK * (6 + 8) * 2
    assert lora.count_params(lora.init_lora(jax.random.key(0), params, paths, RANK)) == trainable
    assert lora.count_params(jax.eval_shape(lambda: params)) == base


# ---------------------------------------------------------------------------------------------
# The PEFT file, loaded by diffusers.


def _peft_roundtrip(tmp_path, factors, prefix):
    state = lora.to_peft_state_dict(factors, ALPHA, RANK, prefix)
    file = lora.save_peft(tmp_path / "adapter", state, ALPHA, RANK)
    assert file == tmp_path / "adapter" / "pytorch_lora_weights.safetensors"
    back, alpha, rank = lora.read_peft(file, prefix)
    assert (alpha, rank) == (ALPHA, RANK)
    # The file names blocks one by one: a scanned model's stacked factors come back unstacked.
    expected = stacking.unstack(jax.device_get(factors))
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, expected)
    return state, file.parent


def test_sd15_peft_file_loads_into_diffusers(sd_folder, sd_unet, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig

    module, params = sd_unet
    paths = lora.target_paths(params, family_of("sd").lora_targets)
    factors = _random_factors(jax.random.key(4), params, paths)
    state, folder = _peft_roundtrip(tmp_path, factors, "unet")
    key = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_A.weight"
    assert state[key].shape == (RANK, 32) and len(state) == 2 * len(paths)

    pipe = StableDiffusionPipeline.from_pretrained(str(sd_folder), safety_checker=None)
    pipe.load_lora_weights(str(folder))
    adapted = _lora_module_names(pipe.unet)
    assert adapted == _pt_names(paths)
    reference = pipe.unet.__class__.from_pretrained(str(sd_folder / "unet"))
    reference.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_SD_TARGETS))
    assert _lora_module_names(reference) == adapted

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    t = np.array([981, 21], np.int32)
    cond = rng.standard_normal((2, 16, 32)).astype(np.float32)
    with torch.no_grad():
        args = (torch.from_numpy(x), torch.from_numpy(t).long(), torch.from_numpy(cond))
        theirs = pipe.unet(*args).sample.numpy()
    apply = jax.jit(lambda p: module.apply({"params": p}, x, t, cond).sample)
    ours = np.asarray(apply(lora.merge(params, factors, ALPHA, RANK)))
    diff = np.abs(ours - theirs).max()
    print(f"SD1.5 LoRA: max |flax - diffusers+peft| = {diff:.2e}")
    assert diff <= 1e-4
    # The file's alpha is read: scale 1 (alpha = rank) would be far off.
    assert np.abs(np.asarray(apply(lora.merge(params, factors, RANK, RANK))) - theirs).max() > 1e-2


@pytest.mark.parametrize("scanned", [False, True], ids=["blocks", "scanned"])
def test_sd3_peft_file_loads_into_diffusers(
    sd3_folder, sd3_transformer, sd3_scanned, tmp_path, scanned
):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import LoraConfig

    targets = family_of("sd3").lora_targets
    block_paths = lora.target_paths(sd3_transformer[1], targets)
    module, params = sd3_scanned if scanned else sd3_transformer
    paths = lora.target_paths(params, targets)
    factors = _random_factors(jax.random.key(6), params, paths)
    state, folder = _peft_roundtrip(tmp_path, factors, "transformer")
    assert "transformer.transformer_blocks.1.attn.to_add_out.lora_B.weight" in state

    pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_folder))
    pipe.load_lora_weights(str(folder))
    adapted = _lora_module_names(pipe.transformer)
    assert adapted == _pt_names(block_paths)
    reference = SD3Transformer2DModel.from_pretrained(str(sd3_folder / "transformer"))
    reference.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_SD3_TARGETS))
    assert _lora_module_names(reference) == adapted  # Flow-GRPO's selection

    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, 5, 128)).astype(np.float32)
    pooled = rng.standard_normal((2, 40)).astype(np.float32)
    t = np.array([999.0, 250.0], np.float32)
    with torch.no_grad():
        theirs = pipe.transformer(
            hidden_states=torch.from_numpy(x),
            encoder_hidden_states=torch.from_numpy(context),
            pooled_projections=torch.from_numpy(pooled),
            timestep=torch.from_numpy(t),
        ).sample.numpy()
    apply = jax.jit(lambda p: module.apply({"params": p}, x, context, pooled, t))
    ours = np.asarray(apply(lora.merge(params, factors, ALPHA, RANK)))
    diff = np.abs(ours - theirs).max()
    print(f"SD3 LoRA: max |flax - diffusers+peft| = {diff:.2e}")
    assert diff <= 1e-4 * max(1.0, np.abs(theirs).max())
    assert np.abs(np.asarray(apply(lora.merge(params, factors, RANK, RANK))) - theirs).max() > 1e-2


def test_peft_state_dict_refusals(tmp_path):
    factors = {"to_q": {"a": np.ones((6, 2), np.float32), "b": np.ones((2, 5), np.float32)}}
    with pytest.raises(ValueError, match="one name like 'unet'"):
        lora.to_peft_state_dict(factors, ALPHA, 2, "unet.")
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        lora.to_peft_state_dict(factors, 0.0, 2, "unet")
    state = lora.to_peft_state_dict(factors, ALPHA, 2, "unet")
    assert set(state) == {"unet.to_q.lora_A.weight", "unet.to_q.lora_B.weight"}
    with pytest.raises(ValueError, match=r"not \[3, in\]"):
        lora.save_peft(tmp_path, state, ALPHA, 3)
    with pytest.raises(ValueError, match="not a PEFT LoRA key"):
        lora.save_peft(tmp_path, {"unet.to_q.weight": np.ones((2, 2))}, ALPHA, 2)
    with pytest.raises(ValueError, match="no text_encoder"):
        lora.from_peft_state_dict(state, "text_encoder")
    assert not list(tmp_path.iterdir())  # nothing half-written
