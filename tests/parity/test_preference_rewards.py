"""The preference rewards against their official scorers, rebuilt in PyTorch on tiny random
models: PickScore and CLIP score as transformers' CLIPModel + CLIPProcessor compute them, the
aesthetic predictor as the LAION script does (OpenAI CLIP preprocessing, unit embedding,
linear MLP), HPS-v2.1 through open_clip (the converter test in test_reward_convert.py covers
the key mapping; here the whole reward is compared)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from clip_fixtures import features, make_clip_folder, pil_image_processor, smooth_images
from safetensors.numpy import save_file

from tree_grpo_jax import rewards
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.rewards import preprocess

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

PROMPTS = ["a photo of a cat", "a dog", "digit", "a photo of a dog, a cat and a digit of a cat"]
TOL = 1e-4


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    return make_clip_folder(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def images():
    # Non-square, so resizing and the centre crop both act.
    return smooth_images(np.random.default_rng(0), len(PROMPTS), 48, 40)


def _pil(images):
    levels = np.round(np.clip(images, 0, 1) * 255).astype(np.uint8)
    return [Image.fromarray(x) for x in levels]


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def _hf_features(model, folder, images, prompts):
    from transformers import CLIPProcessor, CLIPTokenizer

    processor = CLIPProcessor(
        image_processor=pil_image_processor().from_pretrained(str(folder)),
        tokenizer=CLIPTokenizer.from_pretrained(str(folder)),
    )
    with torch.no_grad():
        image_inputs = processor(images=_pil(images), return_tensors="pt")
        # The authors' call, with the tiny model's context (77 for the real ones).
        context = model.config.text_config.max_position_embeddings
        text_inputs = processor(
            text=prompts, padding=True, truncation=True, max_length=context, return_tensors="pt"
        )
        image = _unit(features(model.get_image_features(**image_inputs)))
        text = _unit(features(model.get_text_features(**text_inputs)))
    return image, text


def test_pickscore_equals_the_authors_scorer(clip_folder, images):
    folder, model = clip_folder
    image, text = _hf_features(model, folder, images, PROMPTS)
    expected = (model.logit_scale.exp() * (image * text).sum(-1)).detach().numpy()
    got = np.asarray(rewards.load_reward("pickscore", str(folder))(images, PROMPTS))
    assert got.dtype == np.float32 and got.shape == (len(PROMPTS),)
    np.testing.assert_allclose(got, expected, atol=TOL * np.abs(expected).max(), rtol=0)
    # Flow-GRPO's normalisation is the same score over 26.
    divided = rewards.load_reward("pickscore", str(folder), divisor=26.0)(images, PROMPTS)
    np.testing.assert_allclose(np.asarray(divided), expected / 26.0, rtol=TOL, atol=1e-6)


def test_clip_score_equals_torchmetrics_formula(clip_folder, images):
    folder, model = clip_folder
    image, text = _hf_features(model, folder, images, PROMPTS)
    expected = (100.0 * (image * text).sum(-1).clamp(min=0)).numpy()
    got = np.asarray(rewards.load_reward("clip_score", str(folder))(images, PROMPTS))
    np.testing.assert_allclose(got, expected, atol=TOL * 100)


def test_repeated_and_new_prompts_reuse_the_cache(clip_folder, images):
    folder, model = clip_folder
    reward = rewards.load_reward("clip_score", str(folder), chunk_size=3)
    first = np.asarray(reward(images, PROMPTS))
    shuffled = [PROMPTS[i] for i in (3, 2, 1, 0)]
    again = np.asarray(reward(images[::-1], shuffled))
    np.testing.assert_allclose(again, first[::-1], atol=1e-5)
    assert len(reward.fn.scorer._prompt_cache) == len(set(PROMPTS))


def _aesthetic_folder(tmp_path, clip_folder, widths=(16, 32, 8, 8, 4, 1)):
    """A converted aesthetic folder, written by hand (independent of the converter)."""
    folder, model = clip_folder
    out = tmp_path / "aesthetic"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_bytes((folder / name).read_bytes())
    rng = np.random.default_rng(1)
    names = ("layers.0", "layers.2", "layers.4", "layers.6", "layers.7")
    state = {}
    for name, (n_in, n_out) in zip(names, zip(widths[:-1], widths[1:], strict=True), strict=True):
        state[f"{name}.weight"] = rng.normal(0, 1 / np.sqrt(n_in), (n_out, n_in)).astype("f4")
        state[f"{name}.bias"] = rng.normal(0, 0.1, (n_out,)).astype("f4")
    save_file(state, str(out / "aesthetic_mlp.safetensors"))
    (out / "reward_config.json").write_text(json.dumps({"reward": "aesthetic", "format": 1}))
    return out, model, state, widths


def test_aesthetic_equals_the_laion_predictor(tmp_path, clip_folder, images):
    from torchvision import transforms

    out, model, state, widths = _aesthetic_folder(tmp_path, clip_folder)
    size = model.config.vision_config.image_size
    # The LAION script: OpenAI CLIP's preprocessing, the unit image embedding, the MLP.
    pipeline = transforms.Compose(
        [
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(preprocess.OPENAI_CLIP_MEAN, preprocess.OPENAI_CLIP_STD),
        ]
    )
    mlp = torch.nn.Module()  # the predictor keeps its MLP as `self.layers`
    mlp.layers = torch.nn.Sequential(
        torch.nn.Linear(widths[0], widths[1]),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(widths[1], widths[2]),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(widths[2], widths[3]),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(widths[3], widths[4]),
        torch.nn.Linear(widths[4], widths[5]),
    )
    mlp.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        pixels = torch.stack([pipeline(im) for im in _pil(images)])
        embedding = _unit(features(model.get_image_features(pixel_values=pixels)))
        expected = mlp.eval().layers(embedding)[:, 0].numpy()
    got = np.asarray(rewards.load_reward("aesthetic", str(out))(images, PROMPTS))
    np.testing.assert_allclose(got, expected, atol=TOL * max(1.0, np.abs(expected).max()))


def _resize_max_size(image, size):
    """HPSv2's ResizeMaxSize(size, fill=0) on a [C, H, W] tensor, as its scorer applies it."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    height, width = image.shape[-2:]
    scale = size / max(height, width)
    new = [round(height * scale), round(width * scale)]
    image = F.resize(image, new, interpolation=InterpolationMode.BICUBIC, antialias=True)
    pad_h, pad_w = size - new[0], size - new[1]
    return F.pad(image, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)


