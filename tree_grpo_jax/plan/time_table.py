"""The plan's time figures as text and JSON: one iteration's programs on a named accelerator
(`plan/time_plan.py`), and runs compared side by side (`plan --compare`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command imports this before JAX starts
    from tree_grpo_jax.plan.time_plan import TimePlan

ESTIMATE = "estimate, not measured"


def tera(flops: float) -> str:
    return f"{flops / 1e12:.4g}"


def hours(h: float) -> str:
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.1f} min"


def seconds(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def _device_line(plan: TimePlan) -> str:
    a = plan.accelerator
    return (
        f"{a.title}: {a.peak_flops / 1e12:g} TFLOP/s dense bf16, {a.bandwidth / 1e12:g} TB/s, "
        f"at {plan.efficiency:.0%} of the roofline"
    )


def _communication_line(plan: TimePlan) -> str:
    """What mesh.sequence's all-to-alls add to an iteration, and how."""
    sent, secs = plan.communication_per_iteration
    link = plan.accelerator.interconnect
    at = (
        f"{seconds(secs)} at {link / 1e9:g} GB/s one way (interconnect), added to the compute "
        "(not assumed overlapped)"
        if link
        else "no time given (no interconnect bandwidth: --interconnect=GB_PER_S gives one)"
    )
    return (
        f"communication: mesh.sequence={plan.sequence}'s all-to-alls of attention's q, k, v "
        f"and output send {sent / 1e9:.3g} GB per device per iteration (forward, backward "
        f"and remat's recompute), {at}"
    )


def _reward_calls_line(plan: TimePlan) -> str:
    """The iteration's reward calls, and what they would add priced like denoiser rows."""
    nodes = plan.node_reward_calls
    parts = (
        f" ({plan.reward_calls - nodes:.0f} leaves, {nodes:.0f} node estimates)" if nodes else ""
    )
    priced = plan.reward_calls_as_rows_s
    share = priced / plan.seconds_per_iteration if plan.seconds_per_iteration else 0.0
    return (
        f"reward calls: {plan.reward_calls:.0f} per iteration{parts}, each after a decode; "
        f"priced like one denoiser row each they would add {seconds(priced)} "
        f"({share:.0%} of the iteration; not in its seconds)"
    )


def table(plan: TimePlan, unfit: str = "") -> str:
    """One accelerator's block: each program per call and per iteration, then the run; the
    run's hours withheld when it does not fit the accelerator (`unfit` says why). With
    mesh.sequence > 1, each call's all-to-all traffic and time are columns of their own, and
    are included in its seconds."""
    split = plan.sequence > 1
    comm = f"  {'comm GB':>9}  {'comm s':>9}" if split else ""
    lines = [
        f"time per iteration on {_device_line(plan)} ({ESTIMATE}; per device):",
        f"{'program':<11}  {'calls/iter':>10}  {'TFLOP/call':>10}  {'GB/call':>9}  "
        f"{'bound':>7}{comm}  {'per call':>9}  {'per iter':>9}",
    ]
    for p in plan.programs:
        moved = f"{p.bytes_accessed / 1e9:.2f}" if p.bytes_counted else "-"  # a CPU's: not shown
        sent = (
            f"  {p.communication_bytes / 1e9:>9.3g}  {seconds(p.communication_s):>9}"
            if split
            else ""
        )
        lines.append(
            f"{p.name:<11}  {p.calls:>10.2f}  {tera(p.flops):>10}  "
            f"{moved:>9}  {p.bound:>7}{sent}  {seconds(p.estimate_s):>9}  "
            f"{seconds(p.per_iteration_s):>9}"
        )
    where = f"{plan.devices} device{'s' if plan.devices > 1 else ''}"
    if unfit:
        run = (
            f"{seconds(plan.seconds_per_iteration)} if it fit ({ESTIMATE}); NOT RUNNABLE as "
            f"planned on {where}: {unfit}, so no hours are given (the memory plan above "
            "suggests a mesh)"
        )
    else:
        run = (
            f"{seconds(plan.seconds_per_iteration)} ({ESTIMATE}); {plan.iterations} iterations: "
            f"{hours(plan.hours)} on {where}, {plan.device_hours:.3g} device-hours ({ESTIMATE})"
        )
    lines += [
        *([_communication_line(plan)] if split else []),
        *([_reward_calls_line(plan)] if plan.reward_calls and plan.denoiser_row_s else []),
        f"one iteration: {tera(plan.flops_per_iteration)} TFLOP per device, {run}",
        "not counted: " + "; ".join(plan.not_counted) + ".",
    ]
    return "\n".join(lines)


