"""How long an iteration of a run should take on a named accelerator, from its compiled
programs' loop-counted FLOPs and bytes (`program_cost`): a roofline estimate, not a
measurement.

Each program's bound on one device is the longer of its FLOPs at the accelerator's peak dense
bfloat16 rate and its bytes at the memory bandwidth; the estimate is that bound over the
fraction of it a real program reaches (`efficiency`). Compiled on a CPU for another target (the
plan's usual case), the bytes are the CPU's, far above a GPU's or TPU's, and only the FLOPs
bound the estimate. An iteration runs the rollout and the
decode once, the train step once per minibatch of every inner epoch (or `accumulate` once per
minibatch and `apply` once per update) and the evaluation every `eval.every` iterations; the
train step's count is averaged over the run's iterations, since a sliding window or pruning
changes the rows each one trains. With `mesh.sequence` > 1 each denoiser call's all-to-alls
(`sequence_traffic`) take their bytes at the interconnect's bandwidth, added to the program's
time (not assumed overlapped with its compute). Node rewards decode the tree's x0 estimates
beside the leaves: the decode runs once per leaf batch and once more per leaves' worth of
estimates, and every decode is a reward call (`reward_calls`). Not counted: reward scoring's
time (its models are not compiled; the plan prices a call like one denoiser row instead), the
host's work between programs, and other communication between devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from tree_grpo_jax import methods
from tree_grpo_jax.core import rollout, transitions
from tree_grpo_jax.models.base import remat_mode
from tree_grpo_jax.plan.accelerators import DEFAULT_EFFICIENCY, Accelerator
from tree_grpo_jax.plan.program_cost import ProgramCost
from tree_grpo_jax.plan.sequence_traffic import Exchange, bytes_per_device

# ---------------------------------------------------------------------------------------------
# How often each program runs in one iteration.


def minibatches_in_epoch(config, iteration: int = 0) -> int:
    """Train minibatches of one inner epoch of iteration `iteration`: the global rows it
    trains, as the method counts them, in whole minibatches."""
    rows = methods.get(config.tree.method).training_counts(config, iteration)["train_rows"]
    rows *= config.prompts.batch_size
    return transitions.num_minibatches(rows, config.train.rows_per_minibatch)


def minibatches_per_iteration(config) -> float:
    """Train minibatches of one iteration (every inner epoch), averaged over the run."""
    iterations = _iterations(config)
    total = sum(minibatches_in_epoch(config, i) for i in iterations)
    return total / len(iterations) * config.train.inner_epochs


def rows_per_leaf(config) -> tuple[int, float, float]:
    """(leaves per prompt, rollout denoiser rows per leaf, train-step forward rows per leaf),
    the rows averaged over the run's iterations, as the method counts them."""
    method = methods.get(config.tree.method)
    counts = [method.training_counts(config, i) for i in _iterations(config)]
    leaves = counts[0]["leaves"]
    rollout_rows = sum(c["rollout_rows"] for c in counts) / len(counts)
    train_rows = sum(c["train_forward_rows"] for c in counts) / len(counts)
    return leaves, rollout_rows / leaves, train_rows / leaves


def reward_calls(config) -> tuple[float, float]:
    """(leaves, node estimates) decoded and scored per iteration over the whole batch,
    averaged over the run's iterations: every one a decode and a reward call."""
    method = methods.get(config.tree.method)
    counts = [method.training_counts(config, i) for i in _iterations(config)]
    prompts = config.prompts.batch_size
    leaves = sum(c["leaves"] for c in counts) / len(counts) * prompts
    nodes = sum(c.get("node_decodes", 0) for c in counts) / len(counts) * prompts
    return leaves, nodes


def calls_per_iteration(config) -> dict[str, float]:
    """How many times each program runs in one iteration, on average over the run (the
    decode's compiled batch is the leaves; node estimates take more of those calls)."""
    minibatches = minibatches_per_iteration(config)
    updates = config.train.updates_per_iteration
    every = config.eval.every
    leaves, nodes = reward_calls(config)
    return {
        "rollout": 1.0,
        "decode": 1.0 + nodes / leaves,
        "train_step": minibatches,
        "accumulate": minibatches,
        "apply": float(min(updates, math.ceil(minibatches))) if updates else 0.0,
        "evaluate": 1.0 / every if every else 0.0,
    }


def denoiser_rows(config, evaluate_rows: float = 0.0) -> dict[str, tuple[float, float]]:
    """Per program call, the denoiser rows of the whole batch (every device's), forward and of
    those differentiated, averaged over the run's iterations as the method counts them."""
    method = methods.get(config.tree.method)
    counts = [method.training_counts(config, i) for i in _iterations(config)]

    def mean(key: str) -> float:
        return sum(c.get(key, c["train_forward_rows"]) for c in counts) / len(counts)

    minibatch = config.train.rows_per_minibatch / max(mean("train_rows"), 1e-9)
    step = (minibatch * mean("train_forward_rows"), minibatch * mean("train_grad_rows"))
    return {
        "rollout": (mean("rollout_rows") * config.prompts.batch_size, 0.0),
        "train_step": step,
        "accumulate": step,
        "evaluate": (evaluate_rows, 0.0),
    }


