"""The accelerators the plan estimates time on: each one's dense bfloat16 peak and memory
bandwidth from its vendor's data sheet (docs/plan.md cites each), and the share of that
roofline a program is assumed to reach. Plain data: the command reads it before JAX starts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's dense bfloat16 peak and memory bandwidth, as its data sheet gives them."""

    name: str
    title: str
    peak_flops: float  # FLOP/s, dense bfloat16 (no structured sparsity)
    bandwidth: float  # bytes/s of its high-bandwidth memory
    memory_gb: float = 0.0  # 10^9 bytes; 0 where unknown (`--accelerator=custom`)
    gpu: bool = True  # JAX preallocates a share of a GPU's memory (not of a TPU's)


# Vendors' data sheets; docs/plan.md cites each one.
ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("h100", "NVIDIA H100 SXM", 989e12, 3.35e12, 80),
        Accelerator("h200", "NVIDIA H200 SXM", 989e12, 4.8e12, 141),
        Accelerator("a100", "NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80),
        Accelerator("b200", "NVIDIA B200 (HGX)", 2250e12, 8e12, 180),
        # A researcher's own card: bf16 with float32 accumulation runs at half its fp16 rate.
        Accelerator("rtx4090", "NVIDIA GeForce RTX 4090", 165.2e12, 1.008e12, 24),
        Accelerator("tpu-v5e", "Google TPU v5e", 197e12, 0.819e12, 16, gpu=False),
        Accelerator("tpu-v5p", "Google TPU v5p", 459e12, 2.765e12, 95, gpu=False),
        Accelerator("tpu-v6e", "Google TPU v6e (Trillium)", 918e12, 1.64e12, 32, gpu=False),
    )
}
# Above any accelerator's TFLOP/s or TB/s (and any memory in GB): a figure this large is a typo.
FIGURE_LIMIT = 1e6
UNITS = {"--peak_tflops": ("TFLOP/s", "989"), "--bandwidth": ("TB/s", "3.35")}


def figure_sentence(figure: str, given: str) -> str:
    """The refusal of `--peak_tflops` or `--bandwidth` given as the text `given`."""
    unit, example = UNITS[figure]
    return (
        f"{figure}={given} must be a finite positive number of {unit} below {FIGURE_LIMIT:,.0f}, "
        f"e.g. {figure}={example}."
    )


# The share of the roofline bound a program is assumed to reach; docs/plan.md says why.
DEFAULT_EFFICIENCY = 0.35


def accelerator(
    name: str, peak_tflops: float | None = None, bandwidth_tb: float | None = None
) -> Accelerator:
    """The named accelerator, with either figure replaced when given; name "custom" takes
    both from the arguments. ValueError with one sentence for an unknown name or a figure
    that is not a finite positive number below FIGURE_LIMIT."""
    for figure, value in (("--peak_tflops", peak_tflops), ("--bandwidth", bandwidth_tb)):
        if value is not None and not (0 < value < FIGURE_LIMIT):
            raise ValueError(figure_sentence(figure, f"{value:g}"))
    name = name.strip().lower()  # H100, TPU-v5p
    if name == "custom":
        if peak_tflops is None or bandwidth_tb is None:
            raise ValueError("--accelerator=custom needs both --peak_tflops and --bandwidth.")
        return Accelerator("custom", "custom", peak_tflops * 1e12, bandwidth_tb * 1e12)
    if name not in ACCELERATORS:
        raise ValueError(
            f"unknown accelerator {name!r}; name one of {', '.join(ACCELERATORS)}, or custom "
            "with --peak_tflops and --bandwidth."
        )
    chosen = ACCELERATORS[name]
    return dataclasses.replace(
        chosen,
        peak_flops=chosen.peak_flops if peak_tflops is None else peak_tflops * 1e12,
        bandwidth=chosen.bandwidth if bandwidth_tb is None else bandwidth_tb * 1e12,
    )


def check_efficiency(efficiency: float, given: str | None = None) -> float:
    """`efficiency` when it is a fraction in (0, 1]; ValueError with one sentence naming it as
    `given` (the command line's text) otherwise."""
    if not 0 < efficiency <= 1:
        raise ValueError(
            f"--efficiency={given or f'{efficiency:g}'} must be a fraction of the roofline "
            "above 0 and at most 1, e.g. --efficiency=0.4."
        )
    return efficiency
