"""The quickstart notebook's install cell, run as a script where tree_grpo_jax cannot be
imported: without a repository it asks for one, a clone that fails stops it with one sentence
(no traceback), and the repository it is given loses the blanks pasted around it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
# find_spec answers None for a module whose sys.modules entry is None: the package is "missing".
HIDE = "import sys\nsys.modules['tree_grpo_jax'] = None\n"


def _setup_source() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


def _run(tmp_path, repository: str) -> subprocess.CompletedProcess:
    script = tmp_path / "setup_cell.py"
    script.write_text(HIDE + _setup_source())
    env = {"PATH": "/usr/bin:/bin", "TREE_GRPO_JAX_REPOSITORY": repository}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_repository_it_asks_for_one(tmp_path):
    done = _run(tmp_path, "")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "tree_grpo_jax is not installed here: set REPOSITORY in this cell to the git URL "
        "or folder of tree_grpo_jax, and run it again."
    )


@pytest.mark.skipif(shutil.which("git", path="/usr/bin:/bin") is None, reason="needs git")
def test_a_failed_clone_is_one_sentence_about_the_stripped_url(tmp_path):
    missing = tmp_path / "nowhere" / "tree_grpo_jax.git"
    done = _run(tmp_path, f"  {missing} \n")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, said
    assert said[0].startswith(f"Cloning '{missing}' failed (")
    assert said[0].endswith("): check REPOSITORY in this cell and run it again.")
    assert "does not exist" in said[0]  # git's own reason, its last line
    assert not (tmp_path / "tree_grpo_jax").exists()
