"""The `imagereward` converter and loader on a random release in the package's layout.

These need torch (to write and read the pickled release) but not the `image-reward` package:
the release is random tensors under the package's key names and shapes
(`imagereward_fixtures.release_shapes`, which tests/parity/test_imagereward.py checks against the
package's own state dict). Scores are compared with the package in tests/parity/test_imagereward.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import imagereward_fixtures as fixtures  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from tree_grpo_jax import config as cfg  # noqa: E402
from tree_grpo_jax import rewards  # noqa: E402
from tree_grpo_jax.models.base import ModelLoadError  # noqa: E402
from tree_grpo_jax.rewards import convert, imagereward  # noqa: E402

VOCAB = len(fixtures.SPECIALS + fixtures.WORDS + fixtures.PIECES) + 2  # + [DEC], [ENC]


def _run(argv, capsys):
    rc = convert.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(release file, tokenizer folder, state dict, converted folder)."""
    root = tmp_path_factory.mktemp("imagereward_release")
    checkpoint, tokenizer, state = fixtures.make_synthetic_release(root / "release")
    out = root / "converted"
    argv = ["imagereward", f"--checkpoint={checkpoint}", f"--tokenizer={tokenizer}", f"--out={out}"]
    assert convert.main([str(a) for a in argv]) == 0
    return checkpoint, tokenizer, state, out


def test_the_converted_folder(release, tmp_path, capsys):
    checkpoint, tokenizer, state, out = release
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "reward_config.json"} <= names
    # the tokenizer as the installed transformers saves it: 4 writes the WordPiece
    # vocabulary, 5 tokenizer.json alone
    assert {"vocab.txt", "tokenizer.json"} & names
    marker = json.loads((out / "reward_config.json").read_text())
    assert marker == {"reward": "imagereward", "converted_from": checkpoint.name, "format": 1}
    config = json.loads((out / "config.json").read_text())
    assert imagereward.ImageRewardConfig.from_dict(config) == imagereward.ImageRewardConfig(
        vision_width=128,
        vision_layers=2,
        vision_heads=2,
        vision_mlp_width=512,
        vocab_size=VOCAB,
        text_width=128,
        text_layers=2,
        text_heads=2,
        text_mlp_width=256,
        max_positions=40,
        mlp_widths=(128, 1024, 128, 64, 16, 1),
    )
    written = load_file(out / "model.safetensors")
    unused = [k for k in state if "_proj." in k or k.endswith("position_ids")]
    assert len(unused) == 5 and written.keys() == state.keys() - set(unused)
    for key, value in written.items():
        assert value.dtype == np.float32, key
        np.testing.assert_array_equal(value, state[key].numpy(), err_msg=key)

    bf16 = tmp_path / "bf16"
    argv = ["imagereward", f"--checkpoint={checkpoint}", f"--tokenizer={tokenizer}"]
    rc, _, err = _run([*argv, f"--out={bf16}", "--dtype=bfloat16"], capsys)
    assert rc == 0, err
    for key, value in load_file(bf16 / "model.safetensors").items():
        assert value.dtype.name == ("float32" if key.startswith("mlp.") else "bfloat16"), key


def test_the_tokenizer_keeps_blips_added_tokens(release):
    from transformers import BertTokenizer

    tokenizer = imagereward.load(str(release[3])).tokenizer
    assert len(tokenizer) == VOCAB
    base = len(fixtures.SPECIALS + fixtures.WORDS + fixtures.PIECES)
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [base, base + 1]
    # transformers 5 calls the added special tokens `extra_special_tokens`
    added = getattr(tokenizer, "additional_special_tokens", None)
    assert tokenizer.bos_token == "[DEC]"
    assert (added if added is not None else tokenizer.extra_special_tokens) == ["[ENC]"]
    source = BertTokenizer.from_pretrained(str(release[1]))
    prompt = "Two RED dogs [ENC] under the tree"
    ids = tokenizer(prompt).input_ids
    assert ids[:4] == source(prompt).input_ids[:4] and base + 1 in ids


def test_the_loaded_reward_scores(release):
    reward = rewards.load_reward("imagereward", str(release[3]), chunk_size=1)
    images = np.random.default_rng(0).random((2, 32, 48, 3), np.float32)
    scores = reward(images, ["a photo of a cat", "Two dogs"])
    assert scores.dtype == np.float32 and scores.shape == (2,)
    assert np.isfinite(np.asarray(scores)).all()


