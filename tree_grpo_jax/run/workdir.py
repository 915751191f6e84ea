"""One run per workdir: a lock file naming its owner, taken over when the owner is dead."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time


class WorkdirBusy(RuntimeError):
    """Another live run holds the workdir; the message is one sentence for the user."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22);
    None where /proc cannot say. Two processes that share a pid in turn differ here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None elsewhere."""
    ticks = _start_ticks(pid)
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return None if ticks is None else boot + ticks / os.sysconf("SC_CLK_TCK")


def _command(pid: int) -> str | None:
    """Process `pid`'s command line, from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _not_the_owner(pid: int, lock: dict) -> str | None:
    """Why the live process `pid` cannot be the run that wrote `lock` (its pid was reused: it
    started at another tick than the lock records, or after the lock's time, or it is no
    Python), or None when it may be."""
    recorded, ticks = lock.get("start_ticks"), _start_ticks(pid)
    if isinstance(recorded, int) and ticks is not None:
        # Ticks since boot need no wall clock, which a restored VM or an NTP step can move.
        if ticks != recorded:
            return "started after the lock was written"
    else:  # a lock without ticks: compare wall-clock times
        started, since = _started_at(pid), lock.get("since")
        if started is not None and isinstance(since, (int, float)) and started > since + 2:
            return "started after the lock was written"
    command = _command(pid)
    if command and "python" not in command.lower():
        return f"is {command.split()[0]!r}, not a Python process"
    return None


class WorkdirLock:
    """`<workdir>/run.lock` holds the owner's pid and host while a run uses the workdir.

    A second run on the same workdir is refused with one sentence. A lock left by a process
    that no longer exists on this host (kill -9, a crash) is taken over. A lock from another
    host cannot be checked, so it is refused, naming the file to remove if that run is gone.
    """

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "run.lock")
        self.owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "start_ticks": _start_ticks(os.getpid()),
        }
        self.held = False

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treated as a dead owner's

    def acquire(self) -> WorkdirLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                other = self._read()
                pid, host = other.get("pid"), other.get("host")
                mine = host == self.owner["host"] and isinstance(pid, int)
                if mine and _alive(pid) and not _not_the_owner(pid, other):
                    raise WorkdirBusy(
                        f"another run (pid {pid}) is using {os.path.dirname(self.path)}; wait "
                        "for it to finish or choose another --workdir."
                    ) from None
                if host and host != self.owner["host"]:
                    raise WorkdirBusy(
                        f"a run on host {host} (pid {pid}) holds {self.path}; if it has "
                        "stopped, delete that file and start again."
                    ) from None
                with contextlib.suppress(FileNotFoundError):  # the owner is gone: take over
                    os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return self
        raise WorkdirBusy(f"could not take the lock {self.path}; another run keeps taking it.")

    def release(self) -> None:
        if self.held and self._read().get("pid") == self.owner["pid"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.held = False

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
