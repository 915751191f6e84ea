"""launch/tiny_folders.py writes the weights-free SD1.5, SD3.5 and FLUX folders with torch
blocked, and the project's loaders read them and run (tests/parity/test_tiny_folders_in_diffusers.py
checks that diffusers' and transformers' PyTorch classes read the same folders; the Wan folder
is tests/integration/test_wan.py's and tests/parity/test_wan_pipeline.py's)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch import tiny_folders

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_folders_are_written_and_loaded_without_torch(tmp_path):
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.argv = ["tiny_folders.py", "--out={tmp_path}", "--kinds=sd15,sd35,flux"]
        runpy.run_path({str(ROOT / "launch" / "tiny_folders.py")!r}, run_name="__main__")
        import jax
        import numpy as np
        from tree_grpo_jax.models.flux.load import load_flux
        from tree_grpo_jax.models.sd15.load import load_sd
        from tree_grpo_jax.models.sd3.load import load_sd3
        for kind, load in (("sd15", load_sd), ("sd35", load_sd3), ("flux", load_flux)):
            m = load({str(tmp_path)!r} + "/" + kind)
            if m.prepare_prompts is not None:  # the flow families encode ahead
                m.prepare_prompts(["a photo of a cat"])
            cond = m.encode_prompts(["a photo of a cat"])
            x = np.random.default_rng(0).standard_normal((1, *m.sample_shape), np.float32)
            out = np.asarray(jax.jit(m.denoise)(m.params, x, np.array([500]), cond))
            image = np.asarray(m.decode(x))
            assert out.shape == x.shape and np.isfinite(out).all() and out.std() > 0, kind
            assert np.isfinite(image).all() and image.std() > 0, kind
            print(kind, "ok", flush=True)
        assert sys.modules["torch"] is None
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for kind in ("sd15", "sd35", "flux"):
        assert f"{kind}: {tmp_path / kind} (" in run.stdout
        assert f"{kind} ok" in run.stdout
    # A second run refuses the folders it wrote, before writing anything.
    again = subprocess.run(
        [sys.executable, "launch/tiny_folders.py", f"--out={tmp_path}", "--kinds=flux"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 2
    assert "exists and is not empty; --force replaces it" in again.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--kinds="],
            "error: --kinds names no kind; choose from sd15, sd35, flux, wan, zimage, qwenimage, "
            "flux2, flux2-klein, wan22, wan22-moe.",
        ),
        (["--kinds=sd15,sdxl"], "error: unknown kind(s) ['sdxl']; choose from sd15, sd35,"),
        (["--out={file}"], "error: --out {file} is a file, not a folder; pass a folder."),
        (["--out={tmp}", "--kinds=sd15"], "error: {tmp}/sd15 exists and is not empty; --force"),
        (["--seed=x"], "error: argument --seed: invalid int value: 'x' (see launch/tiny_folders"),
        (["--kind=sd15"], "error: unrecognized arguments: --kind=sd15 (see launch/tiny_folders"),
    ],
)
def test_a_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    file = tmp_path / "a_file"
    file.write_text("x")
    (tmp_path / "sd15").mkdir()
    (tmp_path / "sd15" / "keep").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = [a.format(file=file, tmp=tmp_path) for a in args]
    if not any(a.startswith("--out") for a in args):
        args.append(f"--out={tmp_path / 'new'}")
    with pytest.raises(SystemExit) as stopped:
        tiny_folders.main(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(file=file, tmp=tmp_path)), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_keeps_the_whole_folders_and_removes_the_half_one(tmp_path, signal_name):
    import signal

    out = tmp_path / "tiny"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "tiny_folders.py"), f"--out={out}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline()  # "sd15: <folder> (...)": the first folder is in place
    assert first.startswith("sd15: "), first
    proc.send_signal(getattr(signal, signal_name))  # while the SD3.5 folder is being built
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == {"SIGINT": 130, "SIGTERM": 143}[signal_name], stderr
    assert stderr.splitlines()[-1] == (
        f"error: {signal_name} stopped launch/tiny_folders.py; the folders it listed are whole."
    )
    assert sorted(p.name for p in out.iterdir()) == ["sd15"]  # no half-built folder beside it
    assert (out / "sd15" / "model_index.json").is_file()
