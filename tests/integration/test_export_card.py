"""Exporting a run: the model card says what was trained, every file gets the modes a new
file gets (not the base folder's), `--link_base` links the unchanged components into the
base folder and diffusers still loads the result, and the line that names the exported
checkpoint says which one was exported instead of a damaged newest and why, with nothing
but warnings on stderr.

The runs are written as training writes them (config.json from the SD config, orbax
checkpoints of the params, metrics.jsonl rows), without training."""

import gc
import os
import shutil
import signal
import sys

import jax
import numpy as np
import pytest
from signalled import run_ending

from configs import sd15
from tree_grpo_jax import lora
from tree_grpo_jax.cli import export
from tree_grpo_jax.run import identity, reporting
from tree_grpo_jax.run.checkpoint import Checkpointer

pytest.importorskip("torch")

EVALS = {0: -0.9, 1: -0.7, 2: -0.5}  # eval/reward_mean after each iteration


@pytest.fixture(scope="module")
def base(sd_folder, tmp_path_factory):
    """The tiny SD folder as a private one would be: a 0700 component, a 0600 file, a
    read-only model_index.json, and a model card of its own."""
    folder = tmp_path_factory.mktemp("private") / "base"
    shutil.copytree(sd_folder, folder)
    (folder / "README.md").write_text("the base model's own card\n")
    os.chmod(folder / "vae", 0o700)
    os.chmod(folder / "scheduler" / "scheduler_config.json", 0o600)
    os.chmod(folder / "model_index.json", 0o444)
    return folder


def _write_run(workdir, base, params: dict, lora_rank: int = 0):
    """A run of configs/sd15.py on `base` whose checkpoint `step` holds `params[step]`."""
    c = sd15.get_config()
    c.model.path = str(base)
    c.train.iterations = 2
    c.lora.rank, c.lora.alpha = lora_rank, 2.0 * lora_rank
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(c.to_json_best_effort(indent=2))
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    trained_on = identity.measure(c, say=lambda line: None)
    for step, p in params.items():
        ckpt.save(step, {"params": p}, {"next_iteration": step, "identity": trained_on})
    ckpt.close()
    writer = reporting.MetricsWriter(str(workdir), tensorboard=False)
    for step, reward in EVALS.items():
        writer.write(step, {"reward_mean": reward, "reward_std": 0.01}, prefix="eval/")
    writer.close()
    return workdir


def _moved(params, noise, scale: float):
    return jax.tree_util.tree_map(lambda x, n: np.asarray(x) + scale * n, params, noise)


@pytest.fixture(scope="module")
def full_run(base, sd_model, tmp_path_factory):
    rng = np.random.default_rng(0)
    draw = lambda x: rng.standard_normal(x.shape, np.float32)  # noqa: E731
    noise = jax.tree_util.tree_map(draw, sd_model.params)
    params = {step: _moved(sd_model.params, noise, 0.01 * step) for step in (1, 2)}
    return _write_run(tmp_path_factory.mktemp("full") / "run", base, params)


@pytest.fixture(scope="module")
def lora_run(base, sd_model, tmp_path_factory):
    targets = lora.target_paths(sd_model.params, ("to_q", "to_v"))
    factors = lora.init_lora(jax.random.PRNGKey(0), sd_model.params, targets, 2)
    return _write_run(tmp_path_factory.mktemp("lora") / "run", base, {2: factors}, lora_rank=2)


