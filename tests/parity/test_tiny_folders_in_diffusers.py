"""The folders launch/tiny_folders.py writes without torch are what diffusers and transformers
read: every component loads in its PyTorch class with no missing, unexpected or mis-shaped
key, with the architecture of the torch-built test fixtures, and the new conversion paths
(the CLIP towers, the VAE's renamed attention, T5) compute what our Flax loaders compute."""

import numpy as np
import pytest

from launch import tiny_folders

torch = pytest.importorskip("torch")

KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys")
# Config fields that say how a file was saved, not what it holds.
NOT_ARCHITECTURE = ("dtype", "torch_dtype")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_written")
    # The Wan folder is checked against its own fixture in tests/parity/test_wan_pipeline.py.
    return tiny_folders.main([f"--out={out}", "--kinds=sd15,sd35,flux"])


def _classes():
    import diffusers
    import transformers

    def cls(entry):
        library, name = entry
        return getattr(diffusers if library == "diffusers" else transformers, name)

    return cls


def _architecture(config) -> dict:
    config = dict(config) if isinstance(config, dict) else config.to_dict()
    return {
        k: v
        for k, v in config.items()
        if not k.startswith("_") and k not in NOT_ARCHITECTURE and "version" not in k
    }


@pytest.mark.parametrize("kind", ["sd15", "sd35", "flux"])
def test_every_component_loads_in_its_pytorch_class(kind, written, request):
    import json

    fixture = request.getfixturevalue(
        {"sd15": "sd_folder", "sd35": "sd3_folder"}.get(kind, "flux_folder")
    )
    folder = written[kind]
    index = json.loads((folder / "model_index.json").read_text())
    assert index == {
        **json.loads((fixture / "model_index.json").read_text()),
        "_diffusers_version": index["_diffusers_version"],
    }
    cls = _classes()
    checked = 0
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        klass = cls(entry)
        if name.startswith(("tokenizer", "scheduler")):
            ours, theirs = (
                klass.from_pretrained(folder / name),
                klass.from_pretrained(fixture / name),
            )
            if name == "scheduler":
                assert _architecture(ours.config) == _architecture(theirs.config)
            else:
                prompt = "a photo of a cat dog"
                assert ours(prompt).input_ids == theirs(prompt).input_ids
                assert ours.model_max_length == theirs.model_max_length
            checked += 1
            continue
        model, info = klass.from_pretrained(folder / name, output_loading_info=True)
        assert not any(info[k] for k in KEYS), (name, info)
        reference = klass.from_pretrained(fixture / name)
        assert _architecture(model.config) == _architecture(reference.config), name
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
        assert ours == theirs, name
        checked += 1
    assert checked == len([e for e in index.values() if isinstance(e, list) and e[0]])


def test_sd15_text_encoder_and_vae_compute_what_our_loader_computes(written):
    """The CLIP tower (transformers' names, no index merging) and the VAE (new attention
    names) are written by paths the denoiser export does not take: run them both ways."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    from tree_grpo_jax.models.sd15.load import load_sd

    folder = written["sd15"]
    model = load_sd(str(folder))
    prompts = ["a photo of a cat", "a dog"]
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, return_tensors="pt")
    with torch.no_grad():
        text = CLIPTextModel.from_pretrained(folder / "text_encoder").eval()
        theirs = text(ids.input_ids).last_hidden_state.numpy()
    ours = np.asarray(model.encode_prompts(prompts))
    assert np.abs(theirs[0] - theirs[1]).max() > 0.1  # the prompts give different outputs
    np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)

    latents = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    vae = AutoencoderKL.from_pretrained(folder / "vae").eval()
    with torch.no_grad():
        image = vae.decode(torch.from_numpy(latents) / vae.config.scaling_factor).sample
    theirs = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert np.abs(theirs[0] - theirs[1]).max() > 0.05
    np.testing.assert_allclose(np.asarray(model.decode(latents)), theirs, atol=2e-5, rtol=0)


def test_t5_computes_what_our_loader_computes(written):
    from transformers import T5EncoderModel, T5TokenizerFast

    from tree_grpo_jax.models.text_encoders import load_t5

    root = written["flux"]
    ours = load_t5(root, "text_encoder_2", "tokenizer_2", np.float32, "x", max_length=8, width=32)
    tok = T5TokenizerFast.from_pretrained(root / "tokenizer_2")
    prompts = ["a photo of a cat", "a dog"]
    ids = tok(prompts, padding="max_length", max_length=8, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = T5EncoderModel.from_pretrained(root / "text_encoder_2").eval()(ids)
    theirs = theirs.last_hidden_state.numpy()
    mine = np.asarray(ours.run(ours.params, ids.numpy()))
    assert np.abs(theirs[0] - theirs[1]).max() > 0.01
    np.testing.assert_allclose(mine, theirs, atol=2e-5, rtol=0)
