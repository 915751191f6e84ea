"""`python -m tree_grpo_jax.evaluate` on a prompt file whose rows name input images: scored
by a reward that reads them; refused in one sentence, with nothing written, when nothing
reads them or an image cannot be read."""

import json

import numpy as np
import pytest
from in_process import run_in_process
from PIL import Image

PROMPTS = ["a handwritten digit one", "a handwritten digit two"]


def _evaluate():
    from tree_grpo_jax.cli import evaluate

    return evaluate


def _prompt_file(folder, image="pictures/start.png"):
    (folder / "pictures").mkdir(exist_ok=True)
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "pictures" / "start.png")
    rows = [{"prompt": p, "image": image} for p in PROMPTS]
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_reward_reading_the_input_images_scores_them(tmp_path):
    out = tmp_path / "out"
    args = [f"--prompts={_prompt_file(tmp_path)}", f"--out={out}", "--samples_per_prompt=1"]
    result = run_in_process(
        _evaluate(), "--config=configs/tiny.py", *args, "--metrics=input_similarity"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((out / "evaluation.json").read_text())["rows"][0]
    assert -1.0 <= row["input_similarity"]["mean"] < 0.0, row


@pytest.mark.parametrize(
    "case, said",
    [
        ("unread", "--prompts names input images, but model 'tiny-ddim' takes none"),
        ("missing", "--prompts: input image '{d}/pictures/gone.png' does not exist"),
    ],
)
def test_bad_input_images_are_one_sentence_and_write_nothing(tmp_path, case, said):
    out = tmp_path / "out"
    if case == "unread":
        source, metrics = _prompt_file(tmp_path), "digit_accuracy"
    else:
        source, metrics = _prompt_file(tmp_path, "pictures/gone.png"), "input_similarity"
    args = [f"--prompts={source}", f"--out={out}", f"--metrics={metrics}"]
    result = run_in_process(_evaluate(), "--config=configs/tiny.py", *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert said.format(d=tmp_path) in errors[0] and "Traceback" not in result.stderr
    assert not out.exists()
