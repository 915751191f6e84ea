"""How long an iteration of a run should take on a named accelerator, from its compiled
programs' loop-counted FLOPs and bytes (`program_cost`): a roofline estimate, not a
measurement.

Each program's bound on one device is the longer of its FLOPs at the accelerator's peak dense
bfloat16 rate and its bytes at the memory bandwidth; the estimate is that bound over the
fraction of it a real program reaches (`efficiency`). An iteration runs the rollout and the
decode once, the train step once per minibatch of every inner epoch (or `accumulate` once per
minibatch and `apply` once per update) and the evaluation every `eval.every` iterations; the
train step's count is averaged over the run's iterations, since a sliding window or pruning
changes the rows each one trains. Not counted: reward scoring (its models are not compiled),
the host's work between programs, and communication between devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from tree_grpo_jax import methods
from tree_grpo_jax.core import rollout, transitions
from tree_grpo_jax.run.program_cost import ProgramCost


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's dense bfloat16 peak and memory bandwidth, as its data sheet gives them."""

    name: str
    title: str
    peak_flops: float  # FLOP/s, dense bfloat16 (no structured sparsity)
    bandwidth: float  # bytes/s of its high-bandwidth memory
    memory_gb: float = 0.0  # 10^9 bytes; 0 where unknown (`--peak-tflops` / `--bandwidth`)


# Vendors' data sheets; docs/plan.md cites each one.
ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("h100", "NVIDIA H100 SXM", 989e12, 3.35e12, 80),
        Accelerator("h200", "NVIDIA H200 SXM", 989e12, 4.8e12, 141),
        Accelerator("a100", "NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80),
        Accelerator("b200", "NVIDIA B200 (HGX)", 2250e12, 8e12, 180),
        Accelerator("tpu-v5e", "Google TPU v5e", 197e12, 0.819e12, 16),
        Accelerator("tpu-v5p", "Google TPU v5p", 459e12, 2.765e12, 95),
        Accelerator("tpu-v6e", "Google TPU v6e (Trillium)", 918e12, 1.64e12, 32),
    )
}
# The share of the roofline bound a program is assumed to reach; docs/plan.md says why.
DEFAULT_EFFICIENCY = 0.4


def accelerator(
    name: str, peak_tflops: float | None = None, bandwidth_tb: float | None = None
) -> Accelerator:
    """The named accelerator, with either figure replaced when given; name "custom" takes
    both from the arguments. ValueError with one sentence for an unknown name or a figure
    that is not a positive number."""
    for figure, value in (("--peak-tflops", peak_tflops), ("--bandwidth", bandwidth_tb)):
        if value is not None and not (0 < value < 1e6):
            raise ValueError(f"{figure}={value:g} must be a positive number.")
    if name == "custom":
        if peak_tflops is None or bandwidth_tb is None:
            raise ValueError("--accelerator=custom needs both --peak-tflops and --bandwidth.")
        return Accelerator("custom", "custom", peak_tflops * 1e12, bandwidth_tb * 1e12)
    if name not in ACCELERATORS:
        raise ValueError(
            f"unknown accelerator {name!r}; name one of {', '.join(ACCELERATORS)}, or custom "
            "with --peak-tflops and --bandwidth."
        )
    chosen = ACCELERATORS[name]
    return dataclasses.replace(
        chosen,
        peak_flops=chosen.peak_flops if peak_tflops is None else peak_tflops * 1e12,
        bandwidth=chosen.bandwidth if bandwidth_tb is None else bandwidth_tb * 1e12,
    )


def check_efficiency(efficiency: float) -> float:
    if not 0 < efficiency <= 1:
        raise ValueError(
            f"--efficiency={efficiency:g} must be a fraction of the roofline above 0 and at "
            "most 1, e.g. 0.4."
        )
    return efficiency


# ---------------------------------------------------------------------------------------------
# How often each program runs in one iteration.


def minibatches_per_iteration(config) -> float:
    """Train minibatches of one iteration (every inner epoch), averaged over the run: the
    global rows each iteration trains, as the method counts them, in whole minibatches."""
    method = methods.get(config.tree.method)
    iterations = _iterations(config)
    prompts, per_minibatch = config.prompts.batch_size, config.train.rows_per_minibatch
    total = sum(
        transitions.num_minibatches(
            method.training_counts(config, i)["train_rows"] * prompts, per_minibatch
        )
        for i in iterations
    )
    return total / len(iterations) * config.train.inner_epochs


