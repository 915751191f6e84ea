"""Real HTTP servers on the loopback address for the remote-reward tests: the reference
server (a registered reward or a callable) in a thread, a scripted server that answers as a
test tells it (faults, redirects, records of what arrived and when), a server that trickles
its answer byte by byte, and the reference server as a subprocess of its own command line."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import ml_collections

from tree_grpo_jax.rewards import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def _running(server):
    # a short poll: shutdown() waits for it, at the end of every test
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def reference(*flags: str):
    """The reference server with `flags` (`--reward=...` or `--callable=...`), its base URL."""
    server, _ = serve.make_server(serve.parser().parse_args([*flags, "--port=0"]))
    with _running(server) as url:
        yield url


class Scripted:
    """What a scripted server received (`requests`: (path, headers, JSON body)); its
    `answer(index, body) -> (status, headers, bytes)` decides each answer."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = []
        self.times = []  # time.monotonic() at each request's arrival
        self.lock = threading.Lock()


def json_answer(payload, status: int = 200, kind: str = "application/json"):
    return status, {"Content-Type": kind}, json.dumps(payload).encode()


@contextlib.contextmanager
def scripted(answer):
    """A server answering every POST with `answer(index, body)`; yields (base URL, record)."""
    record = Scripted(answer)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            with record.lock:
                index = len(record.requests)
                record.requests.append((self.path, dict(self.headers), body))
                record.times.append(time.monotonic())
            status, headers, data = record.answer(index, body)
            with contextlib.suppress(OSError):  # a client that gave up (its deadline)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with _running(server) as url:
        yield url, record


@contextlib.contextmanager
def trickling(every_s: float, in_headers: bool = False, stop_after_s: float = 5.0):
    """A server that answers every POST with a status line and then, one byte every
    `every_s` seconds, the rest: its headers (`in_headers`) or a body of 1000 bytes it
    announced; each answer ends by itself after `stop_after_s`, or when a write finds the
    client gone. Yields (URL, a list of how long each answer went on before it ended)."""
    lasted = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            start = time.monotonic()
            try:
                if in_headers:
                    self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
                else:
                    self.wfile.write(
                        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n"
                    )
                while time.monotonic() - start < stop_after_s:
                    time.sleep(every_s)
                    self.wfile.write(b"a" if in_headers else b" ")
            except OSError:
                pass
            lasted.append(time.monotonic() - start)
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with _running(server) as url:
        yield url, lasted


def start_process(*flags: str, path: str = "") -> tuple[subprocess.Popen, str]:
    """`python -m tree_grpo_jax.rewards.serve *flags --port=0` started (the tests' folder
    and `path` importable, for `--callable`): (the process, the URL its first line prints)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS, path, os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.rewards.serve", *flags, "--port=0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if not line.startswith("serving "):
        process.kill()
        raise AssertionError(line + process.communicate(timeout=30)[1])
    return process, line.split(" at ")[1].split()[0]


@contextlib.contextmanager
def reference_process(*flags: str):
    """`python -m tree_grpo_jax.rewards.serve *flags --port=0` as a process (the tests'
    folder importable, for `--callable`); yields the URL its first line prints."""
    process, url = start_process(*flags)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(30)


def settings(url: str, **fields) -> ml_collections.ConfigDict:
    """reward_options for one remote reward `remote:r` at `url` (fields over the defaults)."""
    from tree_grpo_jax.rewards import remote

    s = remote.settings()
    s.url = url
    s.update(fields)
    return ml_collections.ConfigDict({"dtype": "float32", "chunk_size": 16, "remote": {"r": s}})


def load(url: str, **fields):
    """The reward `remote:r` at `url`."""
    from tree_grpo_jax.rewards import registry

    return registry.load_rewards(["remote:r"], {}, settings(url, **fields))["remote:r"]
