"""SD3's text side: a tiny random CLIP-L / CLIP-G / T5 folder written by transformers' PyTorch
classes is read by our loader (without torch) and `encode` gives what diffusers'
`StableDiffusion3Pipeline.encode_prompt` gives, with and without T5."""

import dataclasses
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.sd3 import text

torch = pytest.importorskip("torch")
from sd3_fixtures import T5_WIDTH, make_tiny_sd3_text  # noqa: E402

ATOL = 1e-5
LONG = " ".join(["a photo of a cat"] * 60)  # past CLIP's 77 tokens and T5's 256
PROMPTS = ["a photo of a cat", "", LONG, "A Dog, 3 cats!"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_sd3_text(tmp_path_factory.mktemp("tiny_sd3_text"))


@pytest.fixture(scope="module")
def encoders(folder):
    return text.load_text_encoders(folder, joint_attention_dim=T5_WIDTH)


def _pipeline(folder, use_t5=True):
    """diffusers' pipeline holding only the text side, read by transformers' PyTorch classes."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import (
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5EncoderModel,
        T5TokenizerFast,
    )

    pipe = StableDiffusion3Pipeline(
        transformer=None,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2"),
        tokenizer_2=CLIPTokenizer.from_pretrained(folder / "tokenizer_2"),
        text_encoder_3=T5EncoderModel.from_pretrained(folder / "text_encoder_3")
        if use_t5
        else None,
        tokenizer_3=T5TokenizerFast.from_pretrained(folder / "tokenizer_3") if use_t5 else None,
    )
    if not use_t5:  # the zeros' width comes from the transformer's config
        config = type("Config", (), {"joint_attention_dim": T5_WIDTH})()
        pipe.__dict__["transformer"] = type("Transformer", (), {"config": config})()
    return pipe


def _reference(pipe, prompts, **options):
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, device="cpu", do_classifier_free_guidance=False, **options
        )
    return embeds.numpy(), pooled.numpy()


def _max_diffs(ours, theirs):
    return [float(np.abs(a - b).max()) for a, b in zip(ours, theirs)]


def test_encode_matches_diffusers_encode_prompt(folder, encoders):
    # Each tokenizer pads with its own token, and padding is part of the sequence.
    assert encoders.clip_l.tokenizer.pad_token == "<|endoftext|>"
    assert encoders.clip_g.tokenizer.pad_token == "!"
    assert encoders.t5.tokenizer.pad_token == "<pad>"
    embeds, pooled = encoders.encode(PROMPTS)
    assert embeds.shape == (len(PROMPTS), 77 + 256, T5_WIDTH)
    assert pooled.shape == (len(PROMPTS), 16 + 24)
    assert embeds.dtype == pooled.dtype == np.float32
    reference = _reference(_pipeline(folder), PROMPTS)
    assert reference[0].shape == embeds.shape
    diffs = _max_diffs((embeds, pooled), reference)
    print("max abs difference with T5 (embeds, pooled):", diffs)
    assert max(diffs) <= ATOL, diffs
    # Every part is really there: CLIP-L, CLIP-G, zero padding, T5.
    assert np.abs(embeds[:, :77, :32]).max() > 0.1
    assert np.abs(embeds[:, :77, 32:80]).max() > 0.1
    assert not embeds[:, :77, 80:].any()
    assert np.abs(embeds[:, 77:]).max() > 0.1


def test_encode_without_t5_reads_no_t5_folder(folder, tmp_path):
    """`use_t5=False` gives the pipeline's zeros and never opens text_encoder_3/."""
    root = tmp_path / "no_t5"
    root.mkdir()
    for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        (root / name).symlink_to(folder / name)
    no_t5 = text.load_text_encoders(root, use_t5=False, joint_attention_dim=T5_WIDTH)
    embeds, pooled = no_t5.encode(PROMPTS)
    assert embeds.shape == (len(PROMPTS), 77 + 256, T5_WIDTH)
    assert not embeds[:, 77:].any()
    diffs = _max_diffs((embeds, pooled), _reference(_pipeline(folder, use_t5=False), PROMPTS))
    print("max abs difference without T5 (embeds, pooled):", diffs)
    assert max(diffs) <= ATOL, diffs
    assert all(entry[1] is None for entry in no_t5.cache.values())  # no zeros kept


def test_cache_runs_each_prompt_once(encoders):
    fresh = dataclasses.replace(encoders, cache={}, batch_size=4)
    calls = []

    def counting(run):
        def counted(params, ids):
            calls.append(ids.shape)
            return run(params, ids)

        return counted

    for name in ("clip_l", "clip_g", "t5"):
        encoder = getattr(fresh, name)
        setattr(fresh, name, dataclasses.replace(encoder, run=counting(encoder.run)))
    first = fresh.encode(["a cat", "a dog", "a cat"])
    # Each encoder ran once, on the two distinct prompts padded to batch_size.
    assert calls == [(4, 77), (4, 77), (4, 256)]
    assert list(fresh.cache) == ["a cat", "a dog"]
    np.testing.assert_array_equal(first[0][0], first[0][2])

    def fail(params, ids):
        raise AssertionError("an encoder ran on a cached prompt")

    for name in ("clip_l", "clip_g", "t5"):
        setattr(fresh, name, dataclasses.replace(getattr(fresh, name), run=fail))
    again = fresh.encode(["a dog", "a cat", "a cat"])
    np.testing.assert_array_equal(again[0], first[0][[1, 0, 0]])
    np.testing.assert_array_equal(again[1], first[1][[1, 0, 0]])


def test_drop_t5_keeps_cached_prompts_only(encoders):
    fresh = dataclasses.replace(encoders, cache={})
    fresh.precompute(["a photo of a cat", ""])
    expected = fresh.encode(["a photo of a cat"])
    fresh.drop_t5()
    assert fresh.t5 is None and encoders.t5 is not None
    np.testing.assert_array_equal(fresh.encode(["a photo of a cat"])[0], expected[0])
    with pytest.raises(ValueError, match="'a dog' is not cached and T5 was dropped"):
        fresh.encode(["", "a dog"])


def test_long_prompt_is_truncated_like_the_tokenizers(encoders):
    longer = LONG + " and a dog"
    embeds, pooled = encoders.encode([LONG, longer])
    np.testing.assert_array_equal(embeds[0], embeds[1])
    np.testing.assert_array_equal(pooled[0], pooled[1])


def test_t5_max_length_sets_the_sequence(folder, encoders):
    short = text.load_text_encoders(folder, t5_max_length=16, joint_attention_dim=T5_WIDTH)
    embeds, pooled = short.encode(PROMPTS[:2])
    assert embeds.shape == (2, 77 + 16, T5_WIDTH)
    reference = _reference(_pipeline(folder), PROMPTS[:2], max_sequence_length=16)
    assert max(_max_diffs((embeds, pooled), reference)) <= ATOL


def test_bfloat16_encoders_cache_bfloat16_and_return_float32(folder, encoders):
    import jax.numpy as jnp

    bf16 = text.load_text_encoders(folder, jnp.bfloat16, joint_attention_dim=T5_WIDTH)
    embeds, pooled = bf16.encode(PROMPTS)
    assert embeds.dtype == pooled.dtype == np.float32
    assert all(part.dtype == jnp.bfloat16 for part in bf16.cache[PROMPTS[0]])
    ref_embeds, ref_pooled = encoders.encode(PROMPTS)
    assert np.abs(embeds - ref_embeds).max() < 0.05 * np.abs(ref_embeds).max()
    assert np.abs(pooled - ref_pooled).max() < 0.05 * np.abs(ref_pooled).max()


def test_relative_position_buckets_match_pytorch():
    from transformers.models.t5.modeling_t5 import T5Attention

    for buckets, distance in ((32, 128), (8, 16)):  # T5-XXL's, and the tiny model's
        relative = torch.arange(512)[None, :] - torch.arange(512)[:, None]
        expected = T5Attention._relative_position_bucket(
            relative, bidirectional=True, num_buckets=buckets, max_distance=distance
        ).numpy()
        np.testing.assert_array_equal(
            text.relative_position_buckets(512, buckets, distance), expected
        )


def test_t5_tied_embedding_under_either_name(folder, encoders, tmp_path):
    """A T5 file may hold the tied embedding as `encoder.embed_tokens.weight` only."""
    from safetensors.numpy import save_file

    from tree_grpo_jax.weights import files

    root = _copy(folder, tmp_path)
    t5_folder = root / "text_encoder_3"
    state = files.read_safetensors_stem(t5_folder, "model", "")
    state["encoder.embed_tokens.weight"] = state.pop("shared.weight")
    for path in t5_folder.glob("model*.safetensors*"):
        path.unlink()
    save_file(state, t5_folder / "model.safetensors")
    loaded = text.load_text_encoders(root, joint_attention_dim=T5_WIDTH)
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.t5.params, encoders.t5.params)
    # Both names present: `shared.weight` wins.
    state["shared.weight"] = state["encoder.embed_tokens.weight"]
    state["encoder.embed_tokens.weight"] = np.zeros_like(state["shared.weight"])
    save_file(state, t5_folder / "model.safetensors")
    loaded = text.load_text_encoders(root, joint_attention_dim=T5_WIDTH)
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.t5.params, encoders.t5.params)


