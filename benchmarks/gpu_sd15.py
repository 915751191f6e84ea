"""The Stable Diffusion 1.5 UNet on one accelerator: rollout throughput, train-step time, peak
memory and achieved TFLOP/s, for grpo and treegrpo, and the batched engine against a
node-at-a-time loop at this size, and the reward models' scoring throughput (section
`rewards`: ViT-L/14 and ViT-H/14, bf16, 16 images of 512x512 per call).

    python -m benchmarks.gpu_sd15           # SD1.5 size, bf16: one 10-minute run on one H200
    python -m benchmarks.gpu_sd15 --smoke   # the same code on a tiny UNet, on CPU

The UNet is the trainer's SD UNet built by `tree_grpo_jax.models.sd15.unet_module` from SD1.5's
config, with random weights (timing does not need trained ones); prompts are random text
embeddings [P, 77, 768], and no text encoder or VAE runs. The model is handed to
`train.setup`, and everything is timed through the trainer's own methods. Master weights are
float32 and the UNet computes in bfloat16, as the trainer's `model.compute_dtype="bfloat16"` does.
FLOPs are XLA's own count (`cost_analysis()` of the lowered computation); achieved TFLOP/s is
that count over the measured time, and utilisation is against the chip's dense bf16 peak.

Sections run in order and each is written to `<out>/gpu_sd15.json` as soon as it finishes; a
section that would start after `--time-limit` seconds is skipped and marked so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax import train

SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=(
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
)
# SD1.5's block types and conditioning at a tiny size (two levels): checks the code on a CPU.
SMOKE_UNET = dict(
    SD15_UNET,
    sample_size=8,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    attention_head_dim=2,
    cross_attention_dim=32,
)
TEXT_TOKENS = 77

# Dense bf16 peak per chip, TFLOP/s (vendor figures, no sparsity).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v5e": 197.0}


def peak_tflops(device_kind: str, override: float | None) -> float | None:
    if override:
        return override
    for name, peak in PEAK_BF16_TFLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny UNet, few steps: runs on CPU")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default 2)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 10)")
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--train-rows", type=int, default=None, help="rows per train step (default 8)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3)")
    p.add_argument("--time-limit", type=float, default=540.0, help="skip sections after this")
    p.add_argument("--peak-tflops", type=float, default=None, help="the chip's bf16 peak")
    p.add_argument(
        "--memory-efficient-attention",
        action="store_true",
        help="diffusers' chunked attention (the trainer's `load_sd` option; off by default)",
    )
    p.add_argument("--split-head-dim", action="store_true", help="diffusers' split_head_dim")
    p.add_argument(
        "--sections",
        default="flops,rollout,train,node_loop,rewards",
        help="comma-separated subset of flops,rollout,train,node_loop,rewards",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The model.


def build_unet(config: dict, dtype, **options):
    from tree_grpo_jax.models.sd15.unet import unet_module

    return unet_module(config, dtype, **options)


def random_params(unet, config: dict, seed: int = 0):
    """Float32 random weights in the UNet's shapes: fan-in scaled normal kernels, unit
    scales, zero biases; drawn on the host in numpy (no compile of the UNet's init)."""
    size = config["sample_size"]
    shapes = jax.eval_shape(
        unet.init,
        jax.random.PRNGKey(0),
        jnp.zeros((1, config["in_channels"], size, size)),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, TEXT_TOKENS, config["cross_attention_dim"])),
    )["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":
            fan_in = int(np.prod(leaf.shape[:-1]))
            values = rng.standard_normal(leaf.shape, dtype=np.float32) / np.sqrt(fan_in)
        else:
            values = np.full(leaf.shape, 1.0 if name == "scale" else 0.0, np.float32)
        return jnp.asarray(values)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=4)
def make_denoise(unet):
    def denoise(params, x, t, cond):
        return unet.apply({"params": params}, x, t, cond).sample

    return denoise


def count_params(params) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(params)))


