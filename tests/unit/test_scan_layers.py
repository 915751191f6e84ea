"""Scanned transformer blocks, attention backends and remat policies inside the SD3 and FLUX
models: each changes how the same function is computed, never its numbers. Tiny random
models in float32; the reference is the model with its blocks unrolled, XLA attention and
no remat (which tests/parity checks against the PyTorch releases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from tree_grpo_jax import lora
from tree_grpo_jax.models.flux import transformer as flux
from tree_grpo_jax.models.sd3 import mmdit
from tree_grpo_jax.weights import stacking

# SD3.5-M's shape of runs: MMDiT-X blocks first, plain blocks, the context_pre_only last.
SD3_CONFIG = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=6,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=24,
    out_channels=4,
    pos_embed_max_size=8,
    dual_attention_layers=(0, 1),
    qk_norm="rms_norm",
)
FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
TOLERANCE = 1e-6  # relative to the largest magnitude of the compared values


def _sd3_inputs():
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    return (
        jax.random.normal(k[0], (2, 4, 8, 8)),
        jax.random.normal(k[1], (2, 3, 32)),
        jax.random.normal(k[2], (2, 24)),
        jnp.array([3.0, 700.0]),
    )


def _flux_inputs():
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    return (
        jax.random.normal(k[0], (2, 16, 64)),
        jax.random.normal(k[1], (2, 5, 32)),
        jax.random.normal(k[2], (2, 24)),
        jnp.array([0.1, 0.9]),
        jnp.asarray(flux.image_ids(8, 8)),
        jnp.asarray(flux.text_ids(5)),
        jnp.array([3.5, 3.5]),
    )


FAMILIES = {
    "sd3": (mmdit.transformer_module, SD3_CONFIG, _sd3_inputs),
    "flux": (flux.transformer_module, FLUX_CONFIG, _flux_inputs),
}


def _params(family):
    build, config, _ = FAMILIES[family]
    return build(config).init_weights(jax.random.PRNGKey(1))


def _output_and_grad(family, params, **options):
    """The model's output and the gradient of a weighted sum of it, in one program."""
    build, config, inputs = FAMILIES[family]
    module, args = build(config, **options), inputs()

    def loss(p):
        out = module.apply({"params": p}, *args)
        weights = jax.random.normal(jax.random.PRNGKey(9), out.shape)
        return jnp.sum(weights * out), out

    (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(out), grad


def _close(ours, reference, tolerance=TOLERANCE, floor=0.0):
    """Leaf by leaf, relative to the leaf's largest magnitude (at least `floor`)."""
    ours, reference = flatten_dict(ours), flatten_dict(reference)
    assert set(ours) == set(reference)
    for key in reference:
        scale = max(float(np.max(np.abs(reference[key]))), floor) or 1.0
        err = float(np.max(np.abs(np.asarray(ours[key]) - np.asarray(reference[key]))))
        assert err <= tolerance * scale, (key, err, scale)


# FLUX's cases in the slow tier: its scanned runs are the FLUX family's parity and training
# tests' in the fast one.
@pytest.fixture(scope="module", params=["sd3", pytest.param("flux", marks=pytest.mark.slow)])
def reference(request):
    family = request.param
    params = _params(family)
    return family, params, _output_and_grad(family, params)


def test_scanned_model_stacks_runs_of_identical_blocks():
    scanned = mmdit.transformer_module(SD3_CONFIG, scan_layers=True)
    names = sorted(
        k for k in jax.eval_shape(scanned.init_weights, jax.random.PRNGKey(0)) if "_" in k
    )
    # Blocks 0-1 are MMDiT-X, 2-4 plain, 5 context_pre_only: three runs, the last of one.
    assert [n for n in names if n.startswith("transformer_blocks")] == [
        "transformer_blocks_0_to_1",
        "transformer_blocks_2_to_4",
        "transformer_blocks_5",
    ]
    scanned = flux.transformer_module(FLUX_CONFIG, scan_layers=True)
    shapes = jax.eval_shape(scanned.init_weights, jax.random.PRNGKey(0))
    assert {"transformer_blocks_0_to_1", "single_transformer_blocks_0_to_2"} <= set(shapes)
    assert shapes["single_transformer_blocks_0_to_2"]["proj_mlp"]["kernel"].shape == (3, 32, 128)


@pytest.mark.parametrize(
    "remat", [False, pytest.param("block_save_attention", marks=pytest.mark.slow)]
)
def test_scanned_equals_unrolled_in_outputs_and_gradients(reference, remat):
    family, params, (out, grad) = reference
    build, config, _ = FAMILIES[family]
    shapes = jax.eval_shape(build(config, scan_layers=True).init_weights, jax.random.PRNGKey(0))
    stacked = stacking.stack(params, shapes)
    assert stacking.is_stacked(stacked)
    scan_out, scan_grad = _output_and_grad(family, stacked, scan_layers=True, remat=remat)
    np.testing.assert_allclose(scan_out, out, atol=TOLERANCE * np.abs(out).max(), rtol=0)
    _close(stacking.unstack(scan_grad), grad)


@pytest.mark.slow
def test_block_remat_changes_no_number(reference):
    # (the scanned test above runs the policy that keeps the attention)
    family, params, (out, grad) = reference
    remat_out, remat_grad = _output_and_grad(family, params, remat=True)
    np.testing.assert_array_equal(remat_out, out)
    _close(remat_grad, grad)


@pytest.mark.slow
def test_blockwise_attention_equals_xla_inside_the_models(reference):
    family, params, (out, grad) = reference
    block_out, block_grad = _output_and_grad(family, params, attention="blockwise")
    np.testing.assert_allclose(block_out, out, atol=1e-5 * np.abs(out).max(), rtol=0)
    _close(block_grad, grad, tolerance=1e-5)


def test_unknown_runtime_values_are_one_sentence():
    with pytest.raises(ValueError, match="attention backend 'flash' is unknown"):
        mmdit.transformer_module(SD3_CONFIG, attention="flash")
    with pytest.raises(ValueError, match="model.remat must be one of none, block"):
        flux.transformer_module(FLUX_CONFIG, remat="everything")


def test_stack_and_unstack_round_trip_and_refuse_a_missing_block():
    params = _params("flux")
    shapes = jax.eval_shape(
        flux.transformer_module(FLUX_CONFIG, scan_layers=True).init_weights, jax.random.PRNGKey(0)
    )
    stacked = stacking.stack(params, shapes)
    kernel = stacked["single_transformer_blocks_0_to_2"]["attn"]["to_q"]["kernel"]
    for i in range(3):
        np.testing.assert_array_equal(
            kernel[i], params[f"single_transformer_blocks_{i}"]["attn"]["to_q"]["kernel"]
        )
    _close(stacking.unstack(stacked), params, tolerance=0)
    del params["single_transformer_blocks_1"]
    with pytest.raises(ValueError, match="lack single_transformer_blocks_1, one of the blocks"):
        stacking.stack(params, shapes)


def test_lora_on_stacked_kernels_is_the_unscanned_lora_stacked():
    params = _params("sd3")
    scanned = mmdit.transformer_module(SD3_CONFIG, scan_layers=True)
    stacked = stacking.stack(params, jax.eval_shape(scanned.init_weights, jax.random.PRNGKey(0)))
    targets = ("attn/to_q", "attn/add_k_proj", "attn2/to_v")
    paths = lora.target_paths(params, targets)
    stacked_paths = lora.target_paths(stacked, targets)
    assert ("transformer_blocks_2_to_4", "attn", "to_q", "kernel") in stacked_paths
    assert len(stacked_paths) < len(paths)
    key = jax.random.PRNGKey(4)
    factors = lora.init_lora(key, params, paths, rank=2)
    stacked_factors = lora.init_lora(key, stacked, stacked_paths, rank=2)
    # The same draws, block by block (b is zero; give it values to test the merge).
    _close(stacking.unstack(stacked_factors), factors, tolerance=0)
    factors = jax.tree_util.tree_map(lambda x: x + 0.1, factors)
    stacked_factors = jax.tree_util.tree_map(lambda x: x + 0.1, stacked_factors)
    merged = lora.merge(params, factors, alpha=4.0, rank=2)
    _close(stacking.unstack(lora.merge(stacked, stacked_factors, 4.0, 2)), merged, 1e-7)
    # A scanned run's factors on the base read block by block (an export with --merge).
    _close(lora.merge(params, stacked_factors, 4.0, 2), merged, 1e-7)
    assert lora.lora_summary(stacked, stacked_paths, 2) == lora.lora_summary(params, paths, 2)
    # A resume compares base checksums before the state (whose layout names the flag).
    assert lora.weights_fingerprint(stacked) == lora.weights_fingerprint(params)
    assert lora.weights_fingerprint(merged) != lora.weights_fingerprint(params)
    # PEFT keys name the blocks one by one.
    assert lora.to_peft_state_dict(stacked_factors, 4.0, 2, "transformer").keys() == (
        lora.to_peft_state_dict(factors, 4.0, 2, "transformer").keys()
    )


def test_lora_targets_choosing_part_of_a_scanned_run_are_refused():
    scanned = mmdit.transformer_module(SD3_CONFIG, scan_layers=True)
    stacked = jax.eval_shape(scanned.init_weights, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="set --config.model.scan_layers=False"):
        lora.target_paths(stacked, ("transformer_blocks_3/attn/to_q",))
    # A target naming every block of the run (and the odd block out) is fine.
    assert lora.target_paths(stacked, ("transformer_blocks_*/attn/to_q",))


UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    attention_head_dim=2,
    cross_attention_dim=16,
)


