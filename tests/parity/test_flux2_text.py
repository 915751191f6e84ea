"""FLUX.2's prompt embeddings (models/flux2/text.py over models/decoder_text.py) against the
pipelines' own `encode_prompt`, run on transformers' tiny random PyTorch text encoders
(float32): `Flux2Pipeline` (dev) on a `Mistral3ForConditionalGeneration` (a Pixtral vision
tower and a projector beside the Mistral language model, which the converter skips) and
`Flux2KleinPipeline` on a `Qwen3ForCausalLM`, each deep enough for the pipeline's default
layers (10, 20, 30 and 9, 18, 27), then other layers (the embeddings and the normed last
state among them). Embeddings and text ids are compared at every token, the padding
included (the transformer sees all of it).

No Mistral or Qwen tokenizer is stored offline: both use `byte_tokenizer` (one token a byte,
the chat markers as special tokens); dev's is given Mistral-shaped special tokens and a chat
template in the shape of Mistral Small 3.1's (system prompt and instruction markers, typed
text parts), so the template token counts are not the real ones'."""

import functools

import jax
import numpy as np
import pytest

from tree_grpo_jax.models import builtin_configs, decoder_text
from tree_grpo_jax.models.flux2 import text as flux2_text

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from sd_fixtures import perturb  # noqa: E402
from zimage_fixtures import byte_tokenizer  # noqa: E402

RTOL = 1e-5  # of each value, and of the largest value as the absolute floor
VOCAB = 272  # the 259 byte-tokenizer tokens, dev's five markers and room to spare
SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PROMPTS = [
    "a red cat",
    "two dogs on a beach at sunset, film grain [IMG]",
    "a prompt long enough that the test's token budget cuts it short, well before its end",
]
DEV_LENGTH, KLEIN_LENGTH = 224, 56  # the system turn alone is about 170 byte tokens

MISTRAL_MARKERS = ("<s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# Mistral Small 3.1's shape: BOS, the system prompt in its markers, each user turn in the
# instruction markers; a content is a string or a list of typed parts.
MISTRAL_TEMPLATE = (
    r"{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}"
    r"{%- for part in c if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    r"{%- endif -%}{%- endmacro -%}"
    r"{{ bos_token }}{%- for m in messages -%}"
    r"{%- if m['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + text(m['content']) + "
    r"'[/SYSTEM_PROMPT]' }}"
    r"{%- elif m['role'] == 'user' -%}{{ '[INST]' + text(m['content']) + '[/INST]' }}"
    r"{%- endif -%}{%- endfor -%}"
)


@functools.cache
def qwen_tokenizer():
    return byte_tokenizer()


@functools.cache
def mistral_tokenizer():
    from tokenizers import AddedToken

    tok = byte_tokenizer()
    tok.add_tokens([AddedToken(t, special=True) for t in MISTRAL_MARKERS])
    tok.bos_token = "<s>"
    tok.chat_template = MISTRAL_TEMPLATE
    assert len(tok) <= VOCAB
    return tok


@functools.cache
def reference(kind: str):
    """The tiny PyTorch text encoder (float32, eval), weights perturbed."""
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(
            **SHARED,
            num_hidden_layers=28,
            rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        )
        model = transformers.Qwen3ForCausalLM(config)
    else:
        text = dict(
            SHARED,
            model_type="mistral",
            num_hidden_layers=31,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 900.0},
        )
        vision = dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=16,
            patch_size=4,
        )
        config = transformers.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=VOCAB - 1
        )
        model = transformers.Mistral3ForConditionalGeneration(config)
    perturb(model, torch.Generator().manual_seed(1))
    return model.eval()


@functools.cache
def ours(kind: str):
    """(module, params) of our encoder from the reference's config and state dict."""
    model = reference(kind)
    module = decoder_text.DecoderTextModel(decoder_text.config_from_transformers(model.config))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return module, decoder_text.params_from_state_dict(state, module)


def _pipeline(kind: str):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    cls = Flux2KleinPipeline if kind == "qwen3" else Flux2Pipeline
    pipe = cls(None, None, None, None, None)
    pipe.text_encoder = reference(kind)
    pipe.tokenizer = qwen_tokenizer() if kind == "qwen3" else mistral_tokenizer()
    return pipe


