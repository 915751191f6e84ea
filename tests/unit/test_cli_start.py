"""What every command does first (`cli.common.starting`), seen from a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_torch_free_start_leaves_one_line_on_stderr_when_transformers_loads():
    """The commands keep torch out of the process; transformers 5 would advise on import
    that it found none, a line the user cannot act on."""
    code = (
        "import sys\n"
        "sys.argv = ['main']\n"
        "from tree_grpo_jax.cli import common\n"
        "common.starting('main')\n"
        "import transformers\n"
        "from transformers import CLIPTokenizer\n"
        "assert sys.modules['torch'] is None\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "tree_grpo_jax.main: starting (loading JAX and the models' code)..."
    ]
