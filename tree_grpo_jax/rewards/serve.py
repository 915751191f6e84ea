"""The reference server of remote rewards: a registered reward, or any Python callable,
behind the wire format of `remote.py`.

    python -m tree_grpo_jax.rewards.serve --reward=jpeg_compressibility --port=8000
    python -m tree_grpo_jax.rewards.serve --reward=hpsv2 --reward_model=/models/hpsv2.1
    python -m tree_grpo_jax.rewards.serve --callable=my_scorer:score --port=8000

A callable is called `function(images, prompts, metadata)` with images float32
[B, H, W, C] in [0, 1] (videos [B, T, H, W, C]), a prompt and a metadata mapping (or None)
per image, and returns one score per image (a list or array), or a dict holding "scores"
and, optionally, "sub_scores" {name: [B]}. Batches are scored one at a time, in the order
they arrive; any path answers POST. The first line on stdout says where it serves (with
`--port=0`, the port the system chose). Standard library only (http.server).
"""

from __future__ import annotations

import argparse
import http.server
import importlib
import json
import math
import sys
import threading

import numpy as np

from tree_grpo_jax.rewards import remote

EXIT_BAD_INPUT = 2


class BadFlags(Exception):
    """A bad flag; one sentence."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadFlags(f"{message}; see --help.")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tree_grpo_jax.rewards.serve",
        description="Serve a registered reward, or a Python callable, over HTTP.",
    )
    p.add_argument("--reward", help="a registered reward, e.g. jpeg_compressibility")
    p.add_argument("--reward_model", default="", help="the reward's model folder, if it reads one")
    p.add_argument("--callable", help="module:function called (images, prompts, metadata)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    return p


def scorer_of(args):
    """(a description, the function (images, prompts, metadata) -> answer dict)."""
    if bool(args.reward) == bool(args.callable):
        raise BadFlags("give one of --reward=<registered name> and --callable=module:function.")
    if args.reward:
        from tree_grpo_jax import rewards

        if args.reward not in rewards.available_rewards():
            raise BadFlags(
                f"unknown reward {args.reward!r}; known rewards are: "
                f"{', '.join(rewards.available_rewards())}."
            )
        try:
            reward = rewards.load_reward(args.reward, args.reward_model or None)
        except ValueError as e:
            raise BadFlags(str(e).splitlines()[0]) from None

        def score(images, prompts, metadata):
            scores, _, parts = reward.scored(images, prompts, metadata)
            return {"scores": scores, "sub_scores": parts}

        return f"reward {args.reward!r}", score
    module_name, _, function_name = args.callable.partition(":")
    if not module_name or not function_name:
        raise BadFlags(f"--callable={args.callable} must be module:function.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadFlags(f"--callable: module {module_name!r} could not be imported ({e}).") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BadFlags(f"--callable: module {module_name!r} has no function {function_name!r}.")

    def call(images, prompts, metadata):
        answer = function(images, prompts, metadata)
        return answer if isinstance(answer, dict) else {"scores": answer}

    return f"{args.callable}", call


def answer_of(score, body) -> dict:
    """The answer to one request's JSON; ValueError with one sentence for a bad request."""
    if not isinstance(body, dict):
        raise ValueError("the request must be a JSON object")
    items, prompts = body.get("images"), body.get("prompts")
    if not isinstance(items, list) or not isinstance(prompts, list):
        raise ValueError("the request needs 'images' and 'prompts' lists")
    if len(prompts) != len(items):
        raise ValueError(f"{len(prompts)} prompts for {len(items)} images; send one per image")
    metadata = body.get("metadata")
    if metadata is None:
        metadata = [None] * len(items)
    if not isinstance(metadata, list) or len(metadata) != len(items):
        raise ValueError("'metadata' must be a list with one entry (or null) per image")
    if not items:
        return {"scores": []}
    arrays = [remote.decode_item(item) for item in items]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError("the images of a request must all have one shape")
    images = np.stack(arrays).astype(np.float32) / 255.0
    answer = score(images, prompts, metadata)
    scores = [float(s) for s in np.asarray(answer["scores"], np.float64).reshape(-1)]
    out = {"scores": scores}
    subs = {
        n: [float(s) for s in np.asarray(v).reshape(-1)]
        for n, v in answer.get("sub_scores", {}).items()
    }
    if subs:
        out["sub_scores"] = subs
    if not all(math.isfinite(s) for s in scores):  # sent as null: JSON has no NaN
        out["scores"] = [s if math.isfinite(s) else None for s in scores]
    return out


def handler(score, lock: threading.Lock):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length))
            except (ValueError, UnicodeDecodeError):
                return self._send(400, {"error": "the request is not JSON"})
            try:
                with lock:  # one batch at a time: a model on one device
                    answer = answer_of(score, body)
            except ValueError as e:
                return self._send(400, {"error": str(e).splitlines()[0]})
            except Exception as e:  # noqa: BLE001 - the scorer's failure, told to the client
                return self._send(500, {"error": f"{type(e).__name__}: {e}".splitlines()[0]})
            return self._send(200, answer)

        def do_GET(self):  # noqa: N802
            self._send(200, {"serving": "POST images, prompts and metadata as JSON"})

        def _send(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per batch is noise
            pass

    return Handler


def make_server(args) -> tuple[http.server.ThreadingHTTPServer, str]:
    """(the server, bound but not serving yet, and what it serves)."""
    if not 0 <= args.port <= 65535:
        raise BadFlags(f"--port={args.port} is not a port; give 0 to 65535 (0: any free one).")
    what, score = scorer_of(args)
    try:
        server = http.server.ThreadingHTTPServer(
            (args.host, args.port), handler(score, threading.Lock())
        )
    except (OSError, OverflowError) as e:  # in use, not allowed, a host that is not one
        raise BadFlags(
            f"cannot listen on {args.host}:{args.port} ({(e.strerror or str(e)).lower()})."
        ) from None
    server.daemon_threads = True
    return server, what


def main(argv=None) -> int:
    try:
        server, what = make_server(parser().parse_args(argv))
    except BadFlags as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    host, port = server.server_address[:2]
    print(f"serving {what} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