def _compare(kind: str, layers, length: int):
    with torch.no_grad():
        theirs, their_ids = _pipeline(kind).encode_prompt(
            PROMPTS, device="cpu", max_sequence_length=length, text_encoder_out_layers=layers
        )
    if kind == "qwen3":
        ids, mask = flux2_text.klein_prompt_inputs(qwen_tokenizer(), PROMPTS, length)
    else:
        ids, mask = flux2_text.dev_prompt_inputs(mistral_tokenizer(), PROMPTS, length)
    assert ids.shape == (len(PROMPTS), length) and mask[-1].all() and not mask[0].all()
    module, params = ours(kind)
    embeds, text_ids = jax.jit(lambda p, i, m: flux2_text.prompt_embeds(module, p, i, m, layers))(
        params, ids, mask
    )
    theirs = theirs.numpy()
    assert embeds.shape == theirs.shape == (len(PROMPTS), length, len(layers) * 32)
    np.testing.assert_array_equal(text_ids, their_ids.numpy())
    error = np.abs(np.asarray(embeds) - theirs).max() / np.abs(theirs).max()
    print(f"{kind} layers {layers}: max error relative to max |embedding|: {error:.2e}")
    np.testing.assert_allclose(embeds, theirs, rtol=RTOL, atol=RTOL * np.abs(theirs).max())
    # the prompts' embeddings differ, and the layers differ from one another
    assert np.abs(theirs[0] - theirs[1]).max() > 1e-2
    assert np.abs(theirs[0, :, :32] - theirs[0, :, -32:]).max() > 1e-2


def test_dev_prompt_embeds_match_the_pipeline():
    assert _pipeline("mistral3").system_message == flux2_text.SYSTEM_MESSAGE
    _compare("mistral3", flux2_text.DEV_LAYERS, DEV_LENGTH)


def test_dev_prompt_embeds_at_other_layers():
    _compare("mistral3", (0, 7, 31), DEV_LENGTH)


def test_klein_prompt_embeds_match_the_pipeline():
    _compare("qwen3", flux2_text.KLEIN_LAYERS, KLEIN_LENGTH)


def test_klein_prompt_embeds_at_other_layers():
    _compare("qwen3", (28, 1, 0), KLEIN_LENGTH)


def test_the_pipelines_defaults_are_ours():
    import inspect

    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    for cls, layers in ((Flux2Pipeline, flux2_text.DEV_LAYERS), (Flux2KleinPipeline, None)):
        defaults = inspect.signature(cls.encode_prompt).parameters
        assert defaults["max_sequence_length"].default == flux2_text.MAX_LENGTH
        expected = layers or flux2_text.KLEIN_LAYERS
        assert tuple(defaults["text_encoder_out_layers"].default) == expected


def test_the_released_text_configs_are_read():
    dev = decoder_text.config_from_transformers(builtin_configs.MISTRAL_SMALL_31_24B)
    assert (dev.hidden_size, dev.num_layers, dev.sliding_window) == (5120, 40, None)
    assert dev.rope_theta == 1e9 and not dev.qk_norm and dev.head_dim == 128
    klein_9b = decoder_text.config_from_transformers(builtin_configs.QWEN3_8B)
    assert (klein_9b.hidden_size, klein_9b.num_layers, klein_9b.qk_norm) == (4096, 36, True)
    klein_4b = decoder_text.config_from_transformers(builtin_configs.QWEN3_4B)
    # the transformer's text width: three states side by side
    widths = [3 * c.hidden_size for c in (dev, klein_9b, klein_4b)]
    assert widths == [15360, 12288, 7680]
    assert max(flux2_text.DEV_LAYERS) <= dev.num_layers
    assert max(flux2_text.KLEIN_LAYERS) <= klein_4b.num_layers


def test_a_mistral3_config_with_another_text_model_is_one_sentence():
    config = dict(builtin_configs.MISTRAL_SMALL_31_24B)
    config["text_config"] = dict(config["text_config"], model_type="llama")
    with pytest.raises(ValueError, match="text model is 'llama'"):
        decoder_text.config_from_transformers(config)
