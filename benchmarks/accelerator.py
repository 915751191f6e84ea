"""The accelerator benchmark: every model of the table in `benchmarks/random_models.py`
(SD1.5's UNet, SD3.5 Medium's MMDiT-X, FLUX.1-dev's transformer) on this machine's devices, timed
through the library's own entry points (`train.setup(config, workdir, model=...)`,
`Trainer.rollout`, the trainer's jitted train step).

    python -m benchmarks.accelerator                    # 512 px, bf16: sized for < 8 min, one H200
    python -m benchmarks.accelerator --models sd35m --resolution 720
    python -m benchmarks.accelerator --smoke --out DIR  # tiny models on a CPU: checks the code
    python -m benchmarks.accelerator --out benchmarks/results   # updates the committed results

Sections of each model:
  flops      XLA's FLOP count of one denoiser row (`cost_analysis()` of the lowered forward)
  rollout    treegrpo (w=4, k=2) and grpo (16 chains), 16 leaves per prompt: seconds per
             prompt's tree, denoiser rows and images per second, model FLOP utilisation
  train      one train step on rows gathered from the treegrpo rollout (`--train-methods`
             adds grpo's): seconds per row, utilisation, the compiled program's memory
  node_loop  the treegrpo rollout against a node-at-a-time loop of the same tree
and once, `rewards`: the CLIP reward towers' scoring throughput (one device).

Weights are random (timing needs no trained ones), float32 masters with bfloat16 compute;
prompts are random embeddings of the text encoders' shapes, and no text encoder or VAE runs.
Each model keeps its repository config's training settings (guidance, remat). Utilisation is
XLA's FLOP count over the measured seconds over the devices' dense bf16 peak. Peak device
memory is the process's high-water mark when a section ends (`memory_stats()`; None on a
CPU); the train step's own is XLA's plan of its program. With several devices the trainer
splits the rollout and the train step over all of them, and the figures are the mesh's.

The run goes in order of importance: every model's treegrpo rollout and train step, then
every model's grpo rollout, then the node loops, then the rewards. A section that would start
after `--time-limit` seconds (default 390; the longest, an SD3.5-M rollout's first call, is
expected to take one to two minutes) is skipped and marked. Results go to
`<out>/accelerator.json`, saved as each section finishes, and the headline figures to
`<out>/accelerator.md`; `<out>` is `runs/benchmarks/accelerator` (git-ignored, under the
working directory; a temporary folder with `--smoke`) unless `--out` is given, and the
committed results in `benchmarks/results/` change only with `--out benchmarks/results`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import random_models
from benchmarks.common import PRESETS, default_out, markdown_table
from tree_grpo_jax.errors import OneLineErrors
from tree_grpo_jax.models.base import remat_mode
from tree_grpo_jax.plan import accelerators
from tree_grpo_jax.plan.program_cost import program_cost
from tree_grpo_jax.run import memory

METHODS = ("treegrpo", "grpo")  # the tree first: a run cut short keeps it
# Trained by default: a train step costs about the same per row whichever tree its rows come
# from (only the actions per row differ), and each method's step is one more long compile.
TRAINED = ("treegrpo",)
LEAVES = 16  # per prompt, in every preset of PRESETS
SMOKE_LEAVES = 2  # a smoke run's: one branch step of two children, or two chains
SMOKE_TOWER = "vit_l14"  # the reward tower a smoke run measures, at a tiny size
SECTIONS = ("flops", "rollout", "train", "node_loop", "rewards")
# A device kind (as JAX names it) -> the plan's accelerator (plan/accelerators.py): dense bf16
# peak and bandwidth from the data sheets. First match wins: "TPU v5 lite" is a v5e.
DEVICE_KINDS = (
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
    ("B200", "b200"),
    ("TPU v5 lite", "tpu-v5e"),
    ("TPU v5e", "tpu-v5e"),
    ("TPU v5", "tpu-v5p"),
    ("TPU v6", "tpu-v6e"),
)


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    built = [a.name for a in random_models.ARCHITECTURES if a.build]
    p.add_argument("--smoke", action="store_true", help="tiny models, few steps: runs on CPU")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default runs/benchmarks/accelerator; smoke: a temporary one; "
        "benchmarks/results updates the committed results)",
    )
    p.add_argument("--models", default=",".join(built), help=f"a subset of {','.join(built)}")
    p.add_argument("--resolution", type=int, default=None, help="image side, px (default 512)")
    p.add_argument(
        "--prompts", type=int, default=None, help="prompts per rollout (default max(2, devices))"
    )
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 10)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: config's)")
    p.add_argument(
        "--train-rows", type=int, default=None, help="rows per train step (SD1.5 8, SD3.5-M 2)"
    )
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 2)")
    p.add_argument(
        "--time-limit", type=float, default=390.0, help="seconds; no section starts after"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="a device's bf16 peak")
    p.add_argument(
        "--memory-efficient-attention",
        action="store_true",
        help="SD1.5: chunked attention (the loader's option; off by default)",
    )
    p.add_argument("--split-head-dim", action="store_true", help="SD1.5: split_head_dim")
    p.add_argument(
        "--mmdit-attention",
        choices=("xla", "cudnn"),
        default="xla",
        help="SD3.5: jax.nn.dot_product_attention's implementation",
    )
    p.add_argument(
        "--train-methods",
        default=",".join(TRAINED),
        help=f"the methods whose train step is timed, a subset of {','.join(METHODS)}",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"a subset of {','.join(SECTIONS)} (train also runs its rollout)",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Measurements.


def peak_tflops(device_kind: str, override: float | None) -> float | None:
    if override:
        return override
    for kind, name in DEVICE_KINDS:
        if kind.lower() in device_kind.lower():
            return accelerators.ACCELERATORS[name].peak_flops / 1e12
    return None


def flops_of(compiled, devices: int = 1) -> float | None:
    """The FLOPs of a compiled program on all its `devices`, every loop counted (XLA's own
    `cost_analysis()` counts a scanned block or step once); None where the backend gives no
    cost analysis."""
    try:
        return program_cost(compiled).flops * devices
    except Exception:  # noqa: BLE001 - a backend without cost analysis
        return None


def device_memory() -> dict | None:
    """The local devices' memory: the largest peak and use, the smallest limit."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    stats = [s for s in stats if s]
    if not stats:
        return None
    out = {}
    for key, pick in (("peak_bytes_in_use", max), ("bytes_in_use", max), ("bytes_limit", min)):
        if all(key in s for s in stats):
            out[key] = int(pick(s[key] for s in stats))
    return out


