"""The quickstart notebook runs headless, top to bottom, in a fresh kernel started from an
unrelated folder, and trains in a fresh workdir under runs/ each time; what it prints names no
folder of the machine, it shows the command that resumes its run, and the committed copy
installs from a location the user sets (no placeholder URL in its code; the Colab badge's is
the user's to replace, and says so), its outputs free of paths."""

import json
import re
from pathlib import Path

import pytest

# Slow tier: a fresh kernel runs the whole notebook.
pytestmark = pytest.mark.slow

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def _outputs(notebook, kind: str) -> list:
    return [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == kind]


# An absolute path in an output: a machine's folder.
MACHINE_PATH = re.compile(r"(?<![\w.])/(tmp|home|work|root|content|Users|usr|opt|var)/")


def _texts(notebook) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts += [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


def test_committed_notebook_has_no_placeholder_and_no_machine_paths():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    text = nbformat.writes(notebook)
    assert "OWNER" not in text and "github.com/" not in text
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "set REPOSITORY in this cell" in code[0].source
    # The Colab badge's placeholder is the user's to replace, in words, and no code reads it.
    intro = notebook.cells[0].source
    assert intro.startswith("[![Open In Colab](") and "YOUR-ACCOUNT/YOUR-REPOSITORY" in intro
    assert not any("YOUR-ACCOUNT" in cell.source for cell in code)
    outputs = _texts(notebook)
    assert outputs and not MACHINE_PATH.search(outputs), MACHINE_PATH.search(outputs)
    assert "--workdir=runs/tree_grpo_notebook_" in outputs


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()

    streams = _outputs(notebook, "stream")
    stdout = "".join(o.text for o in streams if o.name == "stdout")
    stderr = "".join(o.text for o in streams if o.name == "stderr")
    assert "deprecat" not in stderr.lower(), stderr
    # the training cell's last line: "<first> -> <last> in <workdir>"
    lines = stdout.strip().splitlines()
    resume = lines[-1]
    assert resume.startswith("python -m tree_grpo_jax.main --config=configs/tiny.py ")
    assert resume.endswith(f" --workdir={lines[-2].split(' in ')[-1]}")
    assert str(tmp_path) not in _texts(notebook)
    first, rest = lines[-2].split(" -> ")
    last, workdir = rest.split(" in ")
    assert float(last) > float(first)  # ten iterations improve the digit reward
    assert not Path(workdir).is_absolute()
    workdir = tmp_path / workdir
    assert workdir.parent == tmp_path / "runs" and workdir.name.startswith("tree_grpo_notebook_")
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["iterations"] == 10 and (workdir / "eval_00010.png").is_file()
    # the sample grids, the tree's leaves and the three pictures of the run were shown
    pictures = [o for o in _outputs(notebook, "display_data") if "image/png" in o.data]
    assert len(pictures) == 5
