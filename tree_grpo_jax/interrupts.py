"""Ctrl-C and SIGTERM for the command lines: one line, exit 130 / 143, at any moment.

Python runs a signal handler only between bytecodes of the main thread, so a long XLA
compile, a model load or a blocking read ignores it. `install()` therefore also sets
`signal.set_wakeup_fd`: the C-level handler writes the signal's number to a pipe that a
watcher thread reads at once, whatever the main thread is doing. The watcher then:

- by default (starting up, compiling, loading, sampling: nothing to lose), ends the process
  at once with the command's one line (`set_stop_line`), after the cleanups registered with
  `on_stop` (a lock released, an empty new folder removed);
- inside `deferred()` (the training loop), lets the first signal only ask the loop to stop at
  its next safe point (`requested()`), and stops at once on a second one;
- inside `critical()` (a file being written), waits for the region's end, where the main
  thread stops with the line: nothing is left half-written.

A command ends with `finish(status)`: Python's exit handlers run as usual (a signal meanwhile
is still the command's line), and then the process ends at once, without the interpreter's
teardown: freeing JAX's and torch's objects takes a second or more, and Python handles no
signal by then, so one would kill the process silently after its last line.

Without `install()` (the library used from Python) nothing changes: the caller's handlers
stay in place.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading

EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}
_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.decided = threading.Condition(self.lock)  # the watcher took a signal
        self.seen = 0  # signals the watcher has taken
        self.handled = 0  # calls of the Python-level handler (equal signals may coalesce)
        self.installed = False
        self.received: list[str] = []  # every signal so far, in order
        self.deferring = 0  # depth of deferred() regions
        self.critical = 0  # depth of critical() regions
        self.pending: str | None = None  # a stop waiting for the end of a critical region
        self.first_line: str | None = None  # what deferred()'s first signal prints
        self.stop_line = lambda name: f"{name} stopped the command."
        self.cleanups: list = []
        self.stopper: int | None = None  # the thread ending the process, once one is
        self.status: int | None = None  # the command's own exit status (`finish`), once said


def _park_if_stopping() -> None:
    """Holds any other thread still once a stop has begun: the main thread must neither
    drop a cleanup the stop is about to run nor start a region (a folder's swap) the stop's
    cleanups are undoing. The process ends under it."""
    with _state.lock:
        parked = _state.stopper not in (None, threading.get_ident())
    if parked:
        threading.Event().wait()


_state = _State()


def installed() -> bool:
    return _state.installed


def install() -> bool:
    """Takes over SIGINT and SIGTERM for this process (main thread only; a signal the parent
    ignores stays ignored). Returns whether it did."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        return _state.installed
    read, write = os.pipe()
    os.set_blocking(write, False)
    taken = []
    for signum in _NAMES:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _python_handler)
            taken.append(signum)
    if not taken:
        os.close(read)
        os.close(write)
        return False
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read,), name="interrupts", daemon=True).start()
    # Registered before the packages' own (JAX's, orbax's): run after them, it is the last.
    atexit.register(_end)
    _state.installed = True
    return True


def finish(status: int) -> None:
    """Ends the command with exit status `status` (`sys.exit`). With `install()`, the process
    then ends right after the exit handlers, without the interpreter's teardown (`_end`)."""
    if _state.installed:
        _state.status = status
    sys.exit(status)


def _end() -> None:
    """The last exit handler: after a `finish`, ends the process with its status at once.

    Python's teardown (modules and their objects freed: a second or two after JAX or torch)
    comes after the signal handlers are restored to their defaults and the watcher thread is
    frozen; a signal then would end the process silently, by SIGTERM's or SIGINT's default
    action, after everything was written and said. Nothing of the teardown is needed: the
    command's files are closed, and its streams are flushed here. After an uncaught
    exception (no `finish`) Python ends as usual."""
    with _state.lock:
        if _state.status is None:
            return
        if _state.stopper is None:
            _state.stopper = threading.get_ident()
    _park_if_stopping()  # a stop under way ends the process itself, with its line
    logging.shutdown()  # registered before `install()`: it would run after this
    _flush_streams()
    os._exit(_state.status)