@pytest.mark.slow
def test_unet_remat_per_block_changes_no_number():
    from tree_grpo_jax.models.sd15.unet import unet_module

    params = unet_module(UNET_CONFIG).init_weights(jax.random.PRNGKey(0))
    k = jax.random.split(jax.random.PRNGKey(5), 2)
    x, text = jax.random.normal(k[0], (2, 4, 8, 8)), jax.random.normal(k[1], (2, 3, 16))

    def output_and_grad(remat):
        module = unet_module(UNET_CONFIG, remat=remat)

        def loss(p):
            out = module.apply({"params": p}, x, jnp.array([10, 900]), text).sample
            return jnp.sum(jnp.sin(out)), out

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return np.asarray(out), grad

    out, grad = output_and_grad(False)
    # (the policy that keeps the attentions' outputs; "block" is the same remat keeping none)
    remat_out, remat_grad = output_and_grad("block_save_attention")
    # The UNet's fusions (group norms over a recomputed block) move the last bits: 1e-5.
    np.testing.assert_allclose(remat_out, out, atol=1e-5 * np.abs(out).max(), rtol=0)
    # Some leaves' gradients are small sums of terms as large as the largest gradient, whose
    # rounding (about 1e-7 of it on an AMD EPYC's kernels) is all they differ by: relative to
    # at least 1e-2 of the largest. A recomputation that went wrong differs by whole units.
    largest = max(float(np.max(np.abs(g))) for g in jax.tree_util.tree_leaves(grad))
    _close(remat_grad, grad, tolerance=1e-5, floor=1e-2 * largest)