def test_hpsv2_equals_open_clip_scorer(tmp_path, images):
    open_clip = pytest.importorskip("open_clip")
    convert = pytest.importorskip("tree_grpo_jax.rewards.convert")
    from torchvision import transforms

    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=16,
        vision_cfg=open_clip.model.CLIPVisionCfg(
            layers=2, width=32, head_width=8, patch_size=8, image_size=32
        ),
        text_cfg=open_clip.model.CLIPTextCfg(
            context_length=77, vocab_size=49408, width=32, heads=4, layers=2
        ),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    checkpoint = tmp_path / "hps.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    config = tmp_path / "tiny_open_clip.json"
    config.write_text(
        json.dumps(
            {
                "embed_dim": 16,
                "vision_cfg": {
                    "layers": 2,
                    "width": 32,
                    "head_width": 8,
                    "patch_size": 8,
                    "image_size": 32,
                },
                "text_cfg": {
                    "context_length": 77,
                    "vocab_size": 49408,
                    "width": 32,
                    "heads": 4,
                    "layers": 2,
                },
            }
        )
    )
    out = tmp_path / "hps"
    code = convert.main(
        ["hpsv2", f"--checkpoint={checkpoint}", f"--out={out}", f"--open-clip-config={config}"]
    )
    assert code == 0

    # The HPSv2 scorer: its preprocess_val (ToTensor, then ResizeMaxSize on the tensor), the
    # open_clip tokenizer, and the diagonal of image_features @ text_features.T.
    normalize = transforms.Normalize(preprocess.OPENAI_CLIP_MEAN, preprocess.OPENAI_CLIP_STD)
    with torch.no_grad():
        pixels = torch.stack(
            [normalize(_resize_max_size(transforms.ToTensor()(im), 32)) for im in _pil(images)]
        )
        image = model.encode_image(pixels, normalize=True)
        text = model.encode_text(open_clip.tokenize(PROMPTS), normalize=True)
        expected = (image * text).sum(-1).numpy()
    got = np.asarray(rewards.load_reward("hpsv2", str(out))(images, PROMPTS))
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_bfloat16_scores_are_close(clip_folder, images):
    folder, _ = clip_folder
    full = np.asarray(rewards.load_reward("clip_score", str(folder))(images, PROMPTS))
    half = rewards.load_reward("clip_score", str(folder), dtype="bfloat16")
    assert half.fn.scorer.params["visual_projection"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half(images, PROMPTS)), full, atol=3.0)