def _python_handler(signum, frame) -> None:
    """The watcher does the work; this keeps Python's default (KeyboardInterrupt, or death
    by SIGTERM) away, and holds the main thread at its next bytecode until the watcher has
    decided: once a stop is under way the main thread runs no more Python (no half a line
    printed after the stop's, no normal exit with status 0, no file written after the
    cleanups)."""
    with _state.decided:
        _state.handled += 1
        _state.decided.wait_for(lambda: _state.seen >= _state.handled, timeout=1.0)
    _park_if_stopping()


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        for signum in data:
            name = _NAMES.get(signum)
            if name is not None:
                _on_signal(name)


def _on_signal(name: str) -> None:
    # Decided and begun under the lock, so the main thread cannot start a critical region or
    # drop a cleanup between the decision and the stop.
    with _state.lock:
        _state.seen += 1
        _state.decided.notify_all()
        _state.received.append(name)
        if _state.deferring and len(_state.received) == 1:
            if _state.first_line:
                _write_line(_state.first_line.format(name=name))
            return
        if _state.critical:
            _state.pending = _state.pending or name
            return
        stop_now(name)


def requested() -> str | None:
    """The first signal received inside (or before) the current `deferred()` region."""
    return _state.received[0] if _state.received else None


def set_stop_line(line) -> None:
    """`line(signal_name) -> str`: the one line a stop prints (without `error: `); it is
    called at the moment of the stop, so it can say what is kept then."""
    _state.stop_line = line


@contextlib.contextmanager
def on_stop(cleanup):
    """Runs `cleanup()` if a signal stops the process inside this block."""
    _state.cleanups.append(cleanup)
    try:
        yield
    finally:
        _park_if_stopping()
        with _state.lock, contextlib.suppress(ValueError):
            _state.cleanups.remove(cleanup)


@contextlib.contextmanager
def deferred(first_line: str | None = None):
    """A first signal only asks to stop (`requested()`), printing `first_line` (with
    `{name}`); a second one stops at once (after any critical region)."""
    with _state.lock:
        _state.deferring += 1
        previous, _state.first_line = _state.first_line, first_line
    try:
        yield
    finally:
        with _state.lock:
            _state.deferring -= 1
            _state.first_line = previous


@contextlib.contextmanager
def critical():
    """A region a signal must not cut short (a file being written): a stop waits for its
    end, where the main thread takes it."""
    _park_if_stopping()
    with _state.lock:
        _state.critical += 1
    try:
        yield
    finally:
        with _state.lock:
            _state.critical -= 1
            pending = _state.pending if _state.critical == 0 else None
            if pending:
                _state.pending = None
        if pending:
            stop_now(pending)


def _write_line(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode(errors="replace"))


def _flush_streams() -> None:
    """Flushes what the main thread printed, unless that blocks (a stalled pipe)."""

    def flush():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(1.0)


def stop_now(name: str) -> None:
    """Ends the process at once: the cleanups, the command's one line, exit 130 / 143. A
    command that failed and said so (`finish` with a status other than 0) is ending with
    its own line: it keeps that line alone and its status."""
    with _state.lock:
        if _state.stopper is not None and _state.stopper != threading.get_ident():
            return  # another thread is ending the process already
        _state.stopper = threading.get_ident()
        cleanups = list(_state.cleanups)
        failed = _state.status
    _flush_streams()
    if failed:
        os._exit(failed)
    for cleanup in reversed(cleanups):
        with contextlib.suppress(Exception):
            cleanup()
    try:
        line = _state.stop_line(name)
    except Exception:  # noqa: BLE001 - the line must still come
        line = f"{name} stopped the command."
    _write_line(f"error: {line}")
    os._exit(EXIT_STATUS.get(name, 130))
