"""The remote rewards' two image formats on the wire, raw uint8 and PNG: seconds to send a
batch to a scorer that does nothing (encoding, the request, the server's decoding, the
answer) through the client and the reference server on 127.0.0.1, and the bytes sent.

    python -m benchmarks.remote_wire                    # 16 images of 512x512x3, this CPU
    python -m benchmarks.remote_wire --smoke            # 2 images of 64x64: seconds
    python -m benchmarks.remote_wire --out benchmarks/results   # updates the committed results

Two kinds of image: smooth (a gradient with mild noise, as decoded images mostly are) and
uniform noise (PNG's worst case). Figures: the median over `--reps` calls after one warm-up.
Results go to `<out>/remote_wire.json`: `runs/benchmarks/remote_wire` (git-ignored) unless
--out is given (with --smoke a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import ml_collections
import numpy as np

from tree_grpo_jax.rewards import registry, remote, serve


def nothing(images, prompts, metadata):
    """The scorer the benchmark serves: zeros, so the figures are the wire's alone."""
    del prompts, metadata
    return np.zeros(len(images))


def images_of(kind: str, count: int, size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "noise":
        return rng.uniform(size=(count, size, size, 3)).astype(np.float32)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    base = (ramp[None, :, None, None] + ramp[None, None, :, None]) / 2
    smooth = base * rng.uniform(0.5, 1, size=(count, 1, 1, 3)).astype(np.float32)
    return np.clip(smooth + rng.normal(0, 0.02, smooth.shape).astype(np.float32), 0, 1)


def measure(url: str, fmt: str, images: np.ndarray, reps: int, batch_size: int) -> dict:
    options = {
        "dtype": "float32",
        "chunk_size": 16,
        "remote": {"b": {**remote.settings().to_dict(), "url": url, "format": fmt}},
    }
    options = ml_collections.ConfigDict(options)
    options.remote.b.batch_size = batch_size
    reward = registry.load_rewards(["remote:b"], {}, options)["remote:b"]
    prompts = ["a prompt"] * len(images)
    reward(images, prompts)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        reward(images, prompts)
        times.append(time.perf_counter() - start)
    u8 = remote.to_uint8(images)
    start = time.perf_counter()
    body = remote.request_body(u8, prompts, [None] * len(u8), fmt)
    encode = time.perf_counter() - start
    return {
        "seconds_per_batch": statistics.median(times),
        "encode_seconds": encode,
        "request_megabytes": len(body) / 1e6,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=16, help="images per batch")
    p.add_argument("--size", type=int, default=512, help="image side in pixels")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="2 images of 64x64, one rep")
    p.add_argument("--out", default=None, help="results folder")
    args = p.parse_args(argv)
    if args.smoke:
        args.count, args.size, args.reps = 2, 64, 1
    out = args.out or (
        tempfile.mkdtemp() if args.smoke else os.path.join("runs", "benchmarks", "remote_wire")
    )
    flags = serve.parser().parse_args(["--callable=benchmarks.remote_wire:nothing", "--port=0"])
    server, _ = serve.make_server(flags)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    results = {}
    try:
        for kind in ("smooth", "noise"):
            images = images_of(kind, args.count, args.size)
            for fmt in remote.FORMATS:
                r = measure(url, fmt, images, args.reps, batch_size=args.count)
                results[f"{kind}/{fmt}"] = r
                print(
                    f"{kind:6s} {fmt:4s}: {r['seconds_per_batch'] * 1e3:8.1f} ms per batch of "
                    f"{args.count} ({r['encode_seconds'] * 1e3:.1f} ms encoding), "
                    f"{r['request_megabytes']:.2f} MB sent",
                    flush=True,
                )
    finally:
        server.shutdown()
        server.server_close()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "remote_wire.json")
    record = {
        "images": [args.count, args.size, args.size, 3],
        "reps": args.reps,
        "png_compress_level": remote.PNG_LEVEL,
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
