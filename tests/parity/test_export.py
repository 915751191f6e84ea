"""Export: UNet params loaded (and changed) by us are written as a diffusers folder that
PyTorch diffusers loads without missing keys and that computes what our Flax UNet computes."""

import json

import jax
import numpy as np
import pytest
from flax import serialization
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file

from tree_grpo_jax.cli import export
from tree_grpo_jax.models.sd15.export import export_pipeline, export_unet
from tree_grpo_jax.models.sd15.load import load_sd

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folder(sd_folder):
    return sd_folder


@pytest.fixture(scope="module")
def model(sd_model):
    return sd_model


@pytest.fixture(scope="module")
def trained(sd_model):
    """Params that differ from the folder's, as after training."""
    rng = np.random.default_rng(7)
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x) + np.float32(0.01) * rng.standard_normal(x.shape, np.float32),
        sd_model.params,
    )


def _torch_unet(path):
    from diffusers import UNet2DConditionModel

    unet, info = UNet2DConditionModel.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return unet.eval()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    cond = rng.standard_normal((2, 16, 32)).astype(np.float32)
    return x, np.array([3, 777], np.int32), cond


def _run_torch(unet, x, t, cond):
    with torch.no_grad():
        return unet(
            torch.from_numpy(x), torch.from_numpy(t).long(), torch.from_numpy(cond)
        ).sample.numpy()


def test_unchanged_params_export_to_the_original_torch_unet(model, folder, tmp_path):
    unet_dir = export_unet(model.params, model.unet_config, tmp_path)
    assert sorted(p.name for p in unet_dir.iterdir()) == [
        "config.json",
        "diffusion_flax_model.msgpack",
        "diffusion_pytorch_model.safetensors",
    ]
    exported = _torch_unet(unet_dir).state_dict()
    original = _torch_unet(folder / "unet").state_dict()
    assert set(exported) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


def test_trained_params_compute_the_same_in_torch(model, trained, tmp_path):
    unet_dir = export_unet(trained, model.unet_config, tmp_path)
    x, t, cond = _inputs()
    ours = np.asarray(jax.jit(model.denoise)(trained, x, t, cond))
    theirs = _run_torch(_torch_unet(unet_dir), x, t, cond)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # The Flax file holds the same tensors.
    restored = serialization.msgpack_restore(
        (unet_dir / "diffusion_flax_model.msgpack").read_bytes()
    )
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, jax.device_get(trained))


def test_float16_export(model, tmp_path):
    unet_dir = export_unet(model.params, model.unet_config, tmp_path, "float16")
    tensors = load_file(unet_dir / "diffusion_pytorch_model.safetensors")
    assert {v.dtype for v in tensors.values()} == {np.dtype(np.float16)}
    _torch_unet(unet_dir)


def test_mismatched_params_are_named(model, tmp_path):
    params = dict(model.params)
    del params["conv_in"]
    with pytest.raises(ValueError, match="missing conv_in/bias, conv_in/kernel"):
        export_unet(params, model.unet_config, tmp_path)


def test_pipeline_export_via_cli(folder, model, trained, tmp_path):
    params_file = tmp_path / "params.msgpack"
    params_file.write_bytes(serialization.to_bytes({"params": jax.device_get(trained)}))
    out = tmp_path / "exported"
    argv = [f"--params={params_file}", f"--model_path={folder}", f"--out={out}"]
    assert export.main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    assert json.loads((out / "unet" / "config.json").read_text())["_class_name"] == (
        "UNet2DConditionModel"
    )
    # Our loader reads the result back (from its Flax file) with the trained params.
    reloaded = load_sd(str(out))
    for key, value in flatten_dict(jax.device_get(trained)).items():
        np.testing.assert_array_equal(flatten_dict(reloaded.params)[key], value)
    # A second export into the same folder needs --overwrite.
    assert export.main(argv) == 2
    assert export.main(argv + ["--overwrite"]) == 0


def test_whole_pipeline_loads_in_torch(folder, model, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = export_pipeline(model.params, str(folder), tmp_path / "pipe")
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"


def test_cli_errors_are_one_line(folder, tmp_path, capsys):
    code = export.main(
        [
            f"--params={tmp_path / 'none.msgpack'}",
            f"--model_path={folder}",
            f"--out={tmp_path / 'o'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "does not exist" in err
    code = export.main(
        [f"--params={tmp_path / 'none.msgpack'}", f"--model_path={folder}", f"--out={folder / 'x'}"]
    )
    assert code == 2


def test_params_from_an_orbax_folder(model, tmp_path):
    import orbax.checkpoint as ocp

    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(str(path), {"params": jax.device_get(model.params), "step": 3})
    restored = export.load_params(path)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, jax.device_get(model.params))