def _modes(folder):
    """(path, mode) of the folder and of everything in it that is not a link."""
    found = [(str(folder), os.stat(folder).st_mode)]
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                found.append((path, os.lstat(path).st_mode))
    return found


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_card_says_what_was_trained_and_files_get_new_file_modes(
    full_run, base, tmp_path, capsys
):
    out = tmp_path / "exported"
    assert export.main([f"--workdir={full_run}", f"--out={out}"]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [f"exported checkpoint 2 of {full_run} to {out}"]
    assert printed.err == ""
    card = (out / "README.md").read_text()
    for row in (
        f"| base model | `{base}` |",
        "| method | treegrpo |",
        "| reward | `jpeg_compressibility` |",
        "| iterations done | 2 of 2 |",
        "| weights | full fine-tuning",
        "| eval reward | -0.5 ± 0.01 after 2 iterations (-0.9 before training) |",
        f"| checkpoint exported | 2 (of `{full_run}`) |",
        f"| base components | copied from `{base}` |",
        f'DiffusionPipeline.from_pretrained("{out}")',
    ):
        assert row in card, row
    assert (base / "README.md").read_text() == "the base model's own card\n"
    # the base's 0700 folder, 0600 and 0444 files are copied as new ones: 0755 and 0644
    mask = _umask()
    for path, mode in _modes(out):
        want = (0o777 if os.path.isdir(path) else 0o666) & ~mask
        assert mode & 0o777 == want, (path, oct(mode))


def test_link_base_links_all_but_the_denoiser_and_diffusers_loads_it(full_run, base, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "linked"
    assert export.main([f"--workdir={full_run}", f"--out={out}", "--link_base"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in base.iterdir())
    for entry in out.iterdir():
        if entry.name in ("unet", "README.md"):  # the trained denoiser and this model's card
            assert not entry.is_symlink()
        else:
            assert entry.is_symlink()
            assert os.path.realpath(entry) == os.path.realpath(base / entry.name)
    assert "symbolic links into" in (out / "README.md").read_text()
    assert (base / "README.md").read_text() == "the base model's own card\n"
    pipe = StableDiffusionPipeline.from_pretrained(str(out), safety_checker=None)
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"


def _cut_short(step_dir):
    """The array metadata of a checkpoint cut short: the damage after which orbax's
    abandoned reads printed tracebacks (ending in TensorStore specs, `})>.`) at exit."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    chosen = [p for p in files if p.parent.name == "array_metadatas"] or files
    for path in chosen:
        os.truncate(path, path.stat().st_size * 9 // 10)


def test_a_damaged_newest_is_named_in_the_line_and_the_card(
    full_run, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    _cut_short(run / "checkpoints" / "2")
    reported = []  # what reaches Python's "Exception ignored" reports
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    out = tmp_path / "exported"
    assert export.main([f"--workdir={run}", f"--out={out}"]) == 0
    gc.collect()
    printed = capsys.readouterr()
    (line,) = printed.out.splitlines()
    assert line.startswith(
        f"exported checkpoint 1 of {run} to {out}, instead of the newest, checkpoint 2, "
        "which cannot be read ("
    )
    warnings = printed.err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: checkpoint 2 in {run}")
    assert reported == []
    card = (out / "README.md").read_text()
    assert "| iterations done | 1 of 2 |" in card
    assert "| eval reward | -0.7 ± 0.01 after 1 iteration (-0.9 before training) |" in card
    assert f"| checkpoint exported | 1 (of `{run}`), instead of the newest, checkpoint 2" in card
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]  # read-only: none renamed


def test_lora_cards_and_link_base_said_to_change_nothing(lora_run, base, tmp_path, capsys):
    out = tmp_path / "adapter"
    assert export.main([f"--workdir={lora_run}", f"--out={out}", "--link_base"]) == 0
    printed = capsys.readouterr()
    assert printed.err.startswith("warning: --link_base changes nothing here")
    assert len(printed.err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["README.md", lora.LORA_FILE]
    assert {mode & 0o777 for _, mode in _modes(out)[1:]} == {0o666 & ~_umask()}
    card = (out / "README.md").read_text()
    assert f"| weights | LoRA rank 2, alpha 4: `{lora.LORA_FILE}` |" in card
    assert f'DiffusionPipeline.from_pretrained("{base}")' in card
    assert f'pipe.load_lora_weights("{out}")' in card
    merged = tmp_path / "merged"
    assert export.main([f"--workdir={lora_run}", f"--out={merged}", "--merge"]) == 0
    card = (merged / "README.md").read_text()
    assert "| weights | LoRA rank 2, alpha 4, merged into `unet/`, float32 |" in card
    assert f'DiffusionPipeline.from_pretrained("{merged}")' in card


def test_a_tiny_run_is_pointed_to_sample(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model": {"name": "tiny", "path": ""}}')
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'out'}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and f"python -m tree_grpo_jax.sample --workdir={run}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("text, said", [("{not json", "could not read"), ("[1]", "JSON object")])
def test_an_unreadable_config_json_is_one_sentence(tmp_path, capsys, text, said):
    """A run's config.json cut short or not an object: one `error:` line naming the file
    and the way out (--model_path), exit 2, nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(text)
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'out'}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {run / 'config.json'}") or line.startswith(
        f"error: could not read {run / 'config.json'}"
    )
    assert said in line and line.endswith(
        "pass --model_path, the base pipeline folder it was trained from."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_help_is_a_summary_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        export.main(["--help"])
    text = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "examples:" in text and "--link_base" in text and "tree_grpo_jax.sample" in text
    assert "models.export" not in text  # the module's documentation stays out of it


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_another_base_is_refused_unless_allowed_and_the_card_says_so(
    kind, full_run, lora_run, base, tmp_path, capsys
):
    """Full fine-tuning copies the base's text encoder beside the trained UNet; a LoRA merge
    adds the factors to the base's UNet: either way a base whose files differ from the run's
    is not what it was trained on."""
    run = {"full": full_run, "lora": lora_run}[kind]
    component = {"full": "text_encoder", "lora": "unet"}[kind]
    other = tmp_path / "other_base"
    shutil.copytree(base, other)
    weights = next((other / component).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(255 - b for b in data[-8:])  # same size, other bytes
    weights.write_bytes(bytes(data))
    out = tmp_path / "exported"
    args = [f"--workdir={run}", f"--model_path={other}", f"--out={out}", "--merge"]
    assert export.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{component}/" in err and "--allow_other_base" in err, err
    assert not out.exists()
    assert export.main([*args, "--allow_other_base"]) == 0
    card = (out / "README.md").read_text()
    assert "not the run's own base, --allow_other_base" in card and f"{component}/" in card
    # the run's own base exports without a word about it
    assert export.main([f"--workdir={run}", f"--out={tmp_path / 'own'}", "--merge"]) == 0
    assert "--allow_other_base" not in (tmp_path / "own" / "README.md").read_text()


@pytest.mark.slow
def test_a_signal_after_the_last_line_says_the_export_is_whole(full_run, tmp_path):
    """SIGTERM once the export has said what it exported, as the process exits: one line
    saying the folder is written whole, exit 143, and the folder whole (before, this moment
    was Python's teardown, where the signal killed the process without a line)."""
    out = tmp_path / "export"
    args = (f"--workdir={full_run}", f"--out={out}")
    result = run_ending("tree_grpo_jax.export", "in an exit handler", signal.SIGTERM, *args)
    assert result.returncode == 143, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: SIGTERM arrived after the export was done; {out} is written whole."]
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith(f"exported checkpoint 2 of {full_run} to {out}\n")
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert "checkpoint exported | 2 " in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing staged left


@pytest.mark.parametrize(
    "section, value, said",
    [
        ("lora", "x", "its 'lora' is \"x\", not a section of fields."),
        ("checkpoint", [1], "its 'checkpoint' is [1], not a section of fields."),
        ("lora", {"rank": "four"}, 'its lora.rank is "four".'),
        ("train", {"iterations": 2.5}, "its train.iterations is 2.5."),
    ],
)
def test_a_config_json_of_other_types_is_one_sentence(tmp_path, capsys, section, value, said):
    """A run's config.json edited by hand: a section or field of another type than training
    writes is one sentence naming the file, exit 2, nothing written (before: a traceback)."""
    import json

    workdir = tmp_path / "run"
    workdir.mkdir()
    config = {"model": {"name": "sd", "path": str(tmp_path / "base")}, section: value}
    (workdir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert export.main([f"--workdir={workdir}", f"--out={out}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {workdir / 'config.json'} is not a run's config as training writes it: {said}\n"
    )
    assert not out.exists()
