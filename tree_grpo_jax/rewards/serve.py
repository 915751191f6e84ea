"""The reference server of remote rewards: a registered reward, or any Python callable,
behind the wire format of `remote.py`.

    python -m tree_grpo_jax.rewards.serve --reward=jpeg_compressibility --port=8000
    python -m tree_grpo_jax.rewards.serve --reward=hpsv2 --reward_model=/models/hpsv2.1
    python -m tree_grpo_jax.rewards.serve --callable=my_scorer:score --port=8000

A callable is called `function(images, prompts, metadata)` with images float32
[B, H, W, C] in [0, 1] (videos [B, T, H, W, C]), a prompt and a metadata mapping (or None)
per image, and returns one score per image (a list or array), or a dict holding "scores"
and, optionally, "sub_scores" {name: [B]}. A request carrying `input_images` (a client
with `input_images` set) also passes `input_images=`: one list per image of its prompt's
input images, uint8 [H, W, 3]; a registered reward that takes input images gets them as it
would in a run. Batches are scored one at a time, in the order
they arrive; any path answers POST. The first line on stdout gives the URL to put in a
run's `url` (with `--port=0`, the port the system chose). Ctrl-C or SIGTERM stops it: it
takes no more requests, lets those in flight finish (at most `--grace_s` seconds), prints
one line and exits 0; a second signal stops it at once. Standard library only (http.server).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import importlib
import json
import math
import sys
import threading
import time

import numpy as np

from tree_grpo_jax import interrupts
from tree_grpo_jax.errors import echo, first_line, reason
from tree_grpo_jax.rewards import remote

EXIT_BAD_INPUT = 2
PROG = "python -m tree_grpo_jax.rewards.serve"
PATH = "/score"  # the path the printed URL names (any path answers)


class BadFlags(Exception):
    """A bad flag; one sentence."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        line = first_line(message)  # argparse quotes the value given, whatever its length
        raise BadFlags(f"{line if len(line) <= 200 else line[:197] + '...'}; see --help.")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Serve a registered reward, or a Python callable, over HTTP.",
    )
    p.add_argument("--reward", help="a registered reward, e.g. jpeg_compressibility")
    p.add_argument("--reward_model", default="", help="the reward's model folder, if it reads one")
    p.add_argument("--callable", help="module:function called (images, prompts, metadata)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument(
        "--grace_s",
        type=float,
        default=30.0,
        help="on Ctrl-C or SIGTERM, how long the requests in flight may take to finish (30)",
    )
    return p


def _serve_flags(sentence: str, name: str) -> str:
    """A reward's sentence with the run's flag for its folder put as serve's."""
    for flag in (f"--config.reward_models.{name}=/path", f"--config.reward_models.{name}"):
        sentence = sentence.replace(
            flag, "--reward_model=/path" if "=" in flag else "--reward_model"
        )
    return sentence.replace("takes no path", "takes no --reward_model")


class _WithInputImages(dict):
    """A request's metadata for one image with its input images beside it, as a run's rows
    carry them (`input_images`) to the rewards that read them."""

    def __init__(self, fields, input_images):
        super().__init__(fields or {})
        self.input_images = tuple(input_images)