def _bad_inputs(tmp: Path, release) -> dict:
    """{case: (argv, a fragment of the error line)}."""
    checkpoint, tokenizer, state, _ = release

    def saved(name, value):
        torch.save(value, tmp / name)
        return tmp / name

    truncated = tmp / "truncated.pt"
    truncated.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    missing_key = dict(state)
    del missing_key["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    extra_key = {**state, "blip.text_encoder.pooler.dense.weight": torch.zeros(128, 128)}
    wrong_shape = {**state, "blip.visual_encoder.blocks.1.attn.proj.bias": torch.zeros(64)}
    aesthetic = {f"layers.{i}.weight": torch.zeros(2, 2) for i in (0, 2, 4, 6, 7)}
    other = {"weight": torch.zeros(3)}
    small_vocab = tmp / "small_vocab"
    small_vocab.mkdir()
    (small_vocab / "vocab.txt").write_text("\n".join(fixtures.SPECIALS + ["a", "cat"]) + "\n")
    no_vocab = tmp / "no_vocab"
    no_vocab.mkdir()
    full = tmp / "full"
    full.mkdir()
    (full / "keep.txt").write_text("work")
    out = f"--out={tmp / 'out'}"
    ir = ["imagereward", out, f"--tokenizer={tokenizer}"]
    given = ["imagereward", out, f"--checkpoint={checkpoint}"]
    return {
        "missing": (ir + [f"--checkpoint={tmp / 'nope.pt'}"], "does not exist"),
        "truncated": (ir + [f"--checkpoint={truncated}"], "truncated"),
        "not_state_dict": (ir + [f"--checkpoint={saved('list.pt', [1])}"], "not a state dict"),
        "other_model": (ir + [f"--checkpoint={saved('o.pt', other)}"], "not look like"),
        "aesthetic": (ir + [f"--checkpoint={saved('a.pt', aesthetic)}"], "aesthetic predictor"),
        "missing_key": (
            ir + [f"--checkpoint={saved('m.pt', missing_key)}"],
            "missing blip.text_encoder.encoder.layer.1.crossattention.self.key.weight",
        ),
        "extra_key": (
            ir + [f"--checkpoint={saved('e.pt', extra_key)}"],
            "unexpected blip.text_encoder.pooler.dense.weight",
        ),
        "wrong_shape": (
            ir + [f"--checkpoint={saved('w.pt', wrong_shape)}"],
            "mis-shaped blip.visual_encoder.blocks.1.attn.proj.bias (64,) (expected (128,))",
        ),
        "small_vocab": (given + [f"--tokenizer={small_vocab}"], "has 9 tokens"),
        "no_vocab": (given + [f"--tokenizer={no_vocab}"], "no vocab.txt"),
        "no_tokenizer_folder": (given + [f"--tokenizer={tmp / 'nope'}"], "does not exist"),
        "out_not_empty": (
            [
                "imagereward",
                f"--out={full}",
                f"--tokenizer={tokenizer}",
                f"--checkpoint={checkpoint}",
            ],
            "not empty",
        ),
        "no_tokenizer": (given, "--tokenizer"),
        "bad_dtype": (ir + [f"--checkpoint={checkpoint}", "--dtype=int8"], "--dtype"),
    }


def test_bad_inputs_are_one_line_and_exit_2(release, tmp_path, capsys):
    for case, (argv, fragment) in _bad_inputs(tmp_path, release).items():
        rc, _, err = _run(argv, capsys)
        assert rc == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1, (case, err)
        assert fragment in lines[0], (case, lines[0])
        assert not (tmp_path / "out").exists(), case
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name], case
    assert (tmp_path / "full" / "keep.txt").read_text() == "work"


def test_without_torch(release, tmp_path, capsys, monkeypatch):
    checkpoint, tokenizer, _, _ = release
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    argv = ["imagereward", f"--checkpoint={checkpoint}", f"--tokenizer={tokenizer}"]
    rc, _, err = _run(argv + [f"--out={tmp_path / 'out'}"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "pip install torch" in err
    assert not (tmp_path / "out").exists()


def test_loading_refuses_other_folders_in_one_sentence(release, tmp_path):
    out = release[3]

    def folder(name, marker, config_changes=None, weights=None):
        path = tmp_path / name
        path.mkdir()
        for tokenizer_file in out.iterdir():
            if tokenizer_file.name not in (
                "model.safetensors",
                "config.json",
                "reward_config.json",
            ):
                (path / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
        (path / "model.safetensors").write_bytes(
            weights or (out / "model.safetensors").read_bytes()
        )
        config = json.loads((out / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
        if marker:
            (path / "reward_config.json").write_text(json.dumps({"reward": marker}))
        return path

    weights = (out / "model.safetensors").read_bytes()
    cases = {
        "not converted": (folder("plain", None), "is not a converted ImageReward folder"),
        "hpsv2": (folder("hps", "hpsv2"), "converted for the 'hpsv2' reward"),
        "missing": (tmp_path / "nope", "does not exist"),
        "layers": (
            folder("layers", "imagereward", {"text_layers": 3}),
            "missing blip/text_encoder/encoder/layer_2",
        ),
        "heads": (
            folder("heads", "imagereward", {"vision_heads": 3}),
            "vision_width 128 does not split into 3 heads",
        ),
        "kind": (folder("kind", "imagereward", {"model_type": "bert"}), "'bert' model"),
        "truncated": (
            folder("cut", "imagereward", weights=weights[: len(weights) // 2]),
            "damaged or truncated",
        ),
    }
    for case, (path, fragment) in cases.items():
        with pytest.raises(ModelLoadError) as info:
            rewards.load_reward("imagereward", str(path))
        message = str(info.value)
        assert fragment in message and len(message.splitlines()) == 1, (case, message)
        assert "rewards.convert imagereward" in message, (case, message)


def test_registered_and_configured():
    assert "imagereward" in rewards.available_rewards() and rewards.needs_weights("imagereward")
    from tree_grpo_jax.config import base_config

    c = base_config()
    c.rewards = "imagereward"
    with pytest.raises(cfg.ConfigError, match="reward_models.imagereward=/path"):
        cfg.validate(c, known_rewards=rewards.available_rewards())
    c.reward_models.imagereward = "/models/imagereward"
    assert cfg.validate(c, known_rewards=rewards.available_rewards()) == {"imagereward": 1.0}


def test_the_release_sizes_map_onto_the_flax_tree():
    """At the release's own sizes (ViT-L/16, BERT-base): the converter reads the defaults back
    from the shapes and every tensor finds its Flax parameter (shapes only, nothing allocated)."""
    from tree_grpo_jax.weights import convert as weights

    release = imagereward.ImageRewardConfig()
    shapes = convert.expected_shapes(release.to_dict())
    state = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}
    assert convert.release_config(state) == release.to_dict()
    reference = imagereward.reference_shapes(release)
    params = weights.pytorch_to_flax(state, reference, merge_indices=True)
    assert weights.shapes_of(params) == reference