def program_memory(compiled) -> dict | None:
    """What XLA planned for one device: arguments, outputs, temporaries, and their peak (their
    sum less the outputs written into donated arguments)."""
    stats = memory.read(compiled)
    if stats is None:
        return None
    out = {f"{f}_bytes": getattr(stats, f) for f in ("argument", "output", "alias", "temp")}
    out["peak_bytes"] = stats.peak
    return out


def shortfall(planned: dict | None) -> str:
    """Why a compiled program cannot run beside what the devices already hold ("" if it can):
    its arguments are resident, the rest of its plan must fit in what is free."""
    memory = device_memory()
    if not planned or not memory or "bytes_limit" not in memory:
        return ""
    free = memory["bytes_limit"] - memory.get("bytes_in_use", 0)
    needed = planned["peak_bytes"] - planned["argument_bytes"]
    if needed <= free:
        return ""
    return f"the program needs {gib(needed)} beyond its arguments per device, {gib(free)} is free"


def timed(fn, reps: int):
    """(first call's seconds, the timed calls' seconds, the last result)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times, result


def summary(times) -> dict:
    return {"median": float(np.median(times)), "min": float(min(times)), "max": float(max(times))}


def gib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# One model.


class ModelBench:
    """One built model: its trainers, one method at a time, and its sections."""

    def __init__(self, run: Run, arch: random_models.Architecture, built: random_models.Built):
        self.run, self.arch, self.built = run, arch, built
        self.model = built.model
        self.train_rows = run.train_rows(arch)
        self.trainers = {}
        self.flops_per_row = None
        self.live = None  # (method, trainer, state, rollout) of the method being measured

    def log(self, message: str) -> None:
        self.run.log(f"{self.arch.name}: {message}")

    def config(self, method: str):
        run = self.run
        c = importlib.import_module(self.arch.config).get_config()
        for path, value in PRESETS[method].items():
            section, field = path.split(".")
            c[section][field] = value
        if run.smoke:  # one branch step
            c.tree.window, c.tree.group_size = 1, SMOKE_LEAVES
        c.tree.window_slide_every = 0
        c.sampling.num_steps = run.steps
        if run.args.guidance is not None:
            c.sampling.guidance_scale = run.args.guidance
        c.prompts.batch_size = run.prompts
        c.prompts.eval_count = 1
        c.rewards = "jpeg_compressibility"  # never called: the rewards here are random numbers
        c.eval.extra_rewards = ()
        c.train.rows_per_minibatch = self.train_rows
        c.train.grad_accumulation = 1  # every step is a whole update
        c.train.kl_beta = 0.0
        c.mesh.data, c.mesh.fsdp = -1, 1  # every device
        c.log.progress = False
        c.log.tensorboard = False
        return c

    def guidance_scale(self) -> float:
        return float(self.config("treegrpo").sampling.guidance_scale)

    # -- sections --------------------------------------------------------------------------
    def flops(self) -> dict:
        rows = 2
        schedule = self.model.make_schedule(self.run.steps, self.config("treegrpo").sampling)
        x = jnp.zeros((rows, *self.model.sample_shape), jnp.float32)
        t = jnp.broadcast_to(schedule.timesteps[0], (rows,))
        cond = jnp.zeros((rows, *self.built.cond_shape), jnp.float32)
        forward = jax.jit(self.model.denoise).lower(self.model.params, x, t, cond).compile()
        flops = flops_of(forward)
        self.flops_per_row = flops / rows if flops else None
        shown = "n/a" if not flops else f"{self.flops_per_row / 1e9:.1f}"
        self.log(f"denoiser forward: {shown} GFLOP per row (every scanned block counted)")
        return {"denoiser_flops_per_row": self.flops_per_row}

    def rollout(self, method: str) -> dict:
        from tree_grpo_jax.run import loop as train

        self.live = None
        start = time.perf_counter()
        trainer, state = train.setup(self.config(method), self.run.out, model=self.model)
        setup_s = time.perf_counter() - start
        self.trainers[method] = trainer
        spec = trainer.spec().at(trainer.window_start(0))
        prompts = self.run.prompt_texts
        key = jax.random.PRNGKey(0)

        def go():
            sampled = trainer.rollout(state.params, prompts, key)
            return sampled, sampled.tree.leaves

        first, times, (sampled, _) = timed(go, self.run.reps)
        self.live = (method, trainer, state, sampled)
        med = float(np.median(times))
        count = len(prompts)
        rows = spec.rollout_denoiser_calls(trainer.guidance) * count
        out = {
            "spec": spec.describe(),
            "guidance_scale": float(trainer.config.sampling.guidance_scale),
            "remat": remat_mode(trainer.config.model.remat),
            "setup_s": setup_s,
            "prompts": count,
            "leaves": spec.leaves * count,
            "denoiser_rows": rows,
            "widest_call_rows": max(spec.nodes_in) * count * (2 if trainer.guidance else 1),
            "first_call_s": first,
            "time_s": summary(times),
            "seconds_per_tree": med / count,
            "denoiser_rows_per_s": rows / med,
            "images_per_s": spec.leaves * count / med,
            **self.run.utilisation(rows * self.flops_per_row if self.flops_per_row else None, med),
            "memory_after": device_memory(),
        }
        self.log(
            f"rollout {method}: {med / count:.3f} s per prompt's tree ({rows} rows in {med:.3f} s, "
            f"{rows / med:.0f} rows/s; first call {first:.0f} s)"
        )
        return out

    def train(self, method: str) -> dict:
        from tree_grpo_jax import sharding
        from tree_grpo_jax.core import transitions

        if self.live is None or self.live[0] != method:
            return {"skipped": "its rollout did not run"}
        _, trainer, state, sampled = self.live
        count, leaves = len(sampled.prompts), sampled.spec.leaves
        rewards = np.random.default_rng(3).standard_normal((count, leaves)).astype(np.float32)
        rows = trainer.trainable_rows(sampled, rewards)
        batch = transitions.minibatches(rows, jax.random.PRNGKey(4), self.train_rows)[0]
        batch = sharding.shard_batch(trainer.mesh, batch)
        lr = jnp.float32(trainer.config.train.learning_rate)
        args = trainer.step_args(batch, sampled.cond, trainer.schedule(), lr)
        start = time.perf_counter()
        compiled = trainer.train_step.lower(state, *args).compile()
        flops = flops_of(compiled, trainer.mesh.size)
        compile_s = time.perf_counter() - start
        planned = program_memory(compiled)
        short = shortfall(planned)
        if short:
            self.log(f"train step {method}: skipped, {short}")
            return {"skipped": short, "program_memory": planned, "lower_and_compile_s": compile_s}
        holder = {"state": state}
        self.live = None  # the step consumes (donates) the state

        def go():
            holder["state"], metrics = compiled(holder["state"], *args)
            return metrics["loss"]

        first, times, _ = timed(go, self.run.reps)
        self.live = (method, trainer, holder["state"], sampled)
        med = float(np.median(times))
        edges = int(np.sum(batch.mask))
        guided = 2 if trainer.guidance else 1
        out = {
            "rows": self.train_rows,
            "denoiser_rows": self.train_rows * guided,
            "actions_per_row": int(batch.mask.shape[1]),
            "trained_edges": edges,
            "lower_and_compile_s": compile_s,
            "first_call_s": first,
            "time_s": summary(times),
            "seconds_per_row": med / self.train_rows,
            "edges_per_s": edges / med,
            "train_step_flops": flops,
            **self.run.utilisation(flops, med),
            "program_memory": planned,
            "memory_after": device_memory(),
        }
        self.log(
            f"train step {method}: {med / self.train_rows:.4f} s per row ({self.train_rows} rows, "
            f"{edges} edges, in {med:.3f} s), program {gib((planned or {}).get('peak_bytes'))} "
            f"per device (compile {compile_s:.0f} s)"
        )
        return out

    def release(self) -> None:
        """Drops the measured method's state (params and optimizer moments)."""
        self.live = None

    def node_loop(self) -> dict:
        from benchmarks import node_loop
        from tree_grpo_jax import sharding
        from tree_grpo_jax.run import loop as train

        trainer = self.trainers.get("treegrpo")
        if trainer is None:
            trainer, _ = train.setup(self.config("treegrpo"), self.run.out, model=self.model)
        prompts = self.run.prompt_texts
        # The engine is the trainer's own rollout (already compiled: its params laid out as
        # the trainer lays out its state); the loop runs on one device with the same weights.
        params = self.model.params
        laid_out = jax.device_put(params, sharding.param_shardings(trainer.mesh, params))

        def engine(key):
            return trainer.rollout(laid_out, prompts, key).tree.leaves

        r = node_loop.compare(
            self.model.denoise, params, self.model.encode_prompts(prompts), trainer.schedule(),
            trainer.spec(), self.model.sample_shape, uncond=trainer.uncond,
            guidance_scale=trainer.config.sampling.guidance_scale, reps=self.run.reps,
            engine=engine, window_start=trainer.window_start(0),
        )  # fmt: skip
        devices = self.run.devices
        r["devices"] = devices
        if devices > 1:  # the loop on one device, as if every device ran its share of prompts
            r["speedup_with_loop_over_devices"] = r["speedup_of_medians"] / devices
        self.log(
            f"treegrpo rollout, {len(prompts)} prompt(s): engine {r['engine_s']['median']:.3f} s, "
            f"node loop {r['loop_s']['median']:.3f} s: {r['speedup_of_medians']:.1f}x"
        )
        return r


