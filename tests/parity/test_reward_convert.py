"""The reward-release converter against open_clip and transformers (PyTorch), on tiny models.

Every numeric comparison is with the reference libraries' own outputs: open_clip's
`encode_image` / `encode_text` and `open_clip.tokenize` for `hpsv2`, the source transformers
CLIP's tensors and image features for `aesthetic`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

from clip_fixtures import features  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import load_file as load_torch_file  # noqa: E402

from tree_grpo_jax.rewards import convert  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EMBED_DIM = 16
VISION = {"layers": 2, "width": 32, "head_width": 8, "patch_size": 8, "image_size": 32}
TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2}
PROMPTS = [
    "a photo of a cat",
    "Two DOGS playing in the snow, 4k!!",
    "café naïve résumé — ünïcödé 🙂 日本語",
    "  spaces\tand\nnewlines  ",
    "a very long prompt that open_clip truncates " * 12,
]
TOLERANCE = 1e-5


def _open_clip_model(quick_gelu: bool, seed: int):
    torch.manual_seed(seed)
    model = open_clip.model.CLIP(
        embed_dim=EMBED_DIM,
        vision_cfg=open_clip.model.CLIPVisionCfg(**VISION),
        text_cfg=open_clip.model.CLIPTextCfg(**TEXT),
        quick_gelu=quick_gelu,
    )
    with torch.no_grad():  # LayerNorms, biases and logit_scale away from their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _open_clip_config(path: Path, quick_gelu: bool) -> Path:
    config = {"embed_dim": EMBED_DIM, "quick_gelu": quick_gelu}
    config |= {"vision_cfg": VISION, "text_cfg": TEXT}
    path.write_text(json.dumps(config))
    return path


def _run(argv, capsys):
    rc = convert.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _no_staging_left(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".partial-" in p.name]


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """{quick_gelu: (open_clip model, release file, open_clip config, converted folder)}."""
    root = tmp_path_factory.mktemp("hps")
    out = {}
    for quick_gelu in (False, True):
        name = "quick" if quick_gelu else "gelu"
        model = _open_clip_model(quick_gelu, seed=int(quick_gelu))
        checkpoint = root / f"HPS_{name}.pt"
        torch.save({"state_dict": model.state_dict()}, checkpoint)
        config = _open_clip_config(root / f"{name}.json", quick_gelu)
        folder = root / f"out_{name}"
        argv = ["hpsv2", f"--checkpoint={checkpoint}", f"--out={folder}"]
        rc = convert.main(argv + [f"--open-clip-config={config}"])
        assert rc == 0
        out[quick_gelu] = (model, checkpoint, config, folder)
    return out


@pytest.mark.parametrize("quick_gelu", [False, True], ids=["gelu", "quick_gelu"])
def test_hpsv2_features_match_open_clip(releases, quick_gelu):
    model, checkpoint, _, folder = releases[quick_gelu]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [
            "config.json",
            "model.safetensors",
            "reward_config.json",
            "vocab.json",
            "merges.txt",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ]
    )
    reward = json.loads((folder / "reward_config.json").read_text())
    assert reward == {"reward": "hpsv2", "converted_from": checkpoint.name, "format": 1}
    config = json.loads((folder / "config.json").read_text())
    act = "quick_gelu" if quick_gelu else "gelu"
    assert config["text_config"]["hidden_act"] == config["vision_config"]["hidden_act"] == act
    assert config["logit_scale_init_value"] == pytest.approx(model.logit_scale.item())

    hf, info = transformers.CLIPModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mis-shaped keys
    hf.eval()
    assert hf.logit_scale.item() == model.logit_scale.item()
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    torch.manual_seed(2)
    images = torch.randn(3, 3, VISION["image_size"], VISION["image_size"])
    with torch.no_grad():
        want = model.encode_image(images, normalize=True)
        got = features(hf.get_image_features(pixel_values=images))
        got = got / got.norm(dim=-1, keepdim=True)
        image_diff = (want - got).abs().max().item()

        ids = open_clip.tokenize(PROMPTS)
        enc = tokenizer(
            PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
        )
        want = model.encode_text(ids, normalize=True)
        got = features(hf.get_text_features(input_ids=enc.input_ids))
        got = got / got.norm(dim=-1, keepdim=True)
        text_diff = (want - got).abs().max().item()
    print(f"{act}: max |diff| image {image_diff:.2e}, text {text_diff:.2e}")
    assert image_diff <= TOLERANCE
    assert text_diff <= TOLERANCE


def test_tokenizer_matches_open_clip(releases):
    folder = releases[False][3]
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    ids = open_clip.tokenize(PROMPTS)
    enc = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True)
    assert len(ids) == len(enc.input_ids)
    for prompt, want, got in zip(PROMPTS, ids.tolist(), enc.input_ids):
        eot = int(np.argmax(want))
        assert want[eot] == tokenizer.eos_token_id, prompt
        assert got.index(tokenizer.eos_token_id) == eot, prompt
        assert got[: eot + 1] == want[: eot + 1], prompt
    assert int(np.argmax(ids[-1])) == 76  # the long prompt was truncated
    assert tokenizer.bos_token_id == ids[0, 0].item()


def test_dtypes_and_copied_tokenizer(releases, tmp_path, capsys):
    """A bfloat16 release kept as is, a float32 one cast to float16, and --tokenizer copying.

    `source` is the float32 folder checked against open_clip above; the expected tensors are
    torch's own casts of it.
    """
    model, checkpoint, config, source = releases[False]
    ref = load_torch_file(source / "model.safetensors")
    bf16_release = tmp_path / "HPS_bf16.pt"
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save({"state_dict": state}, bf16_release)
    cases = [
        (bf16_release, "keep", torch.bfloat16, "bfloat16"),
        (checkpoint, "float16", torch.float16, "float16"),
    ]
    for release, dtype, torch_dtype, name in cases:
        out = tmp_path / dtype
        argv = ["hpsv2", f"--checkpoint={release}", f"--out={out}", f"--open-clip-config={config}"]
        rc, stdout, err = _run(argv + [f"--dtype={dtype}", f"--tokenizer={source}"], capsys)
        assert rc == 0, err
        assert stdout.splitlines()[-1].startswith("done")
        weights = load_torch_file(out / "model.safetensors")
        assert weights.keys() == ref.keys()
        for key, value in weights.items():
            assert value.dtype == torch_dtype, (dtype, key)
            assert torch.equal(value, ref[key].to(torch_dtype)), (dtype, key)
        config_json = json.loads((out / "config.json").read_text())
        assert config_json["torch_dtype"] == name
        for file in convert.TOKENIZER_FILES:
            assert (out / file).read_bytes() == (source / file).read_bytes(), file
        transformers.CLIPModel.from_pretrained(out)  # loads (upcast to float32)


def test_without_torch(releases, tmp_path, capsys, monkeypatch):
    _, checkpoint, config, _ = releases[False]
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    argv = ["hpsv2", f"--checkpoint={checkpoint}", f"--out={tmp_path / 'out'}"]
    rc, _, err = _run(
        argv + [f"--open-clip-config={config}", "--tokenizer", releases[False][3]], capsys
    )
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "pip install torch" in err
    assert not (tmp_path / "out").exists()


class _AestheticMLP(torch.nn.Module):
    """The LAION predictor's layout (`self.layers` Sequential) with tiny widths."""

    def __init__(self, widths):
        super().__init__()
        a, b, c, d, e = widths
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(a, b),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(b, c),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(c, d),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(d, e),
            torch.nn.Linear(e, 1),
        )


