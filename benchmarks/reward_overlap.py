"""Scoring while the decoder works: one iteration's decode-and-score phase with a reward
served over HTTP, the leaves decoded in one part then scored (`reward_options.decode_chunks=1`)
against decoded in parts, each scored as it comes (the default 4), at two server latencies.

    python -m benchmarks.reward_overlap                        # 8 prompts x 4 leaves, this CPU
    python -m benchmarks.reward_overlap --smoke                # seconds: 2 x 2 small images
    python -m benchmarks.reward_overlap --out benchmarks/results   # the committed figures

The decoder is the flow families' VAE decoder (`models.autoencoder`, our Flax
AutoencoderKL) with random weights at reduced width, so a batch takes seconds on a CPU;
the reward is the package's remote client (`remote:<name>`) against the reference server's
handler on 127.0.0.1, whose scorer sleeps `latency` seconds per request and serves one
request at a time (a model on one device), as a scorer on another machine would take.
The phase is what `Trainer.iteration` runs between the rollout and the update
(`run/scoring.py`): the rollout and the update take the same time either way.

Three ways are timed: every leaf decoded at once, then scored (what `decode_chunks=1`
runs); decoded in parts, every part waited for, then scored (the parts' own effect on the
decoder's speed); and each part scored as it comes (the default). Also the decode and the
scoring alone. Figures: the median of `--reps` after one warm-up.
Results go to `<out>/reward_overlap.json`: `runs/benchmarks/reward_overlap` (git-ignored)
unless --out is given (with --smoke a temporary folder).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax.models import autoencoder
from tree_grpo_jax.rewards import registry, remote, serve
from tree_grpo_jax.run import scoring

LATENT_CHANNELS = 16


def vae_config(width: int) -> dict:
    """A four-level AutoencoderKL decoder (SD3's layout, `width` channels at every level)."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": LATENT_CHANNELS,
        "block_out_channels": [width] * 4,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "layers_per_block": 1,
        "norm_num_groups": min(32, width),
        "scaling_factor": 1.5305,
        "shift_factor": 0.0609,
        **autoencoder.FIXED,
    }


def make_decode(width: int, batch_size: int):
    config = vae_config(width)
    module = autoencoder.vae_module(config, Path("benchmarks/reward_overlap"), jnp.float32)
    params = {"decoder": module.init_weights(jax.random.PRNGKey(0))["decoder"]}
    decode = autoencoder.decode_fn(module, config, batch_size, jnp.float32)
    return lambda latents: decode(params, latents)


def slow_scorer(latency: float):
    def score(images, prompts, metadata):
        del prompts, metadata
        time.sleep(latency)
        return {"scores": np.asarray(images).mean(axis=(1, 2, 3))}

    return score


def remote_reward(url: str, batch_size: int, in_flight: int):
    s = {**remote.settings().to_dict(), "url": url, "batch_size": batch_size}
    s["in_flight"] = in_flight
    options = ml_collections.ConfigDict({"dtype": "float32", "chunk_size": 16, "remote": {"b": s}})
    return registry.load_rewards(["remote:b"], {}, options)["remote:b"]


def phase(decode, reward, latents, groups: int, parts: int, overlap: bool = True) -> float:
    """Seconds to decode `latents` in `parts` and score them (the trainer's phase); without
    `overlap`, every part is decoded before the first is scored."""
    prompts = ["a prompt"] * latents.shape[0]
    start = time.perf_counter()
    decoded = scoring.decode(decode, latents, groups, parts)
    if not overlap:
        jax.block_until_ready(decoded.chunks)
    scores, _, _ = scoring.scored(reward.with_frames_and_parts, decoded, prompts, None, True)
    np.asarray(scores)
    return time.perf_counter() - start


class _Reward:
    """The remote reward in the trainer's calling convention (scores, parts, frames)."""

    def __init__(self, reward):
        self.reward = reward

    def with_frames_and_parts(self, images, prompts, metadata):
        scores, frames, parts = self.reward.scored(images, prompts, metadata)
        return scores, parts, frames