def calls_per_iteration(config) -> dict[str, float]:
    """How many times each program runs in one iteration, on average over the run."""
    minibatches = minibatches_per_iteration(config)
    updates = config.train.get("updates_per_iteration", 0)
    every = config.eval.every
    return {
        "rollout": 1.0,
        "decode": 1.0,
        "train_step": minibatches,
        "accumulate": minibatches,
        "apply": float(min(updates, math.ceil(minibatches))) if updates else 0.0,
        "evaluate": 1.0 / every if every else 0.0,
    }


def _iterations(config) -> range:
    return range(max(1, min(int(config.train.iterations), 10_000)))


def rollout_cost(config, cost: ProgramCost) -> ProgramCost:
    """The rollout's cost averaged over the run's iterations: the ODE loops whose bounds
    move with a sliding window get each iteration's trip counts (the compiled program takes
    the window's position as an argument, so XLA cannot know them)."""
    method = methods.get(config.tree.method)
    spec = method.run_spec(config)
    iterations = _iterations(config)
    trips = [rollout.moving_ode_trips(spec, method.window_start_at(config, i)) for i in iterations]
    if not trips[0] or len(trips[0]) != len(cost.unknown_loops):
        return cost
    mean = [sum(t[j] for t in trips) / len(trips) for j in range(len(trips[0]))]
    return cost.with_trips(mean)


# ---------------------------------------------------------------------------------------------
# The roofline.


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    name: str
    calls: float  # per iteration
    flops: float  # one call, one device
    bytes_accessed: float
    compute_s: float  # one call at the peak FLOP rate
    memory_s: float  # one call at the full bandwidth
    estimate_s: float  # one call: the bound over the efficiency

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def per_iteration_s(self) -> float:
        return self.calls * self.estimate_s


@dataclasses.dataclass(frozen=True)
class TimePlan:
    accelerator: Accelerator
    efficiency: float
    devices: int
    iterations: int
    programs: tuple[ProgramTime, ...]
    not_counted: tuple[str, ...]

    @property
    def seconds_per_iteration(self) -> float:
        return sum(p.per_iteration_s for p in self.programs)

    @property
    def flops_per_iteration(self) -> float:
        """One device's FLOPs in one iteration."""
        return sum(p.calls * p.flops for p in self.programs)

    @property
    def hours(self) -> float:
        """Wall-clock hours of `iterations` iterations."""
        return self.seconds_per_iteration * self.iterations / 3600

    @property
    def device_hours(self) -> float:
        return self.hours * self.devices


def program_time(
    name: str, cost: ProgramCost, calls: float, device: Accelerator, efficiency: float
) -> ProgramTime:
    compute = cost.flops / device.peak_flops
    memory = cost.bytes_accessed / device.bandwidth
    return ProgramTime(
        name=name,
        calls=calls,
        flops=cost.flops,
        bytes_accessed=cost.bytes_accessed,
        compute_s=compute,
        memory_s=memory,
        estimate_s=max(compute, memory) / efficiency,
    )


def plan_time(
    config,
    costs: Mapping[str, ProgramCost],
    devices: int,
    device: Accelerator,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> TimePlan:
    """The time plan of one iteration of `config` from its programs' `costs` (one device)."""
    calls = calls_per_iteration(config)
    if "rollout" in costs:
        costs = {**costs, "rollout": rollout_cost(config, costs["rollout"])}
    programs = tuple(
        program_time(name, cost, calls[name], device, efficiency)
        for name, cost in costs.items()
        if calls.get(name)
    )
    steps = ("accumulate", "apply") if config.train.get("updates_per_iteration", 0) else ()
    expected = ("rollout", "decode", *(steps or ("train_step",)), "evaluate")
    missing = [n for n in expected if calls[n] and n not in costs]
    not_counted = [
        "reward scoring (its models are not compiled by the plan)",
        "the host's work between programs",
        "communication between devices",
    ]
    if missing:
        not_counted.insert(0, f"{', '.join(missing)} (not compiled)")
    unknown = [n for n, c in costs.items() if c.unknown_loops]
    if unknown:
        not_counted.append(
            f"the repeats of loops whose trip count XLA does not know in {', '.join(unknown)} "
            "(each counted once)"
        )
    return TimePlan(
        accelerator=device,
        efficiency=efficiency,
        devices=devices,
        iterations=int(config.train.iterations),
        programs=programs,
        not_counted=tuple(not_counted),
    )
