"""Wan2.1's umT5 text encoder (models/wan/text.py) against transformers' `UMT5EncoderModel`
built tiny and random in PyTorch: a sharded `text_encoder/` and a `tokenizer/` folder read
without torch give what `WanPipeline._get_t5_prompt_embeds` gives (the padding mask passed
to the encoder, zeros past each prompt's length), each block's own position bias matters,
and bad folders are one sentence."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.wan import text

torch = pytest.importorskip("torch")
from sd_fixtures import perturb  # noqa: E402

HINT = "point model.path at a Wan2.1 diffusers folder"
WORDS = ("a", "photo", "of", "cat", "dog", "video", "running")
LENGTH = 24
# Two prompts of different lengths (and a long one past LENGTH tokens), with the markup and
# whitespace the pipeline cleans away.
PROMPTS = [
    "a  cat &amp; a dog",
    "a video of a dog running in a photo of a cat",
    " ".join(WORDS * 6),
]


def _save_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -2.0) for w in WORDS] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz&"]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    unigram.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    unigram.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    T5TokenizerFast(
        tokenizer_object=unigram,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=512,
    ).save_pretrained(path)
    return len(pieces)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Wan folder's text half: tokenizer/ and a sharded text_encoder/."""
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("wan_text")
    vocab = _save_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    model = UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab + 4,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
        )
    )
    perturb(model, torch.Generator().manual_seed(0))
    with torch.no_grad():  # the position biases large enough to steer the attention
        for block in model.encoder.block:
            block.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0.0, 2.0)
    model.eval().save_pretrained(
        root / "text_encoder", safe_serialization=True, max_shard_size="8KB"
    )
    assert (root / "text_encoder" / "model.safetensors.index.json").is_file()
    return root


@pytest.fixture(scope="module")
def encoder(folder):
    return text.load_prompt_encoder(folder, jnp.float32, HINT, max_length=LENGTH, width=16)


def _pipeline(folder, text_encoder=None):
    """WanPipeline holding only its text side, read by transformers' PyTorch classes."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    return WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder=text_encoder or UMT5EncoderModel.from_pretrained(folder / "text_encoder"),
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def _reference(pipe, prompts=PROMPTS):
    with torch.no_grad():
        return pipe._get_t5_prompt_embeds(
            prompts, max_sequence_length=LENGTH, device="cpu", dtype=torch.float32
        ).numpy()


def test_encode_equals_the_pipeline(folder, encoder):
    pipe = _pipeline(folder)
    expected = _reference(pipe)
    got = np.asarray(encoder(PROMPTS))
    assert got.shape == expected.shape == (3, LENGTH, 16) and got.dtype == np.float32
    diff = np.abs(got - expected).max()
    print(f"max abs difference {diff:.2e} (largest state {np.abs(expected).max():.2f})")
    assert diff <= 1e-5 * max(1.0, np.abs(expected).max()), diff
    # Zeros past each prompt's length (its tokens and </s>), and only there; the long
    # prompt is truncated to LENGTH.
    _, mask = encoder.tokenize(PROMPTS)
    lengths = mask.sum(1)
    assert lengths[0] < lengths[1] < lengths[2] == LENGTH
    for row, n in zip(got, lengths):
        assert not row[n:].any() and np.abs(row[:n]).min(axis=1).all()
    assert encoder.tokenizer.decode(encoder.tokenize(PROMPTS[:1])[0][0][: lengths[0] - 1]) == (
        "a cat & a dog"
    )


def test_the_mask_and_each_blocks_bias_matter(folder, encoder):
    """The reference moves when the padding is attended to (no mask) or when the second
    block uses the first block's bias table (T5's sharing), so matching it needs both."""
    from transformers import UMT5EncoderModel

    pipe = _pipeline(folder)
    expected = _reference(pipe)
    ids, mask = encoder.tokenize(PROMPTS)
    with torch.no_grad():
        unmasked = pipe.text_encoder(torch.from_numpy(ids).long()).last_hidden_state.numpy()
    short = mask[0].sum()
    assert np.abs(unmasked[0, :short] - expected[0, :short]).max() > 1e-2

    shared = UMT5EncoderModel.from_pretrained(folder / "text_encoder")
    blocks = shared.encoder.block
    with torch.no_grad():
        first = blocks[0].layer[0].SelfAttention.relative_attention_bias.weight
        blocks[1].layer[0].SelfAttention.relative_attention_bias.weight.copy_(first)
    assert np.abs(_reference(_pipeline(folder, shared)) - expected).max() > 1e-2


def test_convert_takes_either_embedding_name(folder, encoder):
    from safetensors.numpy import load_file

    config = text.umt5_config(
        json.loads((folder / "text_encoder" / "config.json").read_text()), "config.json", HINT
    )
    state = {}
    for shard in (folder / "text_encoder").glob("*.safetensors"):
        state.update(load_file(shard))
    embedding = state.get("shared.weight", state.get("encoder.embed_tokens.weight"))
    for names in (["shared.weight"], ["encoder.embed_tokens.weight"], ["shared.weight"] * 2):
        pruned = {k: v for k, v in state.items() if "shared" not in k and "embed_tokens" not in k}
        pruned.update({n: embedding for n in names})
        params = text.convert_umt5(pruned, config)
        np.testing.assert_array_equal(params["shared"]["embedding"], embedding)
    bias = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"
    np.testing.assert_array_equal(
        params["encoder"]["block"]["1"]["layer"]["0"]["SelfAttention"]["relative_attention_bias"][
            "embedding"
        ],
        state[bias],
    )
    del state[bias]
    with pytest.raises(Exception, match="missing encoder/block/1/layer/0/SelfAttention/relative"):
        text.convert_umt5(state, config)


def test_prompt_clean_is_the_pipelines():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    for prompt in ["  a\tcat\n\n&amp;amp; dog  ", "", "&lt;b&gt; x", "plain"]:
        assert text.prompt_clean(prompt) == prompt_clean(prompt)


def _copy(folder, tmp_path):
    root = tmp_path / "wan"
    shutil.copytree(folder, root)
    return root


def test_bad_folders_are_one_sentence(folder, tmp_path):
    root = _copy(folder, tmp_path)
    config_path = root / "text_encoder" / "config.json"
    config = json.loads(config_path.read_text())

    def refused(message):
        with pytest.raises(ModelLoadError, match=message) as error:
            text.load_umt5(root, jnp.float32, HINT, max_length=LENGTH)
        assert "\n" not in str(error.value) and str(error.value).endswith(HINT + ".")

    config_path.write_text(json.dumps({**config, "model_type": "t5"}))
    refused(r"has model_type 't5', but text_encoder/ must hold a umT5 encoder")
    config_path.write_text(json.dumps({**config, "num_layers": 3}))
    refused(r"^the weights in .* do not match its config \(missing encoder/block/2/")
    config_path.write_text(json.dumps(config))
    (root / "text_encoder" / "model.safetensors.index.json").unlink()
    refused(r"has no model.safetensors \(or its index\)")
    with pytest.raises(
        ModelLoadError, match=r"has d_model 16, but the transformer's text_dim is 32"
    ):
        text.load_prompt_encoder(folder, jnp.float32, HINT, max_length=LENGTH, width=32)
    shutil.rmtree(root / "tokenizer")
    refused(r"has no tokenizer/ folder")
    with pytest.raises(ValueError, match=r"^t5_max_length must be in \[1, 512\], got 600\.$"):
        text.load_umt5(folder, jnp.float32, HINT, max_length=600)