def median(fn, reps: int) -> float:
    fn()  # warm-up: compiles the decode of this part's shape
    return statistics.median(fn() for _ in range(reps))


def at_latency(decode, latents, latency: float, args) -> dict:
    """The figures of one server latency (a server of its own)."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), serve.handler(slow_scorer(latency), threading.Lock())
    )
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        reward = _Reward(remote_reward(url, args.request_batch, args.in_flight))
        images = np.asarray(decode(latents))
        prompts = ["a prompt"] * len(images)
        decode_only = median(lambda: _timed(lambda: np.asarray(decode(latents))), args.reps)
        score_only = median(lambda: _timed(lambda: reward.reward(images, prompts)), args.reps)
        after = median(lambda: phase(decode, reward, latents, args.prompts, 1), args.reps)
        parts_then_score = median(
            lambda: phase(decode, reward, latents, args.prompts, args.parts, False), args.reps
        )
        overlapped = median(
            lambda: phase(decode, reward, latents, args.prompts, args.parts), args.reps
        )
    finally:
        server.shutdown()
        server.server_close()
    parts = scoring.chunk_count(args.leaves, args.parts)
    return {
        "latency_s": latency,
        "requests": -(-len(images) // args.request_batch),
        "decode_s": decode_only,
        "score_s": score_only,
        "after_decoding_s": after,  # one decode of every leaf, then the scoring
        "parts_then_score_s": parts_then_score,  # decoded in parts, scored after the last
        "overlapped_s": overlapped,  # each part scored as it comes
        "parts": parts,
        "saved_fraction": 1 - overlapped / after,
        "saved_by_overlap_fraction": 1 - overlapped / parts_then_score,
    }


def run(args) -> dict:
    decode = make_decode(args.width, args.decode_batch)
    h = args.size // 8
    shape = (args.prompts * args.leaves, LATENT_CHANNELS, h, h)
    latents = jax.random.normal(jax.random.PRNGKey(1), shape)
    rows = []
    for latency in args.latencies:
        row = at_latency(decode, latents, latency, args)
        rows.append(row)
        print(
            f"latency {latency:5.2f} s/request: decode {row['decode_s']:6.2f} s, score "
            f"{row['score_s']:6.2f} s | after decoding {row['after_decoding_s']:6.2f} s, "
            f"in {row['parts']} parts then scored {row['parts_then_score_s']:6.2f} s, "
            f"overlapped {row['overlapped_s']:6.2f} s ({100 * row['saved_fraction']:4.1f}% "
            f"less than after decoding, {100 * row['saved_by_overlap_fraction']:4.1f}% less "
            "than the parts scored after the last)",
            flush=True,
        )
    return {
        "images": [len(latents), args.size, args.size, 3],
        "prompts": args.prompts,
        "leaves": args.leaves,
        "vae_width": args.width,
        "request_batch": args.request_batch,
        "in_flight": args.in_flight,
        "reps": args.reps,
        "cpu_count": os.cpu_count(),
        "device": jax.devices()[0].device_kind,
        "rows": rows,
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--leaves", type=int, default=4, help="leaves per prompt")
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument("--width", type=int, default=32, help="the decoder's channels per level")
    p.add_argument("--decode_batch", type=int, default=4, help="latents through the VAE at once")
    p.add_argument("--parts", type=int, default=4, help="reward_options.decode_chunks")
    p.add_argument("--request_batch", type=int, default=4, help="images per request")
    p.add_argument("--in_flight", type=int, default=2, help="requests in flight")
    p.add_argument("--latencies", type=float, nargs="+", default=[0.25, 1.0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 prompts x 2 leaves of 32x32, one rep")
    p.add_argument("--out", default=None, help="results folder")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.leaves, args.size, args.width = 2, 2, 32, 8
        args.parts, args.reps, args.latencies = 2, 1, [0.01]
    out = args.out or (
        tempfile.mkdtemp() if args.smoke else os.path.join("runs", "benchmarks", "reward_overlap")
    )
    record = run(args)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "reward_overlap.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
