"""`python -m tree_grpo_jax.sample` on a run trained for one iteration: it draws the run's own
eval pictures bit for bit, the same arguments draw the same bytes, a damaged newest
checkpoint is passed over and named, and bad input is one `error:` line, exit status 2,
nothing written."""

import json
import os
import shutil
import signal

import pytest
from PIL import Image
from signalled import run_ending, run_script
from small_configs import small_config

from tree_grpo_jax.cli import sample
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.evaluation import Evaluator

DIGITS = ("zero", "one", "two", "three")  # the run's eval prompts, "a handwritten digit ..."


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """test_train's small grpo run (its programs come from the session's compile cache), one
    iteration: evaluations at steps 0 and 1, checkpoint 1."""
    c = small_config("grpo")
    c.train.iterations = 1
    c.eval.every = 0
    workdir = tmp_path_factory.mktemp("sampled") / "run"
    train.train(c, str(workdir))
    return workdir


@pytest.fixture(scope="module")
def picture_size(run):
    from tree_grpo_jax.models import registry

    model = registry.load_model(small_config("grpo").model)
    height, width = model.decode(_zeros(model.sample_shape)).shape[1:3]
    return width, height


def _zeros(shape):
    import numpy as np

    return np.zeros((1, *shape), np.float32)


def _listing(folder):
    return sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for root, dirs, files in os.walk(folder)
        for name in dirs + files
    )