def exchanged_bytes(config, ex: Exchange | None) -> dict[str, float]:
    """Bytes one device sends per call of each program over `mesh.sequence` (none without
    an `Exchange`)."""
    if ex is None:
        return {}
    remat = remat_mode(config.model.remat)
    return {
        name: bytes_per_device(ex, rows, grads, remat)
        for name, (rows, grads) in denoiser_rows(config, ex.evaluate_rows).items()
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
    estimate_s: float  # one call: the bound over the efficiency, and the communication
    bytes_counted: bool = True  # False: the bytes are a CPU compile's, not the target's
    communication_bytes: float = 0.0  # one call, sent by one device over mesh.sequence
    communication_s: float = 0.0  # one call at the interconnect's bandwidth (0: not known)

    @property
    def bound(self) -> str:
        if not self.bytes_counted:
            return "flops"
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
    sequence: int = 1  # mesh.sequence: >1, the programs' communication is counted
    # per iteration, the whole batch's decodes scored (leaves and node estimates)
    reward_calls: float = 0.0
    node_reward_calls: float = 0.0  # of those, the node estimates'
    rollout_rows: float = 0.0  # the rollout's denoiser rows per call, the whole batch's

    @property
    def seconds_per_iteration(self) -> float:
        return sum(p.per_iteration_s for p in self.programs)

    @property
    def denoiser_row_s(self) -> float:
        """The rollout's seconds per denoiser row of the whole batch (0: no rollout)."""
        rollout = [p for p in self.programs if p.name == "rollout"]
        if not rollout or not self.rollout_rows:
            return 0.0
        return rollout[0].estimate_s / self.rollout_rows

    @property
    def reward_calls_per_leaf(self) -> float:
        """Decodes scored per leaf: 1, plus the node estimates' share."""
        leaves = self.reward_calls - self.node_reward_calls
        return self.reward_calls / leaves if leaves > 0 else 0.0

    @property
    def reward_calls_as_rows_s(self) -> float:
        """The iteration's reward calls priced like one denoiser row each (a served judge
        or a detector costs about that): seconds the plan does not add to the iteration."""
        return self.reward_calls * self.denoiser_row_s

    @property
    def communication_per_iteration(self) -> tuple[float, float]:
        """(bytes one device sends over mesh.sequence, seconds at the interconnect)."""
        return (
            sum(p.calls * p.communication_bytes for p in self.programs),
            sum(p.calls * p.communication_s for p in self.programs),
        )

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
    name: str,
    cost: ProgramCost,
    calls: float,
    device: Accelerator,
    efficiency: float,
    bytes_counted: bool = True,
    communication_bytes: float = 0.0,
) -> ProgramTime:
    """One program's time per call: the roofline bound over `efficiency` (without
    `bytes_counted`, the compute time alone), plus `communication_bytes` at the interconnect's
    full bandwidth (where it is known)."""
    compute = cost.flops / device.peak_flops
    memory = cost.bytes_accessed / device.bandwidth
    link = communication_bytes / device.interconnect if device.interconnect else 0.0
    return ProgramTime(
        name=name,
        calls=calls,
        flops=cost.flops,
        bytes_accessed=cost.bytes_accessed,
        compute_s=compute,
        memory_s=memory,
        estimate_s=(max(compute, memory) if bytes_counted else compute) / efficiency + link,
        bytes_counted=bytes_counted,
        communication_bytes=communication_bytes,
        communication_s=link,
    )


def plan_time(
    config,
    costs: Mapping[str, ProgramCost],
    devices: int,
    device: Accelerator,
    efficiency: float = DEFAULT_EFFICIENCY,
    bytes_counted: bool = True,
    exchange: Exchange | None = None,
) -> TimePlan:
    """The time plan of one iteration of `config` from its programs' `costs` (one device).
    `bytes_counted`: the costs come from a compile for the target itself, so their bytes
    bound the time too; a CPU compile's bytes are not a GPU's or TPU's (the CPU fuses far
    less, and the plan turns its loop-invariant code motion off), so they are shown but the
    estimate is the FLOPs alone. `exchange`: the denoiser's all-to-alls over mesh.sequence."""
    calls = calls_per_iteration(config)
    sent = exchanged_bytes(config, exchange)
    if "rollout" in costs:
        costs = {**costs, "rollout": rollout_cost(config, costs["rollout"])}
    programs = tuple(
        program_time(
            name, cost, calls[name], device, efficiency, bytes_counted, sent.get(name, 0.0)
        )
        for name, cost in costs.items()
        if calls.get(name)
    )
    steps = ("accumulate", "apply") if config.train.updates_per_iteration else ()
    expected = ("rollout", "decode", *(steps or ("train_step",)), "evaluate")
    missing = [n for n in expected if calls[n] and n not in costs]
    not_counted = [
        "reward scoring (its models are not compiled by the plan; the reward calls line "
        "prices them)",
        "the host's work between programs",
        "communication between devices",
    ]
    if exchange is not None:
        not_counted[-1] = (
            "communication between devices other than mesh.sequence's all-to-alls (fsdp's "
            "weight gathers, the gradients' reduction)"
        )
        if not device.interconnect:
            not_counted.append(
                "the time of mesh.sequence's all-to-alls (no interconnect bandwidth for "
                "this accelerator: give --interconnect)"
            )
    if missing:
        not_counted.insert(0, f"{', '.join(missing)} (not compiled)")
    if not bytes_counted:
        not_counted.append(
            "memory traffic: the bytes are a CPU compile's, an upper bound on the target's "
            "(the CPU fuses far less), so the estimate is the FLOPs at the peak over the "
            "efficiency, and the efficiency stands for the memory stalls too"
        )
    unknown = [n for n, c in costs.items() if c.unknown_loops]
    if unknown:
        not_counted.append(
            f"the repeats of loops whose trip count XLA does not know in {', '.join(unknown)} "
            "(each counted once)"
        )
    leaves, nodes = reward_calls(config)
    return TimePlan(
        accelerator=device,
        efficiency=efficiency,
        devices=devices,
        iterations=int(config.train.iterations),
        programs=programs,
        not_counted=tuple(not_counted),
        sequence=1 if exchange is None else exchange.sequence,
        reward_calls=leaves + nodes,
        node_reward_calls=nodes,
        rollout_rows=denoiser_rows(config)["rollout"][0],
    )