# ---------------------------------------------------------------------------------------------
# Measurements.


def flops_of(lowered) -> float | None:
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def memory() -> dict | None:
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def timed(fn, reps: int):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times


def summary(times) -> dict:
    return {"median": float(np.median(times)), "min": float(min(times)), "max": float(max(times))}


class Bench:
    """Holds the model and inputs; each section adds to `results` and saves them."""

    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.config = SMOKE_UNET if self.smoke else SD15_UNET
        self.prompts = args.prompts or (1 if self.smoke else 2)
        self.steps = args.steps or (4 if self.smoke else 10)
        self.train_rows = args.train_rows or (2 if self.smoke else 8)
        self.reps = args.reps or (1 if self.smoke else 3)
        self.window = 2 if self.smoke else 4
        self.group = 2**self.window  # grpo chains = treegrpo leaves
        self.deadline = time.perf_counter() + args.time_limit
        self.start = time.perf_counter()
        from benchmarks.common import RESULTS_DIR

        self.out = args.out or RESULTS_DIR
        os.makedirs(self.out, exist_ok=True)
        self.path = os.path.join(self.out, "gpu_sd15_smoke.json" if self.smoke else "gpu_sd15.json")
        device = jax.devices()[0]
        self.device_kind = getattr(device, "device_kind", str(device))
        self.peak = peak_tflops(self.device_kind, args.peak_tflops)
        self.results = {
            "command": "python -m benchmarks.gpu_sd15 " + " ".join(sys.argv[1:]),
            "device": self.device_kind,
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "peak_bf16_tflops": self.peak,
            "unet": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config.items()},
            "prompts": self.prompts,
            "steps": self.steps,
            "guidance_scale": args.guidance,
            "memory_efficient_attention": args.memory_efficient_attention,
            "split_head_dim": args.split_head_dim,
            "leaves_per_prompt": self.group,
            "train_rows": self.train_rows,
            "sections": {},
        }

    def log(self, message: str) -> None:
        print(f"[gpu_sd15 {time.perf_counter() - self.start:6.1f}s] {message}", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.start
        self.results["memory"] = memory()
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=2)
            f.write("\n")

    def section(self, name: str, fn) -> None:
        if time.perf_counter() > self.deadline:
            self.results["sections"][name] = {"skipped": "time limit"}
            self.log(f"{name}: skipped (time limit)")
        else:
            try:
                self.results["sections"][name] = fn()
            except Exception as e:  # noqa: BLE001 - record it and go on to the next section
                traceback.print_exc()
                self.results["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
        self.save()

    # -- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        from tree_grpo_jax.models.base import DDIMScheduleConfig, TextToImageModel

        t0 = time.perf_counter()
        self.unet = build_unet(
            self.config,
            jnp.bfloat16,
            use_memory_efficient_attention=self.args.memory_efficient_attention,
            split_head_dim=self.args.split_head_dim,
        )
        self.params = random_params(self.unet, self.config)
        jax.block_until_ready(self.params)
        self.denoise = make_denoise(self.unet)
        size, channels = self.config["sample_size"], self.config["in_channels"]
        self.sample_shape = (channels, size, size)
        width = self.config["cross_attention_dim"]

        def encode_prompts(prompts):
            # Random text embeddings, one fixed draw per prompt position ("" is position 0).
            keys = jax.random.split(jax.random.PRNGKey(1), len(prompts))
            draw = lambda k: jax.random.normal(k, (TEXT_TOKENS, width), jnp.float32)  # noqa: E731
            return jax.vmap(draw)(keys)

        # The trainer is handed this model: SD1.5's UNet, random weights, no text encoder or
        # VAE (timing needs neither); its DDIM schedule is SD1.5's.
        self.model = TextToImageModel(
            name="sd15-architecture-random",
            sample_shape=self.sample_shape,
            params=self.params,
            denoise=self.denoise,
            encode_prompts=encode_prompts,
            decode=lambda latents: latents,
            schedule_config=DDIMScheduleConfig(),
        )
        self.prompt_texts = [f"prompt {i}" for i in range(self.prompts)]
        self.trainers = {}
        for name in ("grpo", "treegrpo"):
            trainer, state = train.setup(self.method_config(name), self.out, model=self.model)
            self.trainers[name] = (trainer, state)
        self.results["params"] = count_params(self.params)
        self.results["setup_s"] = time.perf_counter() - t0
        self.log(f"UNet {self.results['params'] / 1e6:.0f}M params on {self.device_kind}")

    def method_config(self, method: str):
        from configs import base

        c = base.get_config()
        c.tree.method = method
        c.tree.group_size = self.group
        c.tree.window = self.window
        c.tree.k = 2
        c.sampling.num_steps = self.steps
        c.sampling.guidance_scale = self.args.guidance
        c.prompts.source = "animals"
        c.prompts.batch_size = self.prompts
        c.prompts.eval_count = 1
        c.rewards = "jpeg_compressibility"  # not called: rewards here are random numbers
        c.train.rows_per_minibatch = self.train_rows
        c.train.learning_rate = 1e-5
        c.mesh.data, c.mesh.fsdp = 1, 1
        return c

    # -- sections --------------------------------------------------------------------------
    def flops(self) -> dict:
        rows = 2
        x = jnp.zeros((rows, *self.sample_shape), jnp.float32)
        t = jnp.zeros((rows,), jnp.int32)
        cond = jnp.zeros((rows, TEXT_TOKENS, self.config["cross_attention_dim"]))
        lowered = jax.jit(self.denoise).lower(self.params, x, t, cond)
        flops = flops_of(lowered)
        self.flops_per_row = flops / rows if flops else None
        self.log(f"UNet forward: {gflops(self.flops_per_row)} GFLOP per row (XLA count)")
        return {"unet_forward_flops_per_row": self.flops_per_row}

    def tflops(self, flops, seconds) -> dict:
        if not flops:
            return {"achieved_tflops": None, "utilisation": None}
        achieved = flops / seconds / 1e12
        return {
            "achieved_tflops": achieved,
            "utilisation": achieved / self.peak if self.peak else None,
        }

    def rollout(self) -> dict:
        out = {}
        self.rollouts = {}
        for name, (trainer, state) in self.trainers.items():
            if time.perf_counter() > self.deadline:
                out[name] = {"skipped": "time limit"}
                continue
            spec = trainer.spec().at(trainer.window_start(0))

            def go(trainer=trainer, state=state):
                return trainer.rollout(state.params, self.prompt_texts, jax.random.PRNGKey(0))

            first, times = timed(lambda go=go: go().tree.leaves, self.reps)
            self.rollouts[name] = go()
            rows = spec.rollout_denoiser_calls(True) * self.prompts
            med = float(np.median(times))
            flops = rows * self.flops_per_row if getattr(self, "flops_per_row", None) else None
            out[name] = {
                "spec": spec.describe(),
                "leaves": spec.leaves * self.prompts,
                "denoiser_rows": rows,
                "widest_call_rows": max(spec.nodes_in) * self.prompts * 2,
                "first_call_s": first,
                "time_s": summary(times),
                "denoiser_rows_per_s": rows / med,
                "leaves_per_s": spec.leaves * self.prompts / med,
                **self.tflops(flops, med),
                "memory_after": memory(),
            }
            self.log(
                f"rollout {name}: {rows} rows in {med:.3f} s = {rows / med:.0f} rows/s, "
                f"{spec.leaves * self.prompts / med:.1f} images/s (first call {first:.0f} s)"
            )
        for name in ("grpo", "treegrpo"):
            if name in out and "time_s" in out[name] and "time_s" in out["grpo"]:
                out[name]["time_vs_grpo"] = (
                    out[name]["time_s"]["median"] / out["grpo"]["time_s"]["median"]
                )
        return out

    def train(self) -> dict:
        from tree_grpo_jax import sharding, transitions

        out = {}
        for name, sampled in getattr(self, "rollouts", {}).items():
            if time.perf_counter() > self.deadline:
                out[name] = {"skipped": "time limit"}
                continue
            trainer, state = self.trainers[name]
            spec = sampled.spec
            rewards = jax.random.normal(jax.random.PRNGKey(3), (self.prompts, spec.leaves))
            rows = trainer.trainable_rows(sampled, rewards)
            batch = transitions.minibatches(rows, jax.random.PRNGKey(4), self.train_rows)[0]
            batch = sharding.shard_batch(trainer.mesh, batch)
            step = trainer.train_step
            args = (sampled.cond, trainer.schedule(), trainer.uncond, None, jnp.float32(1e-5))
            flops = flops_of(step.lower(state, batch, *args))
            holder = {"state": state}

            def go(holder=holder, step=step, batch=batch, args=args):
                holder["state"], metrics = step(holder["state"], batch, *args)
                return metrics["loss"]

            first, times = timed(go, self.reps)
            med = float(np.median(times))
            edges = int(np.sum(batch.mask))
            out[name] = {
                "rows": self.train_rows,
                "unet_rows": self.train_rows * 2,
                "actions_per_row": int(batch.mask.shape[1]),
                "trained_edges": edges,
                "first_call_s": first,
                "time_s": summary(times),
                "edges_per_s": edges / med,
                "train_step_flops": flops,
                **self.tflops(flops, med),
                "memory_after": memory(),
            }
            self.log(
                f"train step {name}: {self.train_rows} rows ({edges} edges) in {med:.3f} s, "
                f"{out[name]['achieved_tflops'] or 0:.0f} TFLOP/s, peak memory "
                f"{gib((memory() or {}).get('peak_bytes_in_use'))} (first call {first:.0f} s)"
            )
            self.trainers[name] = (trainer, holder["state"])
            del holder
        return out

    def node_loop(self) -> dict:
        from benchmarks import node_loop

        trainer, state = self.trainers["treegrpo"]
        r = node_loop.compare(
            self.denoise, state.params, self.model.encode_prompts(self.prompt_texts[:1]),
            trainer.schedule(), trainer.spec().at(0), self.sample_shape, uncond=trainer.uncond,
            guidance_scale=self.args.guidance, reps=self.reps,
        )  # fmt: skip
        self.log(
            f"treegrpo rollout, 1 prompt: engine {r['engine_s']['median']:.3f} s, node loop "
            f"{r['loop_s']['median']:.3f} s: {r['speedup_of_medians']:.1f}x"
        )
        return r

    def rewards(self) -> dict:
        """The reward models beside the UNet: ViT-L/14 and ViT-H/14 scoring throughput on
        decoded 512x512 images, in bfloat16 as configs/sd15_hps.py runs them."""
        from benchmarks import rewards

        batch = 2 if self.smoke else 16
        argv = ["--batch", str(batch), "--dtype", "bfloat16", "--reps", str(self.reps)]
        if self.smoke:  # small decoded images too: the smoke run checks the code
            argv += ["--smoke", "--image-size", "64"]
        args = rewards.parse_args(argv)
        fields = {n: rewards.SMOKE if self.smoke else f for n, f in rewards.ARCHITECTURES.items()}
        return {name: rewards.measure(name, f, args) for name, f in fields.items()}


def gflops(flops_per_row) -> str:
    return "n/a" if not flops_per_row else f"{flops_per_row / 1e9:.0f}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    from benchmarks.common import smoke_rng

    with smoke_rng() if args.smoke else contextlib.nullcontext():
        bench = Bench(args)
        bench.setup()
        bench.save()
        chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
        for name in ("flops", "rollout", "train", "node_loop", "rewards"):
            if name in chosen:
                bench.section(name, getattr(bench, name))
    bench.log(f"done; results in {bench.path}")
    return bench.results


if __name__ == "__main__":
    main()