@pytest.fixture(scope="module")
def aesthetic_release(tmp_path_factory):
    """(release file, transformers CLIP folder (sharded), the CLIP model)."""
    root = tmp_path_factory.mktemp("aesthetic")
    torch.manual_seed(3)
    text = {"vocab_size": 99, "hidden_size": 16, "intermediate_size": 32}
    text |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    clip = transformers.CLIPModel(config).eval()
    clip_dir = root / "clip-vit-tiny"
    clip.save_pretrained(clip_dir, max_shard_size="100KB")
    assert (clip_dir / "model.safetensors.index.json").is_file()
    mlp = _AestheticMLP((24, 20, 12, 8, 4))
    checkpoint = root / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), checkpoint)
    return checkpoint, clip_dir, clip, mlp


def test_aesthetic_conversion(aesthetic_release, tmp_path, capsys):
    checkpoint, clip_dir, clip, mlp = aesthetic_release
    out = tmp_path / "aesthetic"
    rc, stdout, err = _run(
        ["aesthetic", f"--checkpoint={checkpoint}", f"--clip={clip_dir}", f"--out={out}"], capsys
    )
    assert rc == 0, err
    assert err == ""
    assert len(stdout.splitlines()) >= 4  # a line per stage
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "aesthetic_mlp.safetensors", "reward_config.json"]
    )
    reward = json.loads((out / "reward_config.json").read_text())
    assert reward["reward"] == "aesthetic" and reward["converted_from"] == checkpoint.name
    assert reward["format"] == 1

    mlp_out = load_file(out / "aesthetic_mlp.safetensors")
    mlp_in = {k: v.numpy() for k, v in mlp.state_dict().items()}
    assert mlp_out.keys() == mlp_in.keys() == set(convert.AESTHETIC_KEYS)
    for key, value in mlp_in.items():
        assert mlp_out[key].dtype == np.float32
        np.testing.assert_array_equal(mlp_out[key], value, err_msg=key)

    vision_in = {
        k: v.numpy()
        for k, v in clip.state_dict().items()
        if k.startswith("vision_model.") or k == "visual_projection.weight"
    }
    vision_out = load_file(out / "model.safetensors")
    assert vision_out.keys() == vision_in.keys()
    for key, value in vision_in.items():
        np.testing.assert_array_equal(vision_out[key], value, err_msg=key)

    tower, info = transformers.CLIPVisionModelWithProjection.from_pretrained(
        out, output_loading_info=True
    )
    assert not any(info.values()), info
    torch.manual_seed(4)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = features(clip.get_image_features(pixel_values=images))
        got = tower.eval()(pixel_values=images).image_embeds
    assert (want - got).abs().max().item() <= TOLERANCE


