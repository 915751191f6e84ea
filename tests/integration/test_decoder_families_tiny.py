"""Z-Image, Qwen-Image and the two editing families (FLUX.2-klein, FLUX.1-Kontext) through
the command lines on the weights-free tiny folders that launch/tiny_folders.py writes, torch
blocked throughout: one TreeGRPO iteration of the config (shrunk by overrides; the editing
ones from a prompt file naming an input image per row), then `sample`, which draws the run's
own last eval pictures bit for bit at the folder's resolution, and `evaluate`, whose base
and step-1 rows are the run's two evaluations.
(tests/parity/test_{zimage,qwenimage}_model.py, test_flux2_*.py and test_flux_kontext.py
check the numbers against diffusers.)"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# config -> (tiny folder kind, settings section, the folder's own side in pixels, reward,
# the text length setting)
CASES = {
    "zimage_treegrpo": ("zimage", "zimage", 32, "jpeg_compressibility", "text_max_length"),
    "qwenimage_treegrpo": ("qwenimage", "qwenimage", 64, "jpeg_compressibility", "text_max_length"),
    "flux2_klein_edit": ("flux2-klein", "flux2", 32, "input_similarity", "text_max_length"),
    "flux_kontext_edit": ("flux", "flux", 32, "input_similarity", "t5_max_length"),
}
EVAL_PROMPTS = 2


def _edits(folder, side: int):
    """A prompt file of EVAL_PROMPTS instructions, each naming a random picture to edit."""
    rows = []
    for i in range(EVAL_PROMPTS):
        pixels = np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"input{i}.png")
        rows.append(json.dumps({"prompt": f"edit number {i}", "image": f"input{i}.png"}))
    (folder / "edits.jsonl").write_text("\n".join(rows) + "\n")
    return folder / "edits.jsonl"


def shrink(config: str, folder, prompts) -> list[str]:
    _, section, side, reward, text_length = CASES[config]
    return [
        f"--config=configs/{config}.py",
        f"--config.model.path={folder}",
        "--config.model.compute_dtype=float32",
        "--config.model.remat=False",
        f"--config.model.{section}.resolution={side}",
        f"--config.model.{section}.{text_length}=40",
        f"--config.rewards={reward}",
        *([f"--config.prompts.source={prompts}"] if prompts else []),
        "--config.prompts.batch_size=1",
        f"--config.prompts.eval_count={EVAL_PROMPTS}",
        "--config.sampling.num_steps=3",
        "--config.tree.window=1",
        "--config.train.iterations=1",
        "--config.train.rows_per_minibatch=2",
        "--config.train.grad_accumulation=1",
        "--config.eval.every=0",
        "--config.checkpoint.every=1",
        "--config.log.tensorboard=False",
    ]


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request, tmp_path_factory):
    """The family's tiny folder written, one iteration trained, then `sample` and `evaluate`
    on the run, in one Python with torch blocked."""
    config = request.param
    kind, _, side, *_ = CASES[config]
    tmp = tmp_path_factory.mktemp(config)
    folder, workdir = tmp / "tiny" / kind, tmp / "run"
    prompts = _edits(tmp, side) if config.endswith("_edit") else None
    code = textwrap.dedent(
        f"""
        import json, runpy, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.path.insert(1, "tests")
        sys.argv = ["tiny_folders.py", "--out={tmp / "tiny"}", "--kinds={kind}"]
        runpy.run_path("launch/tiny_folders.py", run_name="__main__")
        from in_process import run_in_process, run_main
        from tree_grpo_jax.cli import evaluate, sample
        trained = run_main(*{shrink(config, folder, prompts)!r}, "--workdir={workdir}")
        status = {{"train": [trained.returncode, trained.stderr[-3000:]]}}
        status["sample"] = sample.main(["--workdir={workdir}", "--out={tmp}/samples"])
        evaluated = run_in_process(
            evaluate, "--workdir={workdir}", "--out={tmp}/evaluation", "--samples_per_prompt=1"
        )
        status["evaluate"] = [evaluated.returncode, evaluated.stderr[-3000:]]
        print("STATUS" + json.dumps(status))
        assert sys.modules["torch"] is None
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("STATUS"))
    status = json.loads(line[len("STATUS") :])
    assert status["train"][0] == 0, status["train"][1]
    return config, tmp, workdir, status


@pytest.mark.slow
def test_sample_draws_the_runs_last_eval_pictures(run):
    config, tmp, workdir, status = run
    assert status["sample"] == 0
    out = tmp / "samples"
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == EVAL_PROMPTS + 1 and names[-1] == "grid.png", names
    side = CASES[config][2]
    for name in names[:-1]:
        picture = np.asarray(Image.open(out / name))
        assert picture.shape == (side, side, 3), (name, picture.shape)
        assert picture.std() > 0  # random weights draw noise, not a blank
    # the same sampler, prompts, noise and weights as the run's evaluation after iteration 1
    assert (out / "grid.png").read_bytes() == (workdir / "eval_00001.png").read_bytes()


@pytest.mark.slow
def test_evaluate_agrees_with_the_runs_evaluations(run):
    config, tmp, workdir, status = run
    _, _, side, reward_name, _ = CASES[config]
    assert status["evaluate"][0] == 0, status["evaluate"][1]
    table = json.loads((tmp / "evaluation" / "evaluation.json").read_text())
    assert [r["label"] for r in table["rows"]] == ["base", "step 1"]
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"]: m for m in metrics if "eval/reward_mean" in m}
    assert sorted(evals) == [0, 1]
    for row, step in zip(table["rows"], (0, 1)):
        reward = row[reward_name]
        np.testing.assert_allclose(reward["mean"], evals[step]["eval/reward_mean"], rtol=1e-6)
        np.testing.assert_allclose(reward["std"], evals[step]["eval/reward_std"], rtol=1e-5)
    grid = Image.open(tmp / "evaluation" / "grid_step_1.png")
    assert grid.width >= EVAL_PROMPTS * side  # the prompts side by side
