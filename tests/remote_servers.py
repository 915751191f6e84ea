"""Real HTTP servers on the loopback address for the remote-reward tests: the reference
server (a registered reward or a callable) in a thread, a scripted server that answers as a
test tells it (faults, redirects, records of what arrived), and the reference server as a
subprocess of its own command line."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading

import ml_collections

from tree_grpo_jax.rewards import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def _running(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
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
            status, headers, data = record.answer(index, body)
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
def reference_process(*flags: str):
    """`python -m tree_grpo_jax.rewards.serve *flags --port=0` as a process (the tests'
    folder importable, for `--callable`); yields its base URL, read from its first line."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.rewards.serve", *flags, "--port=0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving "), line + process.stderr.read()
        yield line.split(" at ")[1].split()[0].rstrip("/")
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