def as_json(plan: TimePlan, runnable: bool | None = None) -> dict:
    """`runnable` False: the run does not fit the accelerator's memory (hours withheld);
    None: not checked (its memory is not known)."""
    return {
        "accelerator": dataclasses.asdict(plan.accelerator),
        "efficiency": plan.efficiency,
        "devices": plan.devices,
        "iterations": plan.iterations,
        "programs": {
            p.name: {
                "calls_per_iteration": p.calls,
                "flops": p.flops,
                "bytes_accessed": p.bytes_accessed,
                "compute_seconds": p.compute_s,
                "memory_seconds": p.memory_s,
                "bound": p.bound,
                "bytes_counted": p.bytes_counted,
                "communication_bytes": p.communication_bytes,
                "communication_seconds": p.communication_s,
                "estimate_seconds": p.estimate_s,
                "seconds_per_iteration": p.per_iteration_s,
            }
            for p in plan.programs
        },
        "sequence": plan.sequence,
        "communication_bytes_per_iteration": plan.communication_per_iteration[0],
        "communication_seconds_per_iteration": plan.communication_per_iteration[1],
        "reward_calls_per_iteration": plan.reward_calls,
        "node_reward_calls_per_iteration": plan.node_reward_calls,
        "reward_calls_priced_as_denoiser_rows_seconds": plan.reward_calls_as_rows_s,
        "flops_per_iteration": plan.flops_per_iteration,
        "seconds_per_iteration": plan.seconds_per_iteration,
        "runnable": runnable,
        "hours": None if runnable is False else plan.hours,
        "device_hours": None if runnable is False else plan.device_hours,
        "measured": False,
        "not_counted": list(plan.not_counted),
    }


@dataclasses.dataclass(frozen=True)
class Compared:
    """One run of a `--compare` table."""

    name: str
    leaves: int
    rollout_rows_per_leaf: float
    train_rows_per_leaf: float  # denoiser forwards of the train step per leaf
    largest_total: int  # bytes per device, the memory plan's largest program
    time: TimePlan
    runnable: bool | None = None  # within the accelerator's memory (None: not known)


def compare_table(rows: list[Compared], devices: int) -> str:
    first = rows[0].time
    lines = [
        f"runs compared on {devices} device{'s' if devices > 1 else ''}, each at the setting "
        f"named below it, on {_device_line(first)} ({ESTIMATE}; per device):",
        f"{'run':<28}  {'leaves':>6}  {'rollout rows/leaf':>17}  {'train rows/leaf':>15}  "
        f"{'calls/leaf':>10}  {'TFLOP/iter':>10}  {'s/iter':>9}  {'ratio':>6}  "
        f"{'+ calls':>9}  {'ratio':>6}  {'memory':>9}",
    ]
    priced = [r.time.seconds_per_iteration + r.time.reward_calls_as_rows_s for r in rows]
    for r, with_calls in zip(rows, priced):
        t = r.time
        lines.append(
            f"{r.name:<28}  {r.leaves:>6}  {r.rollout_rows_per_leaf:>17.2f}  "
            f"{r.train_rows_per_leaf:>15.2f}  {t.reward_calls_per_leaf:>10.2f}  "
            f"{tera(t.flops_per_iteration):>10}  "
            f"{seconds(t.seconds_per_iteration):>9}  "
            f"{t.seconds_per_iteration / first.seconds_per_iteration:>6.2f}  "
            f"{seconds(with_calls):>9}  {with_calls / priced[0]:>6.2f}  "
            f"{r.largest_total / 2**30:>5.1f} GiB{' (does not fit)' if r.runnable is False else ''}"
        )
    lines.append(
        "rows per leaf: denoiser rows of the rollout and forward rows of the train steps per "
        "leaf, averaged over the run's iterations; calls/leaf: decodes scored by the reward "
        "per leaf (node rewards add the x0 estimates'); ratio: seconds per iteration over the "
        "first run's; + calls: the seconds with every reward call priced like one denoiser "
        "row (a served judge or a detector costs about that), and its ratio; memory: the "
        "largest program's total per device"
        + (
            f" (does not fit: above the {first.accelerator.memory_gb:g} GB of one device, so "
            "that run's seconds are no run's)."
            if any(r.runnable is False for r in rows)
            else "."
        )
    )
    return "\n".join(lines)


def compare_json(rows: list[Compared]) -> list[dict]:
    first = rows[0].time.seconds_per_iteration
    return [
        {
            "run": r.name,
            "leaves": r.leaves,
            "rollout_rows_per_leaf": r.rollout_rows_per_leaf,
            "train_rows_per_leaf": r.train_rows_per_leaf,
            "largest_total_bytes": r.largest_total,
            "ratio": r.time.seconds_per_iteration / first,
            "reward_calls_per_leaf": r.time.reward_calls_per_leaf,
            "time": as_json(r.time, r.runnable),
        }
        for r in rows
    ]