def test_lora_train_step_gradients_merge_block_by_block_as_merged_up_front():
    """The train step differentiates through the factors attached to the stacked kernels
    (`lora.attach`, merged inside the scanned and recomputed blocks): the same output and
    factor gradients as through the whole merged weights (`lora.merge`)."""
    build, config, inputs = FAMILIES["flux"]
    module, args = build(config, scan_layers=True, remat=True), inputs()
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    base = stacking.stack(_params("flux"), shapes)
    paths = lora.target_paths(base, ("to_q", "to_k", "to_v", "to_out_0", "proj_out"))
    factors = lora.init_lora(jax.random.PRNGKey(5), base, paths, rank=4)
    factors = jax.tree_util.tree_map(  # b is zero at the start: give it values
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(6), x.shape), factors
    )
    weights = jax.random.normal(jax.random.PRNGKey(9), (2, 16, 64))

    def output_and_grad(merge):
        def loss(f):
            out = module.apply({"params": merge(base, f, 8.0, 4)}, *args)
            return jnp.sum(weights * out), out

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(factors)
        return np.asarray(out), grad

    out, grad = output_and_grad(lora.merge)
    attached_out, attached_grad = output_and_grad(lora.attach)
    assert float(np.abs(out - output_and_grad(lambda b, *_: b)[0]).max()) > 1e-3
    np.testing.assert_allclose(attached_out, out, rtol=0, atol=1e-6 * np.abs(out).max())
    _close(attached_grad, grad)