def test_aesthetic_folder_the_converter_writes_scores_as_the_laion_predictor(
    aesthetic_release, tmp_path, capsys
):
    """The converted folder (the image tower alone) loads as the `aesthetic` reward and scores
    as the LAION script does: OpenAI CLIP's preprocessing, the unit image embedding, the MLP."""
    from torchvision import transforms

    from tree_grpo_jax import rewards
    from tree_grpo_jax.rewards import preprocess

    checkpoint, clip_dir, clip, mlp = aesthetic_release
    out = tmp_path / "aesthetic"
    rc, _, err = _run(
        ["aesthetic", f"--checkpoint={checkpoint}", f"--clip={clip_dir}", f"--out={out}"], capsys
    )
    assert rc == 0, err
    size = clip.config.vision_config.image_size
    images = np.random.default_rng(5).random((3, size, size, 3)).astype(np.float32)
    pipeline = transforms.Compose(
        [
            transforms.ToTensor(),
            transforms.Normalize(preprocess.OPENAI_CLIP_MEAN, preprocess.OPENAI_CLIP_STD),
        ]
    )  # the images are at the tower's size already: its resize and crop change nothing
    levels = np.round(images * 255).astype(np.uint8)
    with torch.no_grad():
        pixels = torch.stack([pipeline(x) for x in levels])
        embedding = features(clip.get_image_features(pixel_values=pixels))
        embedding = embedding / embedding.norm(dim=-1, keepdim=True)
        expected = mlp.eval().layers(embedding)[:, 0].numpy()
    got = np.asarray(rewards.load_reward("aesthetic", str(out))(images, ["a", "b", "c"]))
    np.testing.assert_allclose(got, expected, atol=1e-4 * max(1.0, np.abs(expected).max()))


def _bad_inputs(tmp: Path, releases, aesthetic_release) -> dict:
    """{case: (argv, a fragment of the error line)}."""
    _, checkpoint, config, _ = releases[False]
    aesthetic, clip_dir, _, _ = aesthetic_release
    truncated = tmp / "truncated.pt"
    truncated.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    state["visual.proj"] = torch.zeros(VISION["width"], EMBED_DIM + 1)
    wrong_shape = tmp / "wrong_shape.pt"
    torch.save({"state_dict": state}, wrong_shape)
    not_state_dict = tmp / "list.pt"
    torch.save([torch.zeros(2)], not_state_dict)
    pooler = tmp / "pooler.json"
    vision = {**VISION, "attentional_pool": True}
    pooler.write_text(json.dumps({"embed_dim": EMBED_DIM, "vision_cfg": vision, "text_cfg": TEXT}))
    # a layer count that would make the key plan and the expected shapes run forever
    deep = tmp / "deep.json"
    vision = {**VISION, "layers": 10**12}
    deep.write_text(json.dumps({"embed_dim": EMBED_DIM, "vision_cfg": vision, "text_cfg": TEXT}))
    full = tmp / "full"
    full.mkdir()
    (full / "keep.txt").write_text("work")
    empty = tmp / "empty_clip"
    empty.mkdir()
    out = f"--out={tmp / 'out'}"
    cfg = f"--open-clip-config={config}"
    hps = ["hpsv2", out, cfg]
    return {
        "missing": (hps + [f"--checkpoint={tmp / 'nope.pt'}"], "does not exist"),
        "truncated": (hps + [f"--checkpoint={truncated}"], "truncated"),
        "not_state_dict": (hps + [f"--checkpoint={not_state_dict}"], "not a state dict"),
        "aesthetic_to_hps": (hps + [f"--checkpoint={aesthetic}"], "aesthetic predictor"),
        "hps_to_aesthetic": (
            ["aesthetic", f"--checkpoint={checkpoint}", f"--clip={clip_dir}", out],
            "open_clip CLIP checkpoint",
        ),
        "wrong_shape": (hps + [f"--checkpoint={wrong_shape}"], "mis-shaped visual.proj"),
        "wrong_architecture": (["hpsv2", out, f"--checkpoint={checkpoint}"], "ViT-H-14"),
        "attentional_pool": (
            ["hpsv2", out, f"--checkpoint={checkpoint}", f"--open-clip-config={pooler}"],
            "attentional_pool",
        ),
        "absurd_layers": (
            ["hpsv2", out, f"--checkpoint={checkpoint}", f"--open-clip-config={deep}"],
            "vision_cfg.layers is 1,000,000,000,000; no CLIP tower has more than",
        ),
        "out_not_empty": (
            ["hpsv2", f"--out={full}", cfg, f"--checkpoint={checkpoint}"],
            "not empty",
        ),
        "clip_empty": (
            ["aesthetic", f"--checkpoint={aesthetic}", f"--clip={empty}", out],
            "not a transformers CLIP folder",
        ),
        "missing_argument": (["hpsv2", f"--checkpoint={checkpoint}"], "--out"),
    }