def test_the_runs_eval_pictures_bit_for_bit(run, picture_size, tmp_path, capsys):
    out = tmp_path / "pictures"
    assert sample.main([f"--workdir={run}", f"--out={out}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    names = sorted(p.name for p in out.iterdir())
    # the run's 4 eval prompts (prompts.eval_count), one picture each, and the grid
    assert names == [
        "000_a_handwritten_digit_zero.png",
        "001_a_handwritten_digit_one.png",
        "002_a_handwritten_digit_two.png",
        "003_a_handwritten_digit_three.png",
        "grid.png",
    ]
    assert printed[0].startswith(f"checkpoint 1 of {run}: 4 prompts, deterministic sampler")
    assert printed[-5:] == [str(out / name) for name in names]
    assert all(Image.open(out / n).size == picture_size for n in names[:-1])
    # the same sampler, prompts, noise and weights as the run's evaluation after iteration 1
    assert (out / "grid.png").read_bytes() == (run / "eval_00001.png").read_bytes()


def test_a_prompt_file_twice_with_a_seed_gives_the_same_bytes(run, picture_size, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a thick handwritten digit seven\n\na thin handwritten digit one\n")
    args = [f"--workdir={run}", f"--prompts={prompts}", "--num_steps=3"]
    drawn = {}
    for seed, out in (("7", None), ("7", tmp_path / "again"), ("8", tmp_path / "other")):
        where = [] if out is None else [f"--out={out}"]
        assert sample.main([*args, f"--seed={seed}", *where]) == 0
        folder = out or run / "samples" / "step_1"  # the default --out
        drawn[out] = {p.name: p.read_bytes() for p in folder.iterdir()}
    first = drawn[None]
    assert sorted(first) == [
        "000_a_thick_handwritten_digit_seven.png",
        "001_a_thin_handwritten_digit_one.png",
        "grid.png",
    ]
    pictures = [run / "samples" / "step_1" / n for n in first if n != "grid.png"]
    assert all(Image.open(p).size == picture_size for p in pictures)
    assert drawn[tmp_path / "again"] == first
    assert (
        drawn[tmp_path / "other"]["000_a_thick_handwritten_digit_seven.png"]
        != (first["000_a_thick_handwritten_digit_seven.png"])
    )


def _damage(step_dir):
    """Every file of a checkpoint cut to half its length."""
    for path in step_dir.rglob("*"):
        if path.is_file():
            os.truncate(path, path.stat().st_size // 2)


def test_a_damaged_newest_checkpoint_is_passed_over_and_named(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("samples"))
    shutil.copytree(copy / "checkpoints" / "1", copy / "checkpoints" / "2")
    _damage(copy / "checkpoints" / "2")
    out = tmp_path / "pictures"
    assert sample.main([f"--workdir={copy}", f"--out={out}", "--prompts=digits"]) == 0
    captured = capsys.readouterr()
    first = captured.out.splitlines()[0]
    assert first.startswith(
        f"checkpoint 1 of {copy}, instead of the newest, checkpoint 2, which cannot be read ("
    )
    assert "10 prompts" in first and len(list(out.iterdir())) == 11
    warnings = captured.err.splitlines()
    assert warnings and all(w.startswith("warning: checkpoint 2 ") for w in warnings)
    assert sorted(os.listdir(copy / "checkpoints")) == ["1", "2"]  # read-only: nothing renamed


def _image_prompts(folder) -> str:
    """A prompt file of the tiny model's digits whose row names an image beside it."""
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 0, 0)).save(folder / "start.png")
    path = folder / "edits.jsonl"
    path.write_text(json.dumps({"prompt": "a handwritten digit one", "image": "start.png"}) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no run", "there is no run folder"),
        ("no checkpoint", "there is no checkpoint in"),
        ("unreadable", "no checkpoint in"),
        ("no such step", "there is no checkpoint 7 in"),
        ("unreadable prompt", "the model cannot read a prompt: prompt 'a b c d e f g h' has 8"),
        ("no such prompt set", "is neither a built-in prompt set"),
        ("unwritable out", "cannot write to the output folder"),
        ("model path of a built-in model", "--model_path changes nothing here: the run's "),
        # the flag typed, not the config field it sets (eval.num_steps)
        ("too many steps", "error: --num_steps must be in [1, 999], got 1000."),
        ("absurd steps", "error: --num_steps must be in [2, 10,000], got 1,000,000,000."),
        # config.json edited by hand (before: an AttributeError or TypeError traceback)
        (
            "section a value",
            "config.json is not a run's config as training writes it: its 'eval' is",
        ),
        ("field of another type", "config.json is not a run's config as training writes it (Type"),
        # images that the tiny model cannot condition on, and no reward reads while drawing
        ("image prompts", "--prompts names input images, but model 'tiny-ddim-random' takes none"),
    ],
)
def test_bad_input_is_one_error_line_and_writes_nothing(run, tmp_path, capsys, case, message):
    workdir = run
    edits = {
        "section a value": ("eval", "x"),
        "field of another type": ("prompts", {"eval_count": "ten"}),
    }
    if case in ("no checkpoint", "unreadable", *edits):
        workdir = tmp_path / "copy"
        shutil.copytree(run, workdir, ignore=shutil.ignore_patterns("samples"))
        if case in edits:
            saved = json.loads((workdir / "config.json").read_text())
            section, value = edits[case]
            saved[section] = {**saved[section], **value} if isinstance(value, dict) else value
            (workdir / "config.json").write_text(json.dumps(saved))
        elif case == "no checkpoint":
            shutil.rmtree(workdir / "checkpoints" / "1")
        else:
            _damage(workdir / "checkpoints" / "1")
    in_the_way = tmp_path / "file"
    in_the_way.write_text("x")
    out = tmp_path / "out"
    args = {
        "no run": [f"--workdir={tmp_path / 'nope'}"],
        "no such step": ["--step=7"],
        "unreadable prompt": ["--prompt=a b c d e f g h"],
        "no such prompt set": ["--prompts=no_such_set"],
        "unwritable out": [f"--out={in_the_way / 'pictures'}"],
        "model path of a built-in model": [f"--model_path={tmp_path}"],
        "too many steps": ["--num_steps=1000"],  # the first timestep would be 1000 of 0..999
        "absurd steps": [f"--num_steps={10**9}"],  # any model's, before its schedule is made
        "image prompts": [f"--prompts={_image_prompts(tmp_path)}"],
    }.get(case, [])
    if not any(a.startswith("--workdir") for a in args):
        args.append(f"--workdir={workdir}")
    if case != "unwritable out":
        args.append(f"--out={out}")
    before = _listing(workdir) if os.path.isdir(workdir) else None
    code = sample.main(args)
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert message in errors[0] and all(line.startswith(("error: ", "warning: ")) for line in err)
    assert "eval." not in errors[0] and "--config." not in errors[0], errors[0]
    assert not out.exists() and not (in_the_way.parent / "pictures").exists()
    if before is not None:
        assert _listing(workdir) == before


SIGNAL_IN_THE_WRITE = """
import sys
import numpy as np
from tree_grpo_jax import interrupts
from tree_grpo_jax.cli import sample

interrupts.install()
interrupts.set_stop_line(lambda name: f"{name} stopped the sampling; nothing was written.")
sample._write_all = signalled(sample._write_all)  # arrives while the pictures are written
sample._write(sys.argv[1], ["a 0", "a 1"], np.zeros((2, 8, 8, 1), np.uint8))
print("the write returned", flush=True)
"""


def test_a_signal_in_the_write_waits_for_the_pictures_and_says_so(tmp_path):
    out = tmp_path / "pictures"
    result = run_script(SIGNAL_IN_THE_WRITE, str(out))
    assert result.returncode == 143, result.stderr[-2000:]
    assert f"error: SIGTERM stopped the sampling; its pictures are written in {out}." in (
        result.stderr
    )
    assert "the write returned" not in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["000_a_0.png", "001_a_1.png", "grid.png"]


def test_a_missing_model_path_is_named_by_the_flag_typed(run, tmp_path, capsys):
    """The run is an SD1.5 one as far as its config.json says, so `--model_path` matters:
    the loader's sentence about the folder names `--model_path`, not training's flag."""
    workdir = tmp_path / "sd_run"
    shutil.copytree(run, workdir, ignore=shutil.ignore_patterns("samples"))
    saved = json.loads((workdir / "config.json").read_text())
    saved["model"]["name"] = "sd"
    (workdir / "config.json").write_text(json.dumps(saved))
    missing = tmp_path / "no_such_sd15"
    before = _listing(workdir)
    code = sample.main([f"--workdir={workdir}", f"--model_path={missing}", "--prompt=a 1"])
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert str(missing) in errors[0] and "--model_path" in errors[0], errors[0]
    assert "--config." not in errors[0], errors[0]
    assert _listing(workdir) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, signum", [("in the teardown", signal.SIGTERM), ("in an exit handler", signal.SIGINT)]
)
def test_a_signal_after_the_last_line_is_said_or_finds_the_process_gone(
    run, tmp_path, where, signum
):
    """A signal once every picture is written and printed, as the process exits: in an exit
    handler, the line that says the pictures are written, exit 130; Python's teardown (a
    second or more of freeing JAX, where a signal used to kill the process without a line)
    is never reached: the process has ended, exit 0."""
    out = tmp_path / "pictures"
    result = run_ending("tree_grpo_jax.sample", where, signum, f"--workdir={run}", f"--out={out}")
    names = sorted(p.name for p in out.iterdir())  # every picture whole, nothing staged left
    assert names == [f"{i:03d}_a_handwritten_digit_{d}.png" for i, d in enumerate(DIGITS)] + [
        "grid.png"
    ]
    printed = [line for line in result.stdout.splitlines() if line.startswith(str(out))]
    assert printed == [str(out / name) for name in names]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if where == "in the teardown":
        assert result.returncode == 0 and not errors, result.stderr[-2000:]
        assert "sending" not in result.stdout  # the teardown, where it is sent, never came
    else:
        assert result.returncode == 130, result.stderr[-2000:]
        assert errors == [f"error: SIGINT stopped the sampling; its pictures are written in {out}."]


def test_a_failed_write_leaves_the_earlier_pictures_as_they_were(
    run, tmp_path, monkeypatch, capsys
):
    """A second sampling into the same folder whose write fails (the disk full at the grid):
    one line, and the first sampling's pictures stay, byte for byte, none half-written."""
    from tree_grpo_jax.run import reporting

    out = tmp_path / "pictures"
    assert sample.main([f"--workdir={run}", f"--out={out}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(path, *args, **kwargs):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(reporting, "save_grid", full)
    capsys.readouterr()
    assert sample.main([f"--workdir={run}", f"--out={out}", "--seed=7"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_of_memory_names_the_batch_flag(run, tmp_path, monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED while drawing: one line naming --batch_size with the batch
    drawn, exit 1, nothing written."""
    import jax

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3.1GiB.")

    monkeypatch.setattr(Evaluator, "batch", exhausted)
    out = tmp_path / "pictures"
    assert sample.main([f"--workdir={run}", f"--out={out}", "--batch_size=3"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "error: the device ran out of memory (3.1GiB) drawing 3 prompt(s) at once; lower "
        "--batch_size (now 3)."
    ), err
    assert "Traceback" not in err and not out.exists()
