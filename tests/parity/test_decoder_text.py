"""The decoder text encoder (models/decoder_text.py) against transformers' PyTorch models
built tiny and random: Qwen2, Qwen2.5-VL (the whole vision-language model, whose state dict
holds the text model under another prefix beside a vision tower and an LM head), Qwen3
(head_dim apart from hidden / heads) and Mistral (a sliding window shorter than the input).
Every hidden state matches in float32, at a full row, a right-padded row and a left-padded
row (whose padded queries see no key; no caller keeps them), unscanned, and scanned with
recomputed blocks and the blockwise attention backend.

No Qwen tokenizer is stored offline: the prompt tests build a byte-level `Qwen2Tokenizer`
(one token a byte, the chat markers as special tokens, a chat template written here in the
shape of Qwen3's) and run the pipelines' own `QwenImagePipeline._get_qwen_prompt_embeds`
and `ZImagePipeline._encode_prompt` on it and the tiny PyTorch models, so the template, the
padding, the hidden state taken and the tokens kept are checked, with a tokenizer whose
template token counts are not the real one's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models import decoder_text
from tree_grpo_jax.weights.convert import ParamTreeMismatch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from sd_fixtures import perturb  # noqa: E402
from zimage_fixtures import byte_tokenizer  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 260  # room for the prompt tests' 256 byte tokens, <|endoftext|> and the chat markers
LENGTH = 9
SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PROMPTS = ["a red cat", "two dogs on a beach at sunset, film grain"]


def _qwen2():
    config = transformers.Qwen2Config(
        **SHARED, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
    )
    return transformers.Qwen2Model(config)


def _qwen2_5_vl():
    text = dict(
        SHARED,
        rope_parameters={"rope_type": "default", "rope_theta": 700.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
        window_size=4,
        fullatt_block_indexes=[0],
    )
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _qwen3():
    config = transformers.Qwen3Config(
        **SHARED, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 300.0}
    )
    return transformers.Qwen3Model(config)


def _mistral():
    config = transformers.MistralConfig(
        **SHARED, sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 900.0}
    )
    return transformers.MistralModel(config)


BUILDERS = {"qwen2": _qwen2, "qwen2_5_vl": _qwen2_5_vl, "qwen3": _qwen3, "mistral": _mistral}


@functools.cache
def reference(family: str):
    """The family's tiny PyTorch model (float32, eval), its weights perturbed so that norm
    scales and biases are not ones and zeros."""
    torch.manual_seed(0)
    model = BUILDERS[family]()
    perturb(model, torch.Generator().manual_seed(1))
    return model.eval()


def _inputs():
    """ids [3, LENGTH] and mask: a full row, a right-padded row, a left-padded row."""
    ids = np.random.default_rng(0).integers(0, VOCAB, (3, LENGTH))
    mask = np.ones((3, LENGTH), np.int64)
    mask[1, -3:] = 0
    mask[2, :2] = 0
    return ids, mask


def _torch_states(model, ids, mask) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            output_hidden_states=True,
        )
    return [h.numpy() for h in out.hidden_states]


def _state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


@functools.cache
def _flax(family: str, **options):
    """(module, params, jitted run(params, ids, mask, layer)) of the family's model."""
    model = reference(family)
    module = decoder_text.DecoderTextModel(
        decoder_text.config_from_transformers(model.config), **options
    )
    params = decoder_text.params_from_state_dict(_state_dict(model), module)

    @functools.partial(jax.jit, static_argnames="layer")
    def run(params, ids, mask, layer=None):
        return module.apply({"params": params}, ids, mask, layer=layer)

    return module, params, run


def _assert_states_match(ours, theirs, mask):
    """Every state at every position but the left-padded row's padding."""
    assert len(ours) == len(theirs)
    keep = ~((mask == 0) & (np.cumsum(mask, axis=1) == 0))  # padding before the first token
    for ours_i, theirs_i in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(ours_i)[keep], theirs_i[keep], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_hidden_states_match_transformers(family):
    ids, mask = _inputs()
    theirs = _torch_states(reference(family), ids, mask)
    _, params, run = _flax(family)
    ours = run(params, jnp.asarray(ids), jnp.asarray(mask))
    _assert_states_match(ours, theirs, mask)
    assert all(np.isfinite(state).all() for state in ours)  # padding that attends nothing too
    # The rows' states differ, and the left-padded row's tokens would differ unmasked.
    assert not np.allclose(theirs[-1][0], theirs[-1][1], atol=1e-2)
    unmasked = _torch_states(reference(family), ids, np.ones_like(mask))
    assert not np.allclose(unmasked[-1][2, 2:], theirs[-1][2, 2:], atol=1e-3)


def test_the_families_differ_where_their_configs_do():
    """Qwen3's per-head norms and Mistral's window change the reference: they are exercised."""
    ids, mask = _inputs()
    model = reference("mistral")
    windowed = _torch_states(model, ids, mask)[-1]
    model.config.sliding_window = None
    try:
        full = _torch_states(model, ids, mask)[-1]
    finally:
        model.config.sliding_window = 4
    assert np.allclose(windowed[0, :4], full[0, :4], atol=1e-6)  # within the window: alike
    assert not np.allclose(windowed[0, 4:], full[0, 4:], atol=1e-3)
    config = decoder_text.config_from_transformers(reference("qwen3").config)
    assert (config.qk_norm, config.qkv_bias, config.head_dim) == (True, False, 16)
    assert decoder_text.config_from_transformers(reference("qwen2").config).qkv_bias