def test_bad_inputs_are_one_line_and_exit_2(releases, aesthetic_release, tmp_path, capsys):
    cases = _bad_inputs(tmp_path, releases, aesthetic_release)
    for case, (argv, fragment) in cases.items():
        rc, _, err = _run(argv, capsys)
        assert rc == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1, (case, err)
        assert fragment in lines[0], (case, lines[0])
        assert not (tmp_path / "out").exists(), case
        assert _no_staging_left(tmp_path), case
    assert (tmp_path / "full" / "keep.txt").read_text() == "work"
    message = _run(cases["wrong_architecture"][0], capsys)[2]
    assert "missing" in message and "in all)" in message  # five names, then the count


def test_overwrite_replaces_the_folder(releases, tmp_path, capsys):
    _, checkpoint, config, _ = releases[True]
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    argv = ["hpsv2", f"--checkpoint={checkpoint}", f"--open-clip-config={config}", f"--out={out}"]
    rc, _, err = _run(argv + ["--overwrite"], capsys)
    assert rc == 0, err
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert _no_staging_left(tmp_path)


def test_command_line_usage_error_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tree_grpo_jax.rewards.convert", "hpsv3", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "invalid choice" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_writing_leaves_the_folder_whole_or_nothing(
    aesthetic_release, tmp_path, signum, status
):
    """Ctrl-C or SIGTERM as the converter says it writes: one line, exit 130 / 143, and
    either no folder (and no staging folder) or the whole one, as the line says."""
    checkpoint, clip_dir, _, _ = aesthetic_release
    out = tmp_path / "aesthetic"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.rewards.convert", "aesthetic",
         f"--checkpoint={checkpoint}", f"--clip={clip_dir}", f"--out={out}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("writing "):
            proc.send_signal(signum)
    code = proc.wait(timeout=300)
    assert code in (status, 0), lines[-10:]
    assert _no_staging_left(tmp_path)
    written = ["config.json", "model.safetensors", "aesthetic_mlp.safetensors"]
    if code == 0:  # on a loaded machine the write may end before the signal arrives: whole
        assert lines[-1].startswith("done: "), lines[-10:]
        assert sorted(p.name for p in out.iterdir()) == sorted([*written, "reward_config.json"])
        return  # (tests/unit/test_staging.py signals inside the swap, deterministically)
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines[-10:]
    if "written whole" in errors[0]:
        assert sorted(p.name for p in out.iterdir()) == sorted([*written, "reward_config.json"])
    else:
        assert "nothing was written" in errors[0] and not out.exists(), errors[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, signum", [("in the teardown", signal.SIGTERM), ("in an exit handler", signal.SIGINT)]
)
def test_a_signal_after_the_done_line_is_said_or_finds_the_process_gone(
    aesthetic_release, tmp_path, where, signum
):
    """A signal once the converter has written the folder and said `done:`, as it exits: in
    an exit handler, the line that says the folder is whole, exit 130; Python's teardown
    (seconds of freeing torch and JAX, where a signal used to kill the process without a
    line) is never reached: the process has ended, exit 0."""
    from signalled import run_ending

    checkpoint, clip_dir, _, _ = aesthetic_release
    out = tmp_path / "aesthetic"
    args = ("aesthetic", f"--checkpoint={checkpoint}", f"--clip={clip_dir}", f"--out={out}")
    result = run_ending("tree_grpo_jax.rewards.convert", where, signum, *args)
    assert [line for line in result.stdout.splitlines() if line.startswith("done: ")]
    written = ["aesthetic_mlp.safetensors", "config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [*written, "reward_config.json"]
    assert _no_staging_left(tmp_path) and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if where == "in the teardown":
        assert result.returncode == 0 and not errors, result.stderr[-2000:]
        assert "sending" not in result.stdout  # the teardown, where it is sent, never came
    else:
        assert result.returncode == 130, result.stderr[-2000:]
        assert errors == [
            f"error: SIGINT arrived after the conversion was done; {out} is written whole."
        ]
