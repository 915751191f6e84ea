"""weights.staging.write_staged under a signal: a stop during the swap waits for it, and its
line says the folder is whole."""

from signalled import run_script

SIGNAL_IN_THE_SWAP = """
import os, sys
from pathlib import Path
from tree_grpo_jax import interrupts
from tree_grpo_jax.weights import staging

interrupts.install()
interrupts.set_stop_line(lambda name: f"{name} stopped the command; nothing was written.")
staging.os.replace = signalled(os.replace)  # arrives as the folder is put in place
staging.write_staged(Path(sys.argv[1]), lambda folder: (folder / "weights.bin").write_text("w"))
print("the write returned", flush=True)
"""


def test_a_signal_in_the_swap_keeps_the_folder_and_says_so(tmp_path):
    out = tmp_path / "exported"
    result = run_script(SIGNAL_IN_THE_SWAP, str(out))
    assert result.returncode == 143, result.stderr[-2000:]
    assert f"error: SIGTERM stopped the command once {out} was written whole." in result.stderr
    assert "the write returned" not in result.stdout
    assert (out / "weights.bin").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # no staging folder left


SIGNAL_WHILE_FILLING = """
import os, signal, sys, time
from pathlib import Path
from tree_grpo_jax import interrupts
from tree_grpo_jax.weights import staging

interrupts.install()

def line(name):  # slow: the main thread has time to go on between the cleanups and the exit
    time.sleep(0.5)
    return f"{name} stopped the command; nothing was written."

interrupts.set_stop_line(line)

def fill(folder):
    (folder / "first.bin").write_text("1")
    os.kill(os.getpid(), signal.SIGTERM)
    while folder.exists():  # the stop's cleanup removes the half-built folder meanwhile
        time.sleep(0.01)
    (folder / "second.bin").write_text("2")  # the writer goes on, and fails

staging.write_staged(Path(sys.argv[1]), fill)
print("the write returned", flush=True)
"""


def test_a_signal_while_filling_leaves_nothing_and_one_line(tmp_path):
    """The stop runs on the watcher thread while the main thread keeps writing: the main
    thread's failure must neither print nor swap anything in; the stop's line is the only
    one, and neither the folder nor its staging copy is left."""
    out = tmp_path / "exported"
    result = run_script(SIGNAL_WHILE_FILLING, str(out))
    assert result.returncode == 143, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: SIGTERM stopped the command; nothing was written."
    ], result.stderr[-2000:]
    assert "the write returned" not in result.stdout
    assert list(tmp_path.iterdir()) == []
