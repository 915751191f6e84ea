"""Damaged input files give one sentence naming the file; export never writes its sources
and leaves nothing half-built."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import serialization

from tree_grpo_jax.cli import export
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.tiny.classifier import load_classifier
from tree_grpo_jax.models.tiny.weights import load_weights, weights_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GARBAGE = b"\xc1 this is not a weights file \x00\xff" * 8


def _run(module, *args):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def _listing(root):
    """Every path under `root` with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------------------------
# Weight files.


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_sd_safetensors_is_one_sentence(sd_folder, tmp_path, damage):
    from tree_grpo_jax.models.sd15.load import load_sd

    folder = shutil.copytree(sd_folder, tmp_path / "sd")
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else GARBAGE)
    with pytest.raises(ModelLoadError, match="is damaged or truncated") as info:
        load_sd(str(folder))
    message = str(info.value)
    assert str(weights) in message and "\n" not in message


def test_garbage_sd_flax_msgpack_is_one_sentence(sd_folder, tmp_path):
    from tree_grpo_jax.models.sd15.load import load_sd

    folder = shutil.copytree(sd_folder, tmp_path / "sd")
    weights = folder / "vae" / "diffusion_flax_model.msgpack"  # preferred over safetensors
    weights.write_bytes(GARBAGE)
    with pytest.raises(ModelLoadError, match="is damaged or truncated") as info:
        load_sd(str(folder))
    assert str(weights) in str(info.value)


def test_damaged_tiny_weights_and_classifier(tmp_path):
    truncated = tmp_path / "tiny_ddim.msgpack"
    data = weights_path("ddim").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="damaged or truncated") as info:
        load_weights(truncated, "ddim")
    assert str(truncated) in str(info.value) and "--kind=ddim" in str(info.value)

    garbage = tmp_path / "classifier.msgpack"
    garbage.write_bytes(GARBAGE)
    with pytest.raises(ModelLoadError, match="digit classifier file .* is damaged") as info:
        load_classifier(garbage)
    assert str(garbage) in str(info.value)

    not_a_dict = tmp_path / "list.msgpack"
    not_a_dict.write_bytes(serialization.msgpack_serialize([1, 2, 3]))
    with pytest.raises(ModelLoadError, match="is not a weights file"):
        load_weights(not_a_dict, "ddim")


# ---------------------------------------------------------------------------------------------
# Prompt files, through the real command line.


def test_non_utf8_prompt_file_is_one_sentence(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a cat\n\xff\xfe a dog\n")
    result = _run(
        "tree_grpo_jax.main",
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        f"--config.prompts.source={prompts}",
    )
    line = _one_error_line(result)
    assert str(prompts) in line and "not UTF-8" in line, line


@pytest.mark.parametrize(
    "name, text, settings, said",
    [
        ("p.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog",\n', (), "line 2 of prompt file"),
        ("p.csv", "text,kind\na cat,x\n", (), "(its columns: 'text', 'kind')"),
        ("p.jsonl", '{"prompt": "a cat"}\n', ("field=prompt", "category_field=prompt"), "both"),
    ],
    ids=["malformed json line", "csv without the column", "one name for both"],
)
def test_bad_prompt_file_is_one_sentence_before_anything_is_written(
    tmp_path, name, text, settings, said
):
    prompts = tmp_path / name
    prompts.write_text(text)
    result = _run(
        "tree_grpo_jax.main",
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        f"--config.prompts.source={prompts}",
        *(f"--config.prompts.{s}" for s in settings),
    )
    line = _one_error_line(result)
    assert said in line, line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Export.


def test_export_from_a_missing_workdir_creates_nothing(tmp_path):
    run, out = tmp_path / "no" / "such" / "run", tmp_path / "out"
    result = _run("tree_grpo_jax.export", f"--workdir={run}", f"--out={out}")
    line = _one_error_line(result)
    assert "there is no training run" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def broken_params(sd_model):
    params = dict(jax.device_get(sd_model.params))
    del params["conv_in"]
    params["conv_out"] = dict(params["conv_out"])
    params["conv_out"]["bias"] = np.zeros(3, np.float32)
    return params


def test_export_with_mismatched_params_leaves_no_folder(sd_folder, broken_params, tmp_path, capsys):
    params_file = tmp_path / "params.msgpack"
    params_file.write_bytes(serialization.to_bytes({"params": broken_params}))
    out = tmp_path / "new" / "export"
    argv = [f"--params={params_file}", f"--model_path={sd_folder}", f"--out={out}"]
    before = _listing(sd_folder)
    assert export.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the params do not fit") and "\n" not in err
    assert "missing conv_in/bias" in err and "conv_out/bias" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.msgpack"]
    # An existing export is not replaced by a failing one, even with --overwrite.
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("earlier export")
    assert export.main(argv + ["--overwrite"]) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]
    assert (out / "keep.txt").read_text() == "earlier export"
    assert _listing(sd_folder) == before


def test_export_rejects_garbage_params_and_overlapping_folders(
    sd_folder, sd_model, tmp_path, capsys
):
    garbage = tmp_path / "garbage.msgpack"
    garbage.write_bytes(GARBAGE)
    out = tmp_path / "out"
    assert export.main([f"--params={garbage}", f"--model_path={sd_folder}", f"--out={out}"]) == 2
    assert "is damaged, truncated or not Flax msgpack" in capsys.readouterr().err
    # --out around the params file would delete it with --overwrite.
    params = tmp_path / "params.msgpack"
    params.write_bytes(serialization.to_bytes(jax.device_get(sd_model.params)))
    argv = [f"--params={params}", f"--model_path={sd_folder}", f"--out={tmp_path}"]
    assert export.main(argv + ["--overwrite"]) == 2
    assert "must be neither inside nor around" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.msgpack", "params.msgpack"]


def test_export_from_a_run_reads_it_without_writing(sd_folder, sd_model, tmp_path, capsys):
    from tree_grpo_jax.run.checkpoint import Checkpointer

    run = tmp_path / "run"
    ckpt = Checkpointer(str(run / "checkpoints"))
    ckpt.save(4, {"params": jax.device_get(sd_model.params)}, {"step": 4})
    config = {"model": {"name": "sd", "path": str(sd_folder)}}
    (run / "config.json").write_text(json.dumps(config))
    before = _listing(run)
    out = tmp_path / "out"
    assert export.main([f"--workdir={run}", f"--out={out}"]) == 0, capsys.readouterr().err
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert _listing(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    # A run that did not train SD from a folder: one sentence, nothing written.
    (run / "config.json").write_text(json.dumps({"model": {"name": "tiny", "path": ""}}))
    before = _listing(run)
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'out2'}"]) == 2
    assert "did not train a model from a pipeline folder" in capsys.readouterr().err
    assert _listing(run) == before and not (tmp_path / "out2").exists()