def test_one_channel_and_tiny_images_are_scored(clip_folder):
    folder, _ = clip_folder
    grey = np.linspace(0, 1, 2 * 16 * 16).reshape(2, 16, 16, 1).astype(np.float32)
    scores = np.asarray(rewards.load_reward("pickscore", str(folder))(grey, PROMPTS[:2]))
    assert scores.shape == (2,) and np.all(np.isfinite(scores))


# --- Bad folders: one sentence each. -------------------------------------------------------


def test_missing_folder(tmp_path):
    # a local path that does not exist is said so, not sent to the hub as a repo id
    with pytest.raises(ModelLoadError, match="does not exist .*reward_models.pickscore"):
        rewards.load_reward("pickscore", str(tmp_path / "nowhere"))


def test_wrong_architecture(tmp_path, clip_folder):
    folder, _ = clip_folder
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "text_only"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config["text_config"]))
    with pytest.raises(ModelLoadError, match="not a CLIP model with both towers"):
        rewards.load_reward("clip_score", str(bad))
    # A plain CLIP folder is not a converted HPS folder.
    with pytest.raises(ModelLoadError, match="not a converted hpsv2 folder"):
        rewards.load_reward("hpsv2", str(folder))


def test_mismatched_weights_name_the_keys(tmp_path, clip_folder):
    folder, _ = clip_folder
    bad = tmp_path / "wider"
    bad.mkdir()
    for name in ("model.safetensors", "vocab.json", "merges.txt"):
        (bad / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["projection_dim"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="do not match its config.json.*wrong shape"):
        rewards.load_reward("clip_score", str(bad))


def test_pickle_is_refused_naming_the_converter(tmp_path, clip_folder):
    folder, _ = clip_folder
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((folder / "config.json").read_bytes())
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only PyTorch pickle weights.*model.safetensors"):
        rewards.load_reward("clip_score", str(pickled))
    (pickled / "reward_config.json").write_text(json.dumps({"reward": "hpsv2"}))
    with pytest.raises(ModelLoadError, match="pickle.*python -m tree_grpo_jax.rewards.convert"):
        rewards.load_reward("hpsv2", str(pickled))


def test_truncated_weights(tmp_path, clip_folder):
    folder, _ = clip_folder
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        (cut / name).write_bytes((folder / name).read_bytes())
    data = (folder / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="damaged or truncated"):
        rewards.load_reward("pickscore", str(cut))


@pytest.mark.slow
def test_training_on_a_weighted_mix_reports_every_eval_reward(tmp_path, clip_folder):
    """`rewards=pickscore:1,clip_score:0.5` trains on their weighted sum; eval lists more."""
    from small_configs import small_config

    from tree_grpo_jax.run import loop as train

    folder, _ = clip_folder
    aesthetic, *_ = _aesthetic_folder(tmp_path, clip_folder)
    c = small_config("treegrpo")
    c.train.iterations = 1
    c.eval.every = 0
    c.checkpoint.every = 0
    c.rewards = "pickscore:1,clip_score:0.5"
    c.reward_models.pickscore = str(folder)
    c.reward_models.clip_score = str(folder)
    c.reward_models.aesthetic = str(aesthetic)
    c.reward_options.chunk_size = 4
    c.eval.extra_rewards = ("aesthetic", "clip_score")
    train.train(c, str(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/reward_mean" in r][0]
    assert np.isclose(
        trained["train/reward_mean"],
        trained["train/reward_pickscore"] + 0.5 * trained["train/reward_clip_score"],
        rtol=1e-5,
    )
    evals = [r for r in rows if "eval/aesthetic" in r]
    assert len(evals) == 2 and all(np.isfinite(r["eval/clip_score"]) for r in evals)


@pytest.mark.slow
def test_fsdp_sharded_reward_scores_as_on_one_device(clip_folder):
    import os
    import subprocess
    import sys

    folder, _ = clip_folder
    script = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "scripts", "sharded_reward.py"
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, script, str(folder)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["sharded_leaves"] > result["leaves"] // 2
    assert result["max_abs_diff"] <= 1e-4
