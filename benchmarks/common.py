"""What every benchmark shares: the presets compared and their labels, statistics, a denoiser
that counts its rows, a stand-in model for smoke runs, and writing results."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import DDIMScheduleConfig, TextToImageModel

# The committed results that BENCHMARKS.md and docs/benchmarks.md cite. A script writes
# there only when told to (`--out=benchmarks/results`); by default it writes under RUNS_DIR.
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Where a script's results go by default: `runs/` (git-ignored) of the working directory, as
# the trainer's runs do.
RUNS_DIR = os.path.join("runs", "benchmarks")


def default_out(name: str) -> str:
    """A script's default results folder, `runs/benchmarks/<name>`, outside the tracked files."""
    return os.path.join(RUNS_DIR, name)


# ---------------------------------------------------------------------------------------------
# The presets, all at 16 leaves per prompt and 10 denoising steps.

SPLIT_STEPS = (0, 2, 4, 6)  # BranchGRPO's (0, 3, 6, 9) of 20 steps, on 10 steps
DEPTH_PRUNED = (8, 9)  # BranchGRPO's example window (depths 15-18 of 20), on 10 steps

PRESETS: dict[str, dict] = {
    "grpo": {"tree.method": "grpo", "tree.group_size": 16},
    "mixgrpo": {"tree.method": "mixgrpo", "tree.group_size": 16, "tree.window": 4},
    "treegrpo": {"tree.method": "treegrpo", "tree.window": 4, "tree.k": 2},
    "branchgrpo": {"tree.method": "branchgrpo", "tree.split_steps": SPLIT_STEPS, "tree.k": 2},
    "branchgrpo_depth": {
        "tree.method": "branchgrpo",
        "tree.split_steps": SPLIT_STEPS,
        "tree.k": 2,
        "advantage.depth_pruning": DEPTH_PRUNED,
    },
    "branchgrpo_width": {
        "tree.method": "branchgrpo",
        "tree.split_steps": SPLIT_STEPS,
        "tree.k": 2,
        "advantage.width_pruning": "top_per_branch",
        "advantage.width_pruning_ratio": 0.5,
    },
    "branchgrpo_mix": {
        "tree.method": "branchgrpo_mix",
        "tree.split_steps": SPLIT_STEPS,
        "tree.k": 2,
        "tree.window": 4,
    },
}
# Presets of flow models only (the suite of `benchmarks.run` trains the DDIM model): 16 ODE
# samples per prompt, or treegrpo's 16 leaves.
FLOW_PRESETS: dict[str, dict] = {
    "diffusion_nft": {"tree.method": "diffusion_nft", "tree.group_size": 16},
    "diffusion_nft_tree": {"tree.method": "diffusion_nft_tree", "tree.window": 4, "tree.k": 2},
    "awm": {"tree.method": "awm", "tree.group_size": 16},
    "dgpo": {"tree.method": "dgpo", "tree.group_size": 16},
    "dpo": {"tree.method": "dpo", "tree.group_size": 16},
    "crd": {"tree.method": "crd", "tree.group_size": 16},
}

LABELS = {
    "grpo": "grpo",
    "mixgrpo": "mixgrpo (window 4)",
    "treegrpo": "treegrpo (w=4, k=2)",
    "branchgrpo": "branchgrpo (splits 0,2,4,6)",
    "branchgrpo_depth": "branchgrpo + depth pruning (8, 9)",
    "branchgrpo_width": "branchgrpo + width pruning (top 0.5)",
    "branchgrpo_mix": "branchgrpo_mix (window 4)",
    "diffusion_nft": "diffusion_nft (16 ODE samples)",
    "diffusion_nft_tree": "diffusion_nft on treegrpo's tree (w=4, k=2)",
    "awm": "awm (16 ODE samples)",
    "dgpo": "dgpo (16 ODE samples)",
    "dpo": "dpo (16 ODE samples, best against worst)",
    "crd": "crd (16 ODE samples)",
}


# ---------------------------------------------------------------------------------------------
# Statistics and timing.


