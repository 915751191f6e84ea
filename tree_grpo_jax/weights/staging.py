"""Folders and files that appear whole or not at all.

`check_out_dir` refuses a destination that would overwrite work or a source before anything
is written; `write_staged` builds the folder beside its destination and moves it into place,
so a failure (or a kill) leaves no half-built folder and an existing one is replaced only by
a complete one. `files_in_place` does the same for files written into a folder that holds
others (pictures, results): each file replaces its namesake only once it is whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from tree_grpo_jax import interrupts


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_out_dir(
    base: Path | None, out: Path, overwrite: bool, sources=(), what: str = "the export folder"
) -> None:
    """Refuses an output folder that would overwrite work or a source; changes nothing."""
    out = Path(out).expanduser().resolve()
    protected = [(base.resolve(), "the base model folder")] if base is not None else []
    protected += [(Path(s).expanduser().resolve(), "the source") for s in sources]
    for source, kind in protected:
        if _overlaps(out, source):
            raise ValueError(f"{what} {out} must be neither inside nor around {kind} {source}.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is an existing file; choose a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{what} {out} is not empty; pass --overwrite or choose another.")
    check_can_make(out, what)


# errno -> what the folder is, for the sentence
_CANNOT = {
    errno.ENOTDIR: "is a file, not a folder",
    errno.EEXIST: "is a file, not a folder",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (permission denied)",
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "is on a full disk",
}


def check_can_make(out: Path, what: str) -> None:
    """Raises ValueError (one sentence) unless a folder can be made beside `out`: its nearest
    existing ancestor is probed with an empty folder, made and removed at once."""
    parent = Path(out).expanduser().resolve().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {out} cannot be made: {parent} is a file, not a folder.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
    except OSError as e:
        why = _CANNOT.get(e.errno, f"refuses new folders ({e.strerror or e})")
        raise ValueError(f"{what} {out} cannot be made: {parent} {why}.") from None


def write_staged(out: Path, fill) -> Path:
    """Builds a folder with `fill(staging)` beside `out`, then moves it into place: a failure
    (or a kill) leaves no half-built `out`, and an existing `out` is replaced only whole."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():  # left by an earlier, killed export of this process id
        shutil.rmtree(staging)

    def stopped() -> None:  # a signal ends the process: the half-built folder goes
        # Renamed first: the main thread may still be writing into it, and a new file can
        # then no longer appear in the folder being removed (its path is gone).
        doomed = staging.with_name(staging.name + "-removing")
        try:
            os.rename(staging, doomed)
        except OSError:
            doomed = staging
        for _ in range(3):
            shutil.rmtree(doomed, ignore_errors=True)

    try:
        # One cleanup from the folder's making to the swap: a stop between the two still
        # removes the staging folder (after the swap it finds nothing to remove).
        with interrupts.on_stop(stopped):
            staging.mkdir()  # inside: a stop just after it still removes it
            fill(staging)
            with interrupts.critical():  # the swap itself is never cut in half
                if out.is_dir():
                    shutil.rmtree(out)
                os.replace(staging, out)
                # from here on a stop keeps the folder, and its line must say so
                interrupts.set_stop_line(
                    lambda name: f"{name} stopped the command once {out} was written whole."
                )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def files_in_place(folder):
    """A hidden folder inside `folder` (made if missing) to write files into; at the block's
    end each of them replaces the file of its name in `folder` by a rename, and the hidden
    folder goes. A file in `folder` is thus never a half-written one in place of a good one:
    a failure (a full disk) or a stop removes the hidden folder with what it holds, and
    leaves `folder` as it was; a kill leaves it hidden."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stage = folder / f".partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)  # an earlier, killed process of this id's
    stage.mkdir()
    try:
        with interrupts.on_stop(lambda: shutil.rmtree(stage, ignore_errors=True)):
            yield stage
            for entry in sorted(stage.iterdir()):
                os.replace(entry, folder / entry.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


CARD_FILE = "README.md"  # the model card, where the Hugging Face hub and readers look for it


def new_file_mode(folder) -> int:
    """The mode a file created in `folder` the ordinary way gets (0666 less the umask), read
    off a probe file: reading the umask means setting it, for every thread at once."""
    probe = Path(folder) / f".mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()
