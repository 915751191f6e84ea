"""weights.staging.write_staged under a signal: a stop during the swap waits for it, and its
line says the folder is whole; files_in_place puts files in place only whole."""

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


def test_files_in_place_replace_their_namesakes_only_once_whole(tmp_path):
    """Files written through `files_in_place` replace the folder's files of their names at
    the block's end; a failure inside leaves every file of the folder as it was."""
    import pytest

    from tree_grpo_jax.weights import staging

    folder = tmp_path / "pictures"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"good a")
    (folder / "other.txt").write_bytes(b"kept")
    with pytest.raises(OSError, match="No space left"), staging.files_in_place(folder) as stage:
        (stage / "a.png").write_bytes(b"half")
        raise OSError(28, "No space left on device")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        "a.png": b"good a",
        "other.txt": b"kept",
    }
    with staging.files_in_place(folder) as stage:
        (stage / "a.png").write_bytes(b"new a")
        (stage / "b.png").write_bytes(b"new b")
        assert (folder / "a.png").read_bytes() == b"good a"  # not before the block's end
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        "a.png": b"new a",
        "b.png": b"new b",
        "other.txt": b"kept",
    }