def test_lora_merged_block_by_block_samples_as_the_merged_weights():
    """The rollout and the evaluation sample with LoRA's factors attached to the stacked
    kernels and merged inside the scan (`lora.attach`), one block at a time: the same
    samples as with the whole merged weights (`lora.merge`), on a bfloat16 base."""
    from tree_grpo_jax.core import rollout
    from tree_grpo_jax.core import tree_spec as ts
    from tree_grpo_jax.core.sampling import make_flow_schedule
    from tree_grpo_jax.models.flux.load import make_denoise

    module = flux.transformer_module(FLUX_CONFIG, jnp.bfloat16, scan_layers=True)
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    base = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16), stacking.stack(_params("flux"), shapes)
    )
    # the family's targets and one kernel outside the scanned runs (merged up front)
    paths = lora.target_paths(base, ("to_q", "to_k", "to_v", "to_out_0", "proj_out"))
    assert ("proj_out", "kernel") in paths
    factors = lora.init_lora(jax.random.PRNGKey(5), base, paths, rank=4)
    factors = jax.tree_util.tree_map(  # b is zero at the start: give it values
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(6), x.shape), factors
    )
    merged = lora.merge(base, factors, 8.0, 4)
    attached = lora.attach(base, factors, 8.0, 4)
    # the scanned runs' kernels are the base's own arrays, not merged copies
    run = attached["single_transformer_blocks_0_to_2"]["attn"]["to_q"]
    assert run["kernel"] is base["single_transformer_blocks_0_to_2"]["attn"]["to_q"]["kernel"]
    assert isinstance(run[lora.ATTACHED], lora.Attached)
    np.testing.assert_array_equal(attached["proj_out"]["kernel"], merged["proj_out"]["kernel"])
    # what the sampling programs do not take (the memory plan's and the start's `held`): the
    # kernel merged up front and its two factors, nothing of the scanned runs
    kernels, pair = lora.Adapter(base, paths, 4, 8.0, "").merged_up_front(factors)
    assert len(kernels) == 1 and kernels[0] is base["proj_out"]["kernel"]
    assert [x.shape for x in pair] == [
        f.shape for f in (factors["proj_out"]["a"], factors["proj_out"]["b"])
    ]

    denoise = make_denoise(module, guidance=3.5)
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    cond = jax.random.normal(keys[0], (2, 6, 32 + 24))  # 5 text tokens and the pooled row
    schedule = make_flow_schedule(4)
    spec = ts.TreeSpec((ts.SDE, ts.BRANCH(2), ts.ODE, ts.BRANCH(2)))

    def samples(weights):
        tree = rollout.rollout(
            denoise, weights, cond, keys[1], schedule, spec=spec, sample_shape=(16, 8, 8)
        )
        noise = jax.random.normal(keys[2], (2, 16, 8, 8))
        final = rollout.sample_deterministic(denoise, weights, cond, noise, schedule)
        # every array of the tree (leaves, each segment's states and log-probs), the samples
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)] + [np.asarray(final)]

    reference = samples(merged)
    assert np.abs(reference[-1] - samples(base)[-1]).max() > 1e-3  # the adapter is no no-op
    for ours, theirs in zip(samples(attached), reference):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())
