"""The quickstart notebook runs headless, top to bottom, in a fresh kernel started from an
unrelated folder, and trains in a fresh temporary workdir each time."""

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def _outputs(notebook, kind: str) -> list:
    return [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == kind]


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the notebook's workdir goes
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
    first, rest = stdout.strip().splitlines()[-1].split(" -> ")
    last, workdir = rest.split(" in ")
    assert float(last) > float(first)  # ten iterations improve the digit reward
    workdir = Path(workdir)
    assert workdir.parent == tmp_path and workdir.name.startswith("tree_grpo_notebook_")
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["iterations"] == 10 and (workdir / "eval_00010.png").is_file()
    # the sample grids, the tree's leaves and the three pictures of the run were shown
    pictures = [o for o in _outputs(notebook, "display_data") if "image/png" in o.data]
    assert len(pictures) == 5
