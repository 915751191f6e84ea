"""`plan`'s verdicts on the memory: the largest program's total per device against each named
accelerator's memory (`accelerators.py`) and each `--device_memory` size, one verdict
each; and, when none fits, an estimate of the mesh that would (`suggest`).

The estimate scales what `mesh.fsdp` divides (with `mesh.sequence` held, the weight axes
are fsdp x sequence: `sharding.fsdp_spec`) and keeps the rest as it is (ZeRO-3's
accounting). The run lays the denoiser's weights and their optimizer state out with
`sharding.param_shardings` (the memory plan's `trained params`, `optimizer state`, `old
policy`, `LoRA base` and `KL reference`), and a train step's gradients and new optimizer
state follow the same layout: its temporaries up to the size of the trained weights and
their optimizer state are taken to be those. At fsdp f' a device holds f / f' of what it
holds of them at fsdp f; every other byte (the batches, activations, the decoder's weights)
is taken at its planned size, though the batches split over more devices too. The gathered
layer a sharded program holds at a time is not counted. Plain data and arithmetic: nothing
here starts JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

GPU_DEFAULT_SHARE = 0.75  # of a GPU's memory JAX preallocates for its arrays
GB = 1e9
# What `mesh.fsdp` divides (memory_plan.resident_bytes' names).
SHARDED = ("trained params", "optimizer state", "old policy", "LoRA base", "KL reference")
# The programs that compute gradients and the optimizer's new state (memory_plan's names).
TRAINING = ("train_step", "accumulate", "apply")


@dataclasses.dataclass(frozen=True)
class Target:
    """A device memory a run is checked against."""

    label: str  # the JSON key: an accelerator's name, or a size in GB ("40")
    title: str  # as the verdict names it: "80 GB (NVIDIA H100 SXM)"
    memory_gb: float
    gpu: bool  # JAX preallocates GPU_DEFAULT_SHARE of it

    @property
    def usable(self) -> float:
        """Bytes a run gets without XLA_PYTHON_CLIENT_MEM_FRACTION."""
        return self.memory_gb * GB * (GPU_DEFAULT_SHARE if self.gpu else 1.0)


def targets(accelerators: Sequence, sizes_gb: Sequence[float]) -> list[Target]:
    """The named accelerators whose memory is known, then the `--device_memory` sizes (read
    as GPUs' memory, as the plan always has)."""
    named = [
        Target(a.name, f"{a.memory_gb:g} GB ({a.title})", a.memory_gb, a.gpu)
        for a in accelerators
        if a.memory_gb
    ]
    return named + [Target(f"{gb:g}", f"{gb:g} GB", gb, True) for gb in sizes_gb]


@dataclasses.dataclass(frozen=True)
class Verdict:
    target: Target
    fits: bool  # within the whole memory
    fits_default: bool  # within what a run gets by default (the whole of a TPU's)

    def sentence(self) -> str:
        if self.fits_default:
            return f"fits {self.target.title}"
        if self.fits:
            return (
                f"fits {self.target.title} only with XLA_PYTHON_CLIENT_MEM_FRACTION above "
                "JAX's default"
            )
        return f"does not fit {self.target.title}"


def verdicts(total: int, checked: Sequence[Target]) -> list[Verdict]:
    return [Verdict(t, total <= t.memory_gb * GB, total <= t.usable) for t in checked]


def size(n: float) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A mesh estimated to fit `target`, or (devices 0) the sentence saying none would."""

    target: Target
    devices: int
    fsdp: int
    estimate: float  # bytes per device, the largest program's
    sharded: float  # bytes per device at the planned mesh that fsdp divides
    rest: float  # the largest program's other bytes, taken as they are
    flags: tuple[str, ...]  # the command line's flags that plan it

    def sentence(self) -> str:
        scaled = (
            f"of the largest program's total, {size(self.sharded)} per device is weights, "
            f"gradients and optimizer state that mesh.fsdp divides and {size(self.rest)} is "
            "the rest, taken as it is"
        )
        if not self.devices:
            return (
                f"to fit {self.target.title}: mesh.fsdp alone would not ({scaled}, already above "
                "it); fewer rows per device (more devices for the same prompts.batch_size and "
                "train.rows_per_minibatch, or sampling.denoise_rows), model.remat=True or LoRA "
                "(lora.rank) lower the rest: plan them to see"
            )
        where = f"{self.devices} device{'s' if self.devices > 1 else ''}"
        return (
            f"to fit {self.target.title}, an estimate: {where} at mesh.fsdp={self.fsdp} need "
            f"about {size(self.estimate)} per device ({scaled}); plan it to check, with "
            "these flags in place of this command line's own: " + " ".join(self.flags)
        )

    def as_json(self) -> dict:
        return {
            "target": self.target.label,
            "devices": self.devices or None,
            "fsdp": self.fsdp or None,
            "estimated_total_bytes": self.estimate if self.devices else None,
            "sharded_bytes": self.sharded,
            "rest_bytes": self.rest,
            "flags": list(self.flags),
        }


def _multiple(value: int, of: int) -> int:
    return -(-value // of) * of


def _flags(config, devices: int, fsdp: int, sequence: int = 1) -> tuple[str, ...]:
    """What to add to the command line to plan `devices` at `fsdp`: the mesh, and the batches
    the batch shards (devices / `sequence`) must divide (`build.check_batches`) raised to the
    next multiple."""
    flags = [f"--devices={devices}", f"--config.mesh.fsdp={fsdp}"]
    if config.mesh.data != -1:
        flags.append("--config.mesh.data=-1")
    for field, value in (
        ("prompts.batch_size", config.prompts.batch_size),
        ("train.rows_per_minibatch", config.train.rows_per_minibatch),
        ("sampling.denoise_rows", config.sampling.denoise_rows),  # 0: a whole level
    ):
        if value and value % (devices // sequence):
            flags.append(f"--config.{field}={_multiple(value, devices // sequence)}")
    return tuple(flags)


def divided(plan, program) -> float:
    """Bytes per device of `program`'s total that `mesh.fsdp` divides (module docstring)."""
    state = float(sum(plan.resident.get(k, 0) for k in SHARDED))
    if program.name not in TRAINING:
        return min(state, program.total)
    trained = plan.resident.get("trained params", 0) + plan.resident.get("optimizer state", 0)
    return min(state + min(program.temp, trained), program.total)


def suggest(plan, config, target: Target, max_devices: int) -> Suggestion:
    """The fewest devices (the planned count, doubled until `max_devices`), and on them the
    smallest `mesh.fsdp`, at which every program's estimated total fits `target`'s usable
    memory (module docstring: how it is estimated)."""
    fsdp, devices = plan.mesh["fsdp"], plan.devices
    sequence = plan.mesh.get("sequence", 1)  # kept: data x fsdp share what it leaves
    parts = [(p.total - divided(plan, p), divided(plan, p)) for p in plan.programs]
    largest = max(plan.programs, key=lambda p: p.total)
    sharded = divided(plan, largest)
    rest = largest.total - sharded

    def estimate(new_fsdp: int) -> float:
        return max(kept + split * fsdp / new_fsdp for kept, split in parts)

    count = devices
    while count <= max_devices:
        shares = count // sequence
        for new_fsdp in (f for f in range(fsdp, shares + 1) if shares % f == 0):
            if estimate(new_fsdp) <= target.usable:
                flags = _flags(config, count, new_fsdp, sequence)
                return Suggestion(target, count, new_fsdp, estimate(new_fsdp), sharded, rest, flags)
        count *= 2
    return Suggestion(target, 0, 0, 0.0, sharded, rest, ())
