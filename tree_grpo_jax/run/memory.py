"""XLA's memory plan of one compiled program on one device, read in one place: for the memory
plan (`python -m tree_grpo_jax.plan`), the fit check before a run's first iteration, and the
accelerator benchmark."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProgramBytes:
    """A compiled program's buffers on one device, in bytes."""

    argument: int
    output: int
    temp: int
    alias: int  # outputs written into donated arguments
    generated_code: int

    @property
    def peak(self) -> int:
        """What the program holds at once: its buffers, less the outputs that reuse a
        donated argument's."""
        return self.argument + self.output + self.temp - self.alias


def read(compiled) -> ProgramBytes | None:
    """`compiled.memory_analysis()` as bytes; None where the backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis raises, some return None
        return None
    if stats is None:
        return None
    return ProgramBytes(
        argument=int(stats.argument_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        generated_code=int(stats.generated_code_size_in_bytes),
    )