def test_scanned_rematerialised_blockwise_layers_match():
    ids, mask = _inputs()
    theirs = _torch_states(reference("qwen3"), ids, mask)
    _, params, run = _flax("qwen3", scan_layers=True, remat="block", attention="blockwise")
    assert "layers_0_to_2" in params and "layers_0" not in params
    ours = run(params, jnp.asarray(ids), jnp.asarray(mask))
    _assert_states_match(ours, theirs, mask)


def test_a_picked_layer_is_that_hidden_state():
    ids, mask = _inputs()
    theirs = _torch_states(reference("qwen2"), ids, mask)
    _, params, run = _flax("qwen2")
    for layer in (-1, -2, 1, 0):
        ours = run(params, jnp.asarray(ids), jnp.asarray(mask), layer=layer)
        _assert_states_match([ours], [theirs[layer]], mask)
    # several at once, in the order asked for (FLUX.2 concatenates three)
    picked = (2, 0, -1)
    ours = run(params, jnp.asarray(ids), jnp.asarray(mask), layer=picked)
    _assert_states_match(ours, [theirs[i] for i in picked], mask)
    _, scanned_params, scanned = _flax("qwen2", scan_layers=True)
    ours = scanned(scanned_params, jnp.asarray(ids), jnp.asarray(mask), layer=picked)
    _assert_states_match(ours, [theirs[i] for i in picked], mask)
    with pytest.raises(ValueError, match="not one of the 4 hidden states"):
        run(params, jnp.asarray(ids), jnp.asarray(mask), layer=4)
    with pytest.raises(ValueError, match="layer -5 is not one of the 4 hidden states"):
        run(params, jnp.asarray(ids), jnp.asarray(mask), layer=(1, -5))


def test_bfloat16_stays_near_float32():
    ids, mask = _inputs()
    theirs = _torch_states(reference("qwen2"), ids, mask)
    _, params, run = _flax("qwen2", dtype=jnp.bfloat16)
    ours = run(params, jnp.asarray(ids), jnp.asarray(mask), layer=-1)
    assert ours.dtype == jnp.bfloat16
    keep = mask.astype(bool)
    np.testing.assert_allclose(np.float32(ours)[keep], theirs[-1][keep], rtol=0.05, atol=0.05)


# Measured on these inputs, at each block's state (kept positions): ours in bfloat16 vs
# transformers in bfloat16 is 0.67x-1.64x transformers' own bfloat16 error against its
# float32 in the largest difference (1.64x: one bfloat16 step where theirs is 0.6 of one),
# 0.88x-1.10x in the RMS one. Rotary angles rounded to bfloat16 break both bounds; a
# bfloat16 norm or softmax does not show at this size (hidden 32, 9 tokens).
BF16_MAX_RATIO, BF16_RMS_RATIO = 2.0, 1.5


def _bfloat16_pair(family: str):
    """The family's PyTorch model in bfloat16 (a copy) and our bfloat16 module's params from
    its bfloat16 weights, so that both start from the same rounded numbers."""
    import copy

    model = copy.deepcopy(reference(family)).to(torch.bfloat16)
    module = decoder_text.DecoderTextModel(
        decoder_text.config_from_transformers(model.config), dtype=jnp.bfloat16
    )
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return model, module, decoder_text.params_from_state_dict(state, module)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_bfloat16_matches_transformers_bfloat16(family):
    """Ours and transformers' both in bfloat16: each hidden state within a small multiple of
    transformers' own bfloat16 rounding error (against its float32 model), in the largest
    difference and in the RMS one."""
    ids, mask = _inputs()
    model, module, params = _bfloat16_pair(family)
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            output_hidden_states=True,
        )
    theirs = [h.float().numpy() for h in out.hidden_states]
    float32 = _torch_states(reference(family), ids, mask)
    run = jax.jit(lambda p, i, m: module.apply({"params": p}, i, m))
    ours = run(params, jnp.asarray(ids), jnp.asarray(mask))
    assert all(state.dtype == jnp.bfloat16 for state in ours)
    keep = ~((mask == 0) & (np.cumsum(mask, axis=1) == 0))
    # the embeddings are the same bfloat16 numbers
    np.testing.assert_array_equal(np.float32(ours[0])[keep], theirs[0][keep])
    for i in range(1, len(theirs)):
        ours_error = np.abs(np.float32(ours[i])[keep] - theirs[i][keep])
        their_error = np.abs(theirs[i][keep] - float32[i][keep])
        assert their_error.max() > 0  # transformers did round to bfloat16
        assert ours_error.max() <= BF16_MAX_RATIO * their_error.max(), (i, ours_error.max())
        rms = [np.sqrt(np.mean(np.square(e))) for e in (ours_error, their_error)]
        assert rms[0] <= BF16_RMS_RATIO * rms[1], (i, rms)
    # the rows' states differ by far more than the tolerance
    assert np.abs(theirs[-1][0] - theirs[-1][1]).max() > 10 * BF16_MAX_RATIO * their_error.max()