def test_loading_runs_without_torch(folder):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None
        from tree_grpo_jax.models.sd3 import text
        e = text.load_text_encoders({str(folder)!r}, joint_attention_dim={T5_WIDTH},
                                    batch_size=1)
        embeds, pooled = e.encode(["a cat"])
        assert embeds.shape == (1, 333, {T5_WIDTH}) and sys.modules["torch"] is None
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


# ---------------------------------------------------------------------------------------------
# Clear errors.


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _error(root: Path, **options) -> str:
    with pytest.raises(ModelLoadError) as err:
        text.load_text_encoders(root, joint_attention_dim=T5_WIDTH, **options)
    message = str(err.value)
    assert "--config.model.path" in message and "Stable Diffusion 3 folder" in message
    assert "\n" not in message
    return message


def test_missing_t5_folder_is_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    shutil.rmtree(root / "text_encoder_3")
    assert "has no text_encoder_3/ folder" in _error(root)


def test_missing_tokenizer_file_is_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    # transformers 4 saves vocab.json and merges.txt, transformers 5 tokenizer.json: either
    # is a tokenizer, so a folder that lacks one must lack both
    for name in ("tokenizer.json", "merges.txt"):
        (root / "tokenizer_2" / name).unlink(missing_ok=True)
    expected = "merges.txt" if (root / "tokenizer_2" / "vocab.json").is_file() else "vocab.json"
    assert f"has no tokenizer_2/{expected} (nor tokenizer_2/tokenizer.json" in _error(root)
    shutil.rmtree(root / "tokenizer_2")
    shutil.copytree(folder / "tokenizer_2", root / "tokenizer_2")
    (root / "tokenizer_3" / "tokenizer.json").unlink()
    assert "tokenizer_3 has neither tokenizer.json nor spiece.model" in _error(root)


def test_truncated_weights_are_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    path = root / "text_encoder_2" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    assert f"weights file {path} is damaged or truncated" in _error(root)


def test_truncated_shard_is_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    shard = sorted((root / "text_encoder_3").glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"weights file {shard} is damaged or truncated" in _error(root)


def test_pickle_only_folder_is_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    (root / "text_encoder" / "model.safetensors").unlink()
    (root / "text_encoder" / "pytorch_model.bin").write_bytes(b"pickle")
    message = _error(root)
    assert f"{root / 'text_encoder'} holds only PyTorch pickle weights" in message


def test_wrong_model_type_is_named(folder, tmp_path):
    root = _copy(folder, tmp_path)
    shutil.copy(root / "text_encoder" / "config.json", root / "text_encoder_3" / "config.json")
    message = _error(root)
    assert "model_type 'clip_text_model'" in message and "a T5 encoder" in message


def test_t5_width_must_match_the_transformer(folder):
    with pytest.raises(ModelLoadError, match="d_model 128, but the transformer's joint"):
        text.load_text_encoders(folder, joint_attention_dim=4096)