def scorer_of(args):
    """(a description, the function (images, prompts, metadata) -> answer dict)."""
    if bool(args.reward) == bool(args.callable):
        raise BadFlags("give one of --reward=<registered name> and --callable=module:function.")
    if args.reward:
        from tree_grpo_jax import rewards

        if args.reward not in rewards.available_rewards():
            raise BadFlags(
                f"unknown reward {echo(args.reward)}; known rewards are: "
                f"{', '.join(rewards.available_rewards())}."
            )
        try:
            reward = rewards.load_reward(args.reward, args.reward_model or None)
        except ValueError as e:
            raise BadFlags(_serve_flags(first_line(e), args.reward)) from None

        def score(images, prompts, metadata, input_images=None):
            if input_images is not None:  # they ride on the metadata, as in a run
                metadata = [_WithInputImages(m, i) for m, i in zip(metadata, input_images)]
            scores, _, parts = reward.scored(images, prompts, metadata)
            return {"scores": scores, "sub_scores": parts}

        return f"reward {args.reward!r}", score
    module_name, _, function_name = args.callable.partition(":")
    if not module_name or not function_name:
        raise BadFlags(f"--callable {echo(args.callable)} must be module:function.")
    module = _imported(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BadFlags(
            f"--callable: module {echo(module_name)} has no function {echo(function_name)}."
        )

    def call(images, prompts, metadata, input_images=None):
        if input_images is None:  # a callable written before input images keeps working
            answer = function(images, prompts, metadata)
        else:
            answer = function(images, prompts, metadata, input_images=input_images)
        return answer if isinstance(answer, dict) else {"scores": answer}

    return f"{args.callable}", call


def _imported(name: str):
    """The module `name`; BadFlags with one sentence for one that cannot be imported, fails
    while importing (a SyntaxError by its file and line) or exits the process."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BadFlags(
            f"--callable: module {echo(name)} could not be imported ({reason(e)})."
        ) from None
    except SyntaxError as e:
        raise BadFlags(
            f"--callable: module {echo(name)} has a syntax error at {e.filename}:{e.lineno} "
            f"({e.msg})."
        ) from None
    except SystemExit as e:
        raise BadFlags(
            f"--callable: module {echo(name)} called sys.exit({remote.shown(e.code)}) while "
            "being imported; a scorer's module must import without exiting."
        ) from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed
        raise BadFlags(
            f"--callable: module {echo(name)} raised {reason(e)} while being imported{_at(e)}."
        ) from None


def _at(error: BaseException) -> str:
    """' at file:line' of where the error was raised (importlib's own frames skipped)."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    own = [f for f in frames if "importlib" not in f[0]]
    return f" at {own[-1][0]}:{own[-1][1]}" if own else ""


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
    inputs = body.get("input_images")
    if inputs is None:
        answer = score(images, prompts, metadata)
    else:
        if not isinstance(inputs, list) or len(inputs) != len(items):
            raise ValueError("'input_images' must be a list with one list of images per image")
        if not all(isinstance(row, list) for row in inputs):
            raise ValueError("each entry of 'input_images' must be a list of images")
        decoded = [[remote.decode_image(image) for image in row] for row in inputs]
        answer = score(images, prompts, metadata, input_images=decoded)
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


class InFlight:
    """The requests being answered: a stop waits for them (`settled`)."""

    def __init__(self):
        self.count = 0
        self.changed = threading.Condition()

    def __enter__(self):
        with self.changed:
            self.count += 1

    def __exit__(self, *exc):
        with self.changed:
            self.count -= 1
            self.changed.notify_all()

    def settled(self, timeout: float) -> int:
        """Waits up to `timeout` seconds for none to be in flight; how many still are."""
        with self.changed:
            self.changed.wait_for(lambda: self.count == 0, timeout)
            return self.count


def handler(score, lock: threading.Lock, in_flight: InFlight | None = None):
    in_flight = in_flight or InFlight()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            with in_flight:  # answered in full before a stop ends the process
                self._answer()

        def _answer(self):
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


class Server(http.server.ThreadingHTTPServer):
    """The reference server; `in_flight` counts the requests it is answering."""

    daemon_threads = True
    in_flight: InFlight


def make_server(args) -> tuple[Server, str]:
    """(the server, bound but not serving yet, and what it serves)."""
    if not 0 <= args.port <= 65535:
        raise BadFlags(
            f"--port={remote.shown(args.port)} is not a port; give 0 to 65535 (0: any free one)."
        )
    if not 0 <= args.grace_s <= 3600:
        raise BadFlags(f"--grace_s={args.grace_s:g} must be between 0 and 3600 seconds.")
    what, score = scorer_of(args)
    in_flight = InFlight()
    try:
        server = Server((args.host, args.port), handler(score, threading.Lock(), in_flight))
    except (OSError, OverflowError) as e:  # in use, not allowed, a host that is not one
        raise BadFlags(
            f"cannot listen on {echo(args.host)} port {args.port} "
            f"({first_line(e.strerror or e)[:200].lower()})."
        ) from None
    server.in_flight = in_flight
    return server, what


def url_of(server) -> str:
    """The URL a run's `url` names: the address served, with PATH."""
    host, port = server.server_address[:2]
    return f"http://{host}:{port}{PATH}"


def serving_line(what: str, url: str) -> str:
    """The first line on stdout: what is served, and the URL a run's `url` names."""
    return f"serving {what} at {url} (Ctrl-C or SIGTERM stops)"


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # stdout gone (a closed pipe): the status still tells
        print(line, flush=True)


def serve(server: Server, grace_s: float, announce: str | None = None) -> int:
    """Serves until Ctrl-C or SIGTERM, then takes no more requests, lets those in flight
    finish (at most `grace_s` seconds), says so in one line and returns 0. With `interrupts`
    installed (the command) a second signal stops at once; without (called from Python)
    Ctrl-C is the KeyboardInterrupt it always is. `announce` is printed once the signals
    are the serving ones: a client that reads it and stops the server is answered so."""
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True)
    name = "Ctrl-C"
    with interrupts.deferred():
        interrupts.set_stop_line(
            lambda signal: (
                f"{signal} again: the reward server stopped at once, with "
                f"{server.in_flight.count} request(s) unanswered."
            )
        )
        thread.start()
        if announce is not None:
            _say(announce)
        try:
            while interrupts.installed() and interrupts.requested() is None:
                time.sleep(0.05)
            thread.join(None if not interrupts.installed() else 0)
        except KeyboardInterrupt:
            pass
        name = interrupts.requested() or name
        busy = server.in_flight.count
        server.shutdown()  # no more requests taken, nor connections
        server.server_close()
        left = server.in_flight.settled(grace_s)
    if left:
        said = f"stopped after --grace_s={grace_s:g}s with {left} of {busy} request(s) unanswered"
    elif busy:
        said = f"answered the {busy} request(s) in flight and stopped"
    else:
        said = "stopped (no request was in flight)"
    _say(f"{name} received: the reward server {said}.")
    return 0


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        server, what = make_server(args)
    except BadFlags as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return serve(server, args.grace_s, announce=serving_line(what, url_of(server)))


def run() -> None:
    """The command: Ctrl-C and SIGTERM taken over first (the package has, under `python
    -m`), so that one while loading the reward is one line too."""
    from tree_grpo_jax.rewards import starting_server

    starting_server()
    sys.exit(main())


if __name__ == "__main__":
    run()