def stats(values: Sequence[float]) -> dict:
    """Median, min, max and count of a sample."""
    values = [float(v) for v in values]
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def timed(fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """(seconds, result) of `fn(*args)`, blocking until its arrays are computed."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return time.perf_counter() - start, out


def fmt_stats(s: dict, digits: int = 3) -> str:
    """`median [min, max]`."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


# ---------------------------------------------------------------------------------------------
# Counting denoiser rows while running.


class RowCounter:
    """Adds up the rows every call of a wrapped denoiser sees, per phase.

    The count is taken by a `jax.debug.callback` inside the jitted code, so it counts what
    really ran (every scan iteration, every minibatch), not what was traced.
    """

    def __init__(self):
        self.rows = collections.Counter()
        self.calls = collections.Counter()
        self._phase = "other"

    def add(self, rows: int) -> None:
        self.rows[self._phase] += rows
        self.calls[self._phase] += 1

    @contextlib.contextmanager
    def phase(self, name: str):
        jax.effects_barrier()
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            jax.effects_barrier()
            self._phase = previous

    def reset(self) -> None:
        self.rows.clear()
        self.calls.clear()


def counting_denoiser(denoise_fn, counter: RowCounter):
    """`denoise_fn` that reports its batch size to `counter` each time it runs.

    The callback takes one element of `x` as an operand so that it stays inside loops and
    runs once per executed call (a callback without operands may be hoisted out of a scan).
    """

    def denoise(params, x, t, cond):
        rows = x.shape[0]
        jax.debug.callback(lambda _: counter.add(rows), x[(0,) * x.ndim])
        return denoise_fn(params, x, t, cond)

    return denoise


@contextlib.contextmanager
def smoke_rng():
    """Non-partitionable threefry for smoke runs: the engine's random draws then compile
    several times faster on CPU. It changes which random numbers a key gives, not what they
    cost to draw, so smoke runs (a check of the code, not a measurement) use it; the quick
    and full suites keep JAX's default."""
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_partitionable", before)


def with_denoiser(model: TextToImageModel, denoise_fn) -> TextToImageModel:
    return dataclasses.replace(model, denoise=denoise_fn)


# ---------------------------------------------------------------------------------------------
# A stand-in model: the tiny model's interface around a two-parameter denoiser. It compiles in
# a fraction of a second, so smoke runs exercise every code path of the suite quickly.

_STANDIN_TOKENS, _STANDIN_WIDTH = 4, 8


def _standin_denoise(params, x, t, cond):
    shift = jnp.mean(cond, axis=(1, 2)).reshape(-1, *([1] * (x.ndim - 1)))
    scale = 1.0 + 1e-4 * t.astype(jnp.float32).reshape(shift.shape)
    return params["w"] * x * scale + params["b"] * shift


def _standin_encode(prompts: Sequence[str]) -> jax.Array:
    from tree_grpo_jax.models.tiny.grammar import prompt_digit

    def digit(p):
        try:
            return prompt_digit(p)
        except ValueError:
            return -1

    codes = np.asarray([digit(p) for p in prompts], np.float32)
    emb = np.broadcast_to(
        codes[:, None, None] / 10.0, (len(codes), _STANDIN_TOKENS, _STANDIN_WIDTH)
    )
    return jnp.asarray(emb, jnp.float32)


def standin_model() -> TextToImageModel:
    from tree_grpo_jax.models.tiny import networks

    return TextToImageModel(
        name="standin",
        sample_shape=networks.SAMPLE_SHAPE,
        params={"w": jnp.float32(0.5), "b": jnp.float32(0.1)},
        denoise=_standin_denoise,
        encode_prompts=_standin_encode,
        decode=networks.decode,
        schedule_config=DDIMScheduleConfig(),
    )


# ---------------------------------------------------------------------------------------------
# Results.


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    device = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "devices": jax.device_count(),
    }


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return _plain(value.tolist())
    if isinstance(value, jax.Array):
        return _plain(np.asarray(value).tolist())
    return value


def save_json(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(_plain(payload), f, indent=2)
        f.write("\n")
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
