"""A resume checks what the config points at, not only the config: the training prompts in
order and the files of the frozen model parts and reward models."""

import os
import shutil
import time

import pytest
from in_process import one_error_line, run_main

from tree_grpo_jax.models.tiny.grammar import DIGIT_PROMPTS
from tree_grpo_jax.run import identity


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "file_digests.json"
    monkeypatch.setenv(identity.ENV_CACHE, str(path))
    return path


def _snapshot(folder):
    """Every file below `folder` with its size and mtime."""
    found = {}
    for here, _, names in os.walk(folder):
        for name in names:
            st = os.stat(os.path.join(here, name))
            found[os.path.relpath(os.path.join(here, name), folder)] = (st.st_size, st.st_mtime_ns)
    return found


def _write_old(path, data: bytes, age_s: float = 60.0):
    """Writes `data` with an mtime `age_s` in the past (older than the racy window)."""
    path.write_bytes(data)
    then = time.time() - age_s
    os.utime(path, (then, then))


@pytest.mark.slow
def test_reordered_prompt_file_refuses_the_resume_and_the_original_resumes(tmp_path):
    prompts = tmp_path / "digits.txt"
    prompts.write_text("\n".join(DIGIT_PROMPTS) + "\n")
    workdir = tmp_path / "run"
    common = (
        "--config=configs/tiny.py",
        f"--config.prompts.source={prompts}",
        f"--workdir={workdir}",
        "--config.eval.every=0",
        "--config.checkpoint.every=1",
        "--config.log.tensorboard=False",
        # as small as the tiny model goes: its compiles are most of the test's time
        "--config.model.name=random_tiny",
        "--config.sampling.num_steps=2",
        "--config.tree.window=1",
        "--config.prompts.batch_size=1",
        "--config.prompts.eval_count=1",
        "--config.eval.extra_rewards=()",
        "--config.train.rows_per_minibatch=2",
    )
    first = run_main(*common, "--config.train.iterations=1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _snapshot(workdir)
    steps = sorted(os.listdir(workdir / "checkpoints"))

    prompts.write_text("\n".join(reversed(DIGIT_PROMPTS)) + "\n")
    refused = run_main(*common, "--config.train.iterations=2")
    line = one_error_line(refused)
    assert f"prompts.source {str(prompts)!r} changed" in line, line
    assert "same count, other content or order" in line, line
    assert _snapshot(workdir) == before
    assert sorted(os.listdir(workdir / "checkpoints")) == steps

    prompts.write_text("\n".join(DIGIT_PROMPTS) + "\n")
    resumed = run_main(*common, "--config.train.iterations=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the checkpoint after iteration 1" in resumed.stdout


def test_file_digests_rehash_a_changed_file_and_remember_an_unchanged_one(
    tmp_path, monkeypatch, digest_cache
):
    calls = []
    hash_file = identity._hash_file
    monkeypatch.setattr(identity, "_hash_file", lambda p: calls.append(p) or hash_file(p))
    folder = tmp_path / "weights"
    folder.mkdir()
    _write_old(folder / "a.bin", b"aaaa")
    _write_old(folder / "b.bin", b"bbbb")
    files = identity.list_files(folder)

    digests = identity.FileDigests()
    first = {rel: digests.digest(path) for rel, path in files.items()}
    digests.save()
    assert len(calls) == 2 and digest_cache.is_file()

    _write_old(folder / "a.bin", b"AAAA", age_s=30.0)  # same size, other bytes and mtime
    calls.clear()
    digests = identity.FileDigests()  # a new process: what it knows comes from the file
    second = {rel: digests.digest(path) for rel, path in files.items()}
    assert calls == [str(folder / "a.bin")]
    assert second["b.bin"] == first["b.bin"] and second["a.bin"] != first["a.bin"]

    # a file modified just now is hashed every time: its mtime tick may not be over
    (folder / "c.bin").write_bytes(b"cccc")
    calls.clear()
    digests.digest(str(folder / "c.bin"))
    digests.digest(str(folder / "c.bin"))
    assert len(calls) == 2


def test_folder_digests_ignore_the_order_of_listing(tmp_path, monkeypatch):
    assert identity.folder_digest({"a": "1", "b/c": "2"}) == identity.folder_digest(
        {"b/c": "2", "a": "1"}
    )
    assert identity.folder_digest({"a": "1", "b/c": "2"}) != identity.folder_digest(
        {"a": "2", "b/c": "1"}
    )
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    for name in ("z.json", "a.json", "sub/m.txt", ".hidden"):
        (folder / name).write_text(name)
    listed = identity.list_files(folder)
    walk = os.walk

    def reversed_walk(top, **kwargs):
        for here, dirs, names in walk(top, **kwargs):
            dirs.reverse()
            yield here, dirs, names[::-1]

    monkeypatch.setattr(identity.os, "walk", reversed_walk)
    assert list(identity.list_files(folder)) == list(listed) == ["a.json", "sub/m.txt", "z.json"]


def _clip_config(folder):
    from configs import tiny

    config = tiny.get_config()
    config.rewards = "clip_score"
    config.reward_models.clip_score = str(folder)
    return config


def test_a_reward_folder_changed_in_place_is_named_with_its_file(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "config.json").write_text('{"projection_dim": 16}')
    _write_old(folder / "model.safetensors", b"\x00" * 64)
    config = _clip_config(folder)
    saved = identity.measure(config, say=print)
    assert identity.of_run(config) is saved  # what the checkpoints record: no second hash
    record = saved["folders"]["reward_models.clip_score"]
    assert set(record["files"]) == {"config.json", "model.safetensors"}
    assert identity.mismatch(saved, identity.measure(_clip_config(folder))) is None

    _write_old(folder / "model.safetensors", b"\x00" * 63 + b"\x01", age_s=30.0)
    line = identity.mismatch(saved, identity.measure(_clip_config(folder)))
    assert line.startswith(f"the files of reward_models.clip_score {str(folder)!r} changed"), line
    assert "(model.safetensors)" in line, line

    # the same weights at another place (reward_models may change on resume) are the same run
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    moved = shutil.copytree(folder, tmp_path / "moved")
    assert identity.mismatch(saved, identity.measure(_clip_config(moved))) is None

    hub = identity.measure(_clip_config("openai/clip-vit-base-patch32"))
    assert hub["folders"]["reward_models.clip_score"]["skipped"] == identity.NOT_LOCAL
    assert identity.mismatch(saved, hub) is None  # a hub id cannot be checked
    assert identity.mismatch(None, hub) is None  # checkpoints from before identities


def test_model_components_are_the_frozen_parts_only(tmp_path):
    from configs import sd15

    root = tmp_path / "sd"
    for component in ("unet", "text_encoder", "vae", "tokenizer", ".cache"):
        (root / component).mkdir(parents=True)
        (root / component / "config.json").write_text(component)
    (root / "vae" / "model.bin").symlink_to(tmp_path / "unfinished_download")
    config = sd15.get_config()
    config.model.path = str(root)
    full = identity.measure(config)["folders"]
    assert set(full) == {f"model.path/{c}" for c in ("text_encoder", "tokenizer", "vae")}
    assert full["model.path/vae"]["files"]["model.bin"].startswith("unreadable (")
    config.lora.rank = 4
    lora = identity.measure(config)
    assert "model.path/unet" in lora["folders"]  # the frozen base under LoRA

    (root / "text_encoder" / "config.json").write_text("other")
    line = identity.mismatch(lora, identity.measure(config))
    assert "model.path's text_encoder" in line and "(text_encoder/config.json)" in line, line
    shutil.rmtree(root / "vae")
    line = identity.mismatch(lora, identity.measure(config))
    assert f"the folders of model.path {str(root)!r} changed" in line and "vae/ gone" in line


def test_hashing_a_large_folder_says_so_once(tmp_path, monkeypatch):
    folder = tmp_path / "clip"
    folder.mkdir()
    _write_old(folder / "model.safetensors", b"\x00" * 2048)
    monkeypatch.setattr(identity, "ANNOUNCE_BYTES", 1024)
    said = []
    identity.measure(_clip_config(folder), say=said.append)
    identity.measure(_clip_config(folder), say=said.append)
    assert said == ["hashing the files of reward_models.clip_score (0.0 GB, once)..."]


def test_a_text_encoder_changed_under_a_full_fine_tuning_run_refuses_its_resume(
    tmp_path, sd_folder
):
    """Through the command line, on a run whose checkpoint was saved by the trainer's own
    pieces (no training needed: the check comes before any model loads)."""
    import numpy as np

    from configs import sd15
    from tree_grpo_jax.run import fingerprint as run_fingerprint
    from tree_grpo_jax.run.checkpoint import Checkpointer

    base = tmp_path / "sd15"
    shutil.copytree(sd_folder, base)
    config = sd15.get_config()
    config.model.path = str(base)
    meta = {
        "next_iteration": 1,
        "fingerprint": run_fingerprint.fingerprint(config),
        "identity": identity.measure(config, say=lambda line: None),
    }
    workdir = tmp_path / "run"
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    ckpt.save(1, {"params": {"w": np.zeros(3, np.float32)}}, meta)
    ckpt.close()
    before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    command = ("--config=configs/sd15.py", f"--config.model.path={base}", f"--workdir={workdir}")

    weights = next((base / "text_encoder").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(255 - b for b in data[-4:])  # same size, other bytes
    weights.write_bytes(bytes(data))
    line = one_error_line(run_main(*command))
    assert "model.path's text_encoder" in line and weights.name in line, line
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before
    # the UNet is what full fine-tuning trains: its base file may change. With the text
    # encoder restored the identity agrees, and the resume goes on to load the model and
    # meet the stand-in state saved above (so no training starts)
    unet = next((base / "unet").glob("*.safetensors"))
    unet_data = bytearray(unet.read_bytes())
    unet_data[-4:] = bytes(255 - b for b in unet_data[-4:])
    unet.write_bytes(bytes(unet_data))
    weights.write_bytes(bytes(data[:-4]) + bytes(255 - b for b in data[-4:]))  # restored
    line = one_error_line(run_main(*command))
    assert "changed since" not in line and "another training state" in line, line