# ---------------------------------------------------------------------------------------------
# The whole command.


class Run:
    """The results, their two files, the sizes every model shares and the time budget."""

    def __init__(self, args, argv):
        self.start = time.perf_counter()
        self.args = args
        self.smoke = args.smoke
        self.chosen = {s.strip() for s in args.sections.split(",") if s.strip()}
        unknown = self.chosen - set(SECTIONS)
        if unknown:
            raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}.")
        if "train" in self.chosen:
            self.chosen.add("rollout")
        self.train_methods = [m.strip() for m in args.train_methods.split(",") if m.strip()]
        if set(self.train_methods) - set(METHODS):
            raise SystemExit(f"--train-methods takes a subset of {','.join(METHODS)}.")
        self.benches = {}
        self.devices = jax.device_count()
        # The trainer splits the prompts over every device: a multiple of their count.
        self.prompts = round_up(
            args.prompts or (1 if self.smoke else max(2, self.devices)), self.devices
        )
        self.prompt_texts = [f"prompt {i}" for i in range(self.prompts)]
        self.steps = args.steps or (2 if self.smoke else 10)
        self.reps = args.reps or (1 if self.smoke else 2)
        self.resolution = args.resolution or (64 if self.smoke else 512)
        self.deadline = self.start + args.time_limit
        self.out = args.out or (
            os.path.join(tempfile.gettempdir(), "tree_grpo_jax_benchmarks")
            if self.smoke
            else default_out("accelerator")
        )
        os.makedirs(self.out, exist_ok=True)
        self.json_path = os.path.join(self.out, "accelerator.json")
        self.md_path = os.path.join(self.out, "accelerator.md")
        device = jax.devices()[0]
        self.device_kind = getattr(device, "device_kind", str(device))
        self.peak = peak_tflops(self.device_kind, args.peak_tflops)
        self.results = {
            "command": " ".join(["python -m benchmarks.accelerator", *argv]),
            "smoke": self.smoke,
            "device": self.device_kind,
            "devices": self.devices,
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "peak_bf16_tflops_per_device": self.peak,
            "resolution": self.resolution,
            "prompts": self.prompts,
            "steps": self.steps,
            "leaves_per_prompt": SMOKE_LEAVES if self.smoke else LEAVES,
            "reps": self.reps,
            "train_methods": self.train_methods,
            "time_limit_s": args.time_limit,
            "models": {},
            "sections": {},
        }

    def train_rows(self, arch) -> int:
        rows = self.args.train_rows or (2 if self.smoke else arch.train_rows)
        return round_up(rows, self.devices)

    def options(self) -> random_models.Options:
        a = self.args
        attention = dict(
            use_memory_efficient_attention=a.memory_efficient_attention,
            split_head_dim=a.split_head_dim,
        )
        return random_models.Options(
            resolution=self.resolution,
            smoke=self.smoke,
            sd15_attention=attention,
            mmdit_attention=a.mmdit_attention,
        )

    def utilisation(self, flops, seconds) -> dict:
        """Measured against predicted: the plan's estimate of the same FLOPs (the peak at
        its default share of the roofline, `accelerators.DEFAULT_EFFICIENCY`)."""
        if not flops:
            return {"achieved_tflops": None, "mfu": None, "predicted_s": None}
        achieved = flops / seconds / 1e12
        peak = self.peak * self.devices if self.peak else None
        predicted = flops / (peak * 1e12 * accelerators.DEFAULT_EFFICIENCY) if peak else None
        return {
            "achieved_tflops": achieved,
            "mfu": achieved / peak if peak else None,
            "predicted_s": predicted,
            "measured_over_predicted": seconds / predicted if predicted else None,
        }

    def log(self, message: str) -> None:
        print(f"[accelerator {time.perf_counter() - self.start:6.1f}s] {message}", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.start
        self.results["memory"] = device_memory()
        with open(self.json_path, "w") as f:
            json.dump(self.results, f, indent=2)
            f.write("\n")
        with open(self.md_path, "w") as f:
            f.write(markdown(self.results))

    def attempt(self, where: dict, name: str, fn, label: str = "") -> None:
        """`where[name] = fn()`, unless the time limit has passed; an error is recorded and
        the run goes on."""
        if time.perf_counter() > self.deadline:
            where[name] = {"skipped": "time limit"}
            self.log(f"{label or name}: skipped (time limit)")
        else:
            try:
                where[name] = fn()
            except Exception as e:  # noqa: BLE001 - record it and go on
                traceback.print_exc()
                where[name] = {"error": f"{type(e).__name__}: {e}"}
        self.save()

    # -- the pieces of the run ---------------------------------------------------------------
    def pieces(self, archs) -> list:
        """The run in order of importance, so that one cut short by the time limit keeps what
        matters most: every model's tree method, then grpo, then the node loops, then the
        reward models."""
        out = [functools.partial(self.method, a, m) for m in METHODS for a in archs]
        if "node_loop" in self.chosen:
            out += [functools.partial(self.node_loop, a) for a in archs]
        if "rewards" in self.chosen:
            out.append(lambda: self.attempt(self.results["sections"], "rewards", self.rewards))
        return out

    def method(self, arch, method: str) -> None:
        """One method's rollout and (if asked) train step on one model, then its state goes."""
        bench = self.bench(arch)
        if bench is None:
            return
        sections = self.results["models"][arch.name]["sections"]
        for name, measure in (("rollout", bench.rollout), ("train", bench.train)):
            if name in self.chosen and (name == "rollout" or method in self.train_methods):
                where = sections.setdefault(name, {})
                label = f"{arch.name}: {name} {method}"
                self.attempt(where, method, functools.partial(measure, method), label)
        bench.release()
        ratios(sections)

    def node_loop(self, arch) -> None:
        bench = self.bench(arch)
        if bench is not None:
            sections = self.results["models"][arch.name]["sections"]
            self.attempt(sections, "node_loop", bench.node_loop, f"{arch.name}: node_loop")

    def bench(self, arch) -> ModelBench | None:
        """The model's bench, built (and its FLOPs counted) when first needed."""
        if arch.name not in self.benches:
            self.benches[arch.name] = self.build(arch)
        return self.benches[arch.name]

    def build(self, arch) -> ModelBench | None:
        entry = self.results["models"][arch.name]
        if time.perf_counter() > self.deadline:
            entry["skipped"] = "time limit"
            return None
        start = time.perf_counter()
        try:
            built = arch.build(self.options())
        except Exception as e:  # noqa: BLE001 - the other models still run
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
            self.save()
            return None
        bench = ModelBench(self, arch, built)
        entry.update(
            config=arch.config,
            network={k: list(v) if isinstance(v, tuple) else v for k, v in built.network.items()},
            params=built.params,
            sample_shape=list(built.model.sample_shape),
            cond_shape=list(built.cond_shape),
            guidance_scale=bench.guidance_scale(),
            train_rows=bench.train_rows,
            build_s=time.perf_counter() - start,
            sections={},
        )
        self.log(
            f"{arch.name}: {built.params / 1e6:.0f}M params on {self.devices} x "
            f"{self.device_kind}, built in {entry['build_s']:.0f} s"
        )
        if "flops" in self.chosen:
            self.attempt(entry["sections"], "flops", bench.flops, f"{arch.name}: flops")
        return bench

    def rewards(self) -> dict:
        """The CLIP reward towers on decoded images of this resolution: ViT-L/14 and ViT-H/14,
        bfloat16, 16 images per call (smoke: one tiny tower, 2 images)."""
        from benchmarks import rewards

        batch = 2 if self.smoke else 16
        argv = ["--batch", str(batch), "--dtype", "bfloat16", "--reps", str(self.reps)]
        argv += ["--image-size", str(self.resolution)]
        if self.smoke:
            argv += ["--smoke"]
        args = rewards.parse_args(argv)
        if self.smoke:  # both towers would be the same tiny one
            return {SMOKE_TOWER: rewards.measure(SMOKE_TOWER, rewards.SMOKE, args)}
        return {name: rewards.measure(name, f, args) for name, f in rewards.ARCHITECTURES.items()}

    def models(self) -> list:
        """The architectures asked for, in the table's order; every owed one is recorded."""
        wanted = [m.strip() for m in self.args.models.split(",") if m.strip()]
        table = random_models.by_name()
        for name in wanted:
            if name not in table:
                raise SystemExit(f"unknown model {name!r}; the table has {sorted(table)}.")
            if table[name].build is None:
                raise SystemExit(f"{name} is owed: {table[name].owed}.")
        for arch in random_models.ARCHITECTURES:
            if arch.build is None or arch.name in wanted:
                entry = self.results["models"][arch.name] = {"title": arch.title}
                if arch.build is None:
                    entry["owed"] = arch.owed
        return [a for a in random_models.ARCHITECTURES if a.name in wanted]

    def main(self) -> dict:
        archs = self.models()
        self.save()
        for piece in self.pieces(archs):
            piece()
        self.save()
        print(markdown(self.results), flush=True)
        self.log(f"done; results in {self.json_path} and {self.md_path}")
        return self.results


def ratios(sections: dict) -> None:
    """Each method's rollout time against grpo's, where both ran."""
    rollouts = sections.get("rollout", {})
    grpo = rollouts.get("grpo", {}).get("time_s")
    for r in rollouts.values():
        if grpo and "time_s" in r:
            r["time_vs_grpo"] = r["time_s"]["median"] / grpo["median"]


# ---------------------------------------------------------------------------------------------
# The Markdown table of headline figures.


def _num(value, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value * scale:.{digits}g}{unit}"


def _pair(sections: dict, section: str, field: str, **fmt) -> str:
    """`treegrpo / grpo` of one field; a section that did not run says why."""
    cells = []
    for method in METHODS:
        r = sections.get(section, {}).get(method, {})
        cells.append(_num(r[field], **fmt) if field in r else _why(r))
    return " / ".join(cells)


def _why(record: dict) -> str:
    if "skipped" in record:
        return "skipped"
    return "error" if "error" in record else "-"


def _peak(sections: dict) -> int | None:
    """The device peak after the model's treegrpo sections (before the next model's run)."""
    for section in ("train", "rollout"):
        memory = sections.get(section, {}).get("treegrpo", {}).get("memory_after") or {}
        if memory.get("peak_bytes_in_use"):
            return memory["peak_bytes_in_use"]
    return None


def model_row(entry: dict) -> list:
    for key, say in (("owed", "**owed**: "), ("error", "error: "), ("skipped", "skipped: ")):
        if key in entry:
            return [entry["title"], say + entry[key]] + ["-"] * 8
    if "params" not in entry:
        return [entry["title"], "not run yet"] + ["-"] * 8
    s = entry.get("sections", {})
    tree_train = s.get("train", {}).get("treegrpo", {})
    tree_rollout = s.get("rollout", {}).get("treegrpo", {})
    loop = s.get("node_loop", {})
    planned = (tree_train.get("program_memory") or {}).get("peak_bytes")
    mfu = " / ".join(_num(r.get("mfu"), 2, 100, "%") for r in (tree_rollout, tree_train))
    predicted = " / ".join(
        _num(r.get("measured_over_predicted"), 2) for r in (tree_rollout, tree_train)
    )
    return [
        entry["title"],
        f"{entry['params'] / 1e6:.4g}M",
        "x".join(str(n) for n in entry["sample_shape"]),
        _pair(s, "rollout", "seconds_per_tree"),
        _num(tree_rollout.get("time_vs_grpo"), 2),
        _pair(s, "train", "seconds_per_row"),
        f"{gib(planned)} / {gib(_peak(s))}",
        mfu,
        predicted,
        _num(loop.get("speedup_of_medians"), 2, unit="x") if "engine_s" in loop else _why(loop),
    ]


def rewards_table(section: dict) -> str:
    rows = [
        [
            name,
            f"{r['params_millions']:.0f}M",
            _num(r["images_per_s"]),
            _num(r["prompts_per_s"]),
            f"{r['image_first_call_s']:.1f}",
        ]
        for name, r in section.items()
        if "images_per_s" in r
    ]
    header = ["tower", "parameters", "images/s", "prompts/s", "first image call, s"]
    return markdown_table(header, rows) if rows else _why(section)


def markdown(results: dict) -> str:
    lines = ["# Accelerator benchmark", ""]
    if results["smoke"]:
        lines += [
            "**Smoke run**: tiny models on a CPU. These figures check the code; they "
            "measure nothing.",
            "",
        ]
    lines += [
        f"`{results['command'].strip()}` on {results['devices']} x {results['device']} "
        f"({results['backend']}, JAX {results['jax']}): {results['resolution']} px, "
        f"{results['steps']} steps, {results['prompts']} prompt(s) per rollout of "
        f"{results['leaves_per_prompt']} leaves each, median of {results['reps']} timed calls "
        "after a compiling one. A prompt's tree is all its leaves (grpo: its chains). Memory: "
        "the treegrpo train step's program per device (XLA's plan) / the process's device "
        "peak after the model's treegrpo sections. MFU: XLA's FLOPs with every scanned block "
        "and step counted (with remat, the recomputed forward too) over the measured time "
        "over the devices' bf16 peak. Measured / predicted: the measured seconds over the "
        "plan's estimate of the same FLOPs (`python -m tree_grpo_jax.plan`: the peak at its "
        f"default {accelerators.DEFAULT_EFFICIENCY:.0%} of the roofline); below 1 is faster "
        "than predicted.",
        "",
    ]
    header = [
        "model",
        "denoiser parameters",
        "latents",
        "s per prompt's tree (treegrpo / grpo)",
        "treegrpo time / grpo",
        "train step s per row (treegrpo / grpo)",
        "memory: train program / peak",
        "MFU: rollout / train (treegrpo)",
        "measured / predicted: rollout / train",
        "engine vs node loop",
    ]
    rows = [model_row(entry) for entry in results["models"].values()]
    lines += [markdown_table(header, rows), ""]
    if "rewards" in results["sections"]:
        lines += ["Reward models, one device, bfloat16:", ""]
        lines += [rewards_table(results["sections"]["rewards"]), ""]
    owed = [e["title"] for e in results["models"].values() if "owed" in e]
    if owed:
        lines += [f"Owed: every figure of {', '.join(owed)}.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from benchmarks.common import smoke_rng

    with smoke_rng() if args.smoke else contextlib.nullcontext():
        return Run(args, sys.argv[1:] if argv is None else argv).main()


if __name__ == "__main__":
    main()