def test_the_converter_reads_the_text_model_and_names_what_does_not_fit():
    state = _state_dict(reference("qwen2_5_vl"))
    assert any(k.startswith("model.visual.") for k in state) and "lm_head.weight" in state
    module, params, _ = _flax("qwen2_5_vl")
    # the older files' layout (`model.layers.*`, `visual.*`) gives the same params
    older = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in state.items()
    }
    again = decoder_text.params_from_state_dict(older, module)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
    state.pop("model.language_model.layers.1.self_attn.k_proj.bias")
    state["model.language_model.layers.1.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ParamTreeMismatch, match="missing.*k_proj/bias.*unexpected.*extra"):
        decoder_text.params_from_state_dict(state, module)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_configs_read_from_config_json(family):
    config = reference(family).config
    from_dict = decoder_text.config_from_transformers(config.to_dict())
    assert from_dict == decoder_text.config_from_transformers(config)


def test_unsupported_configs_are_one_sentence():
    with pytest.raises(ValueError, match="model_type 'llama'"):
        decoder_text.config_from_transformers({"model_type": "llama"})
    sliding = dict(SHARED, model_type="qwen2", use_sliding_window=True, sliding_window=4)
    sliding["max_window_layers"] = 1
    with pytest.raises(ValueError, match="sliding-window layers"):
        decoder_text.config_from_transformers(sliding)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        decoder_text.config_from_transformers(
            dict(
                SHARED,
                model_type="qwen3",
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
            )
        )


# ---------------------------------------------------------------------------------------------
# The pipelines' prompts.


@functools.cache
def tokenizer(padding_side: str = "right"):
    tok = byte_tokenizer(padding_side)
    assert len(tok) == 259 <= VOCAB
    return tok


def _pipeline(pipeline_class, text_encoder, tok):
    pipe = pipeline_class(None, None, None, None, None)
    pipe.text_encoder, pipe.tokenizer = text_encoder, tok
    return pipe


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_qwen_image_prompt_embeds_match_the_pipeline(padding_side):
    from diffusers import QwenImagePipeline

    tok = tokenizer(padding_side)
    pipe = _pipeline(QwenImagePipeline, reference("qwen2_5_vl"), tok)
    assert pipe.prompt_template_encode == decoder_text.QWEN_IMAGE_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == decoder_text.QWEN_IMAGE_DROP
    assert pipe.tokenizer_max_length == decoder_text.QWEN_IMAGE_MAX_LENGTH
    with torch.no_grad():
        theirs, their_mask = pipe._get_qwen_prompt_embeds(PROMPTS, device="cpu")
    ids, mask = decoder_text.qwen_image_prompt_inputs(tok, PROMPTS)
    _, params, run = _flax("qwen2_5_vl")
    hidden = run(params, ids, mask, layer=decoder_text.QWEN_IMAGE_LAYER)
    ours, our_mask = decoder_text.qwen_image_prompt_embeds(hidden, mask)
    np.testing.assert_array_equal(our_mask, their_mask.numpy())
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=RTOL, atol=ATOL)
    assert np.abs(ours[0] - ours[1]).max() > 1e-2 and not their_mask.numpy().all()


def test_z_image_prompt_embeds_match_the_pipeline():
    from diffusers import ZImagePipeline

    tok = tokenizer()
    pipe = _pipeline(ZImagePipeline, reference("qwen3"), tok)
    prompts = [*PROMPTS, "a prompt longer than the forty tokens the test keeps, cut short"]
    with torch.no_grad():
        theirs = pipe._encode_prompt(list(prompts), device="cpu", max_sequence_length=40)
    ids, mask = decoder_text.z_image_prompt_inputs(tok, prompts, max_length=40)
    assert ids.shape == (3, 40) and mask[2].all()
    _, params, run = _flax("qwen3")
    hidden = run(params, ids, mask, layer=decoder_text.Z_IMAGE_LAYER)
    ours = decoder_text.z_image_prompt_embeds(hidden, mask)
    assert [o.shape for o in ours] == [tuple(t.shape) for t in theirs]
    for ours_i, theirs_i in zip(ours, theirs):
        np.testing.assert_allclose(ours_i, theirs_i.numpy(), rtol=RTOL, atol=ATOL)
    # the second-to-last block's output: not the normed last state
    last = run(params, ids, mask, layer=-1)
    assert not np.allclose(np.asarray(last)[0, :5], ours[0][:5], atol=1e-2)


def test_an_older_qwen2_5_vl_config_json_is_read():
    """Older files keep the text fields and `rope_theta` at the top, the rotary as
    `rope_scaling: {"type": "mrope", ...}`."""
    older = dict(
        SHARED,
        model_type="qwen2_5_vl",
        rope_theta=700.0,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 32},
    )
    config = decoder_text.config_from_transformers(older)
    assert config == decoder_text.config_from_transformers(reference("qwen2_5_vl").config)
