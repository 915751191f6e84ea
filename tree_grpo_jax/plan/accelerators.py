"""The accelerators the plan estimates time on: each one's dense bfloat16 peak, memory
bandwidth and device-to-device bandwidth from its vendor's data sheet (docs/plan.md cites
each), and the share of that roofline a program is assumed to reach. Plain data: the command
reads it before JAX starts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's dense bfloat16 peak, memory bandwidth and interconnect bandwidth, as its
    data sheet gives them."""

    name: str
    title: str
    peak_flops: float  # FLOP/s, dense bfloat16 (no structured sparsity)
    bandwidth: float  # bytes/s of its high-bandwidth memory
    memory_gb: float = 0.0  # 10^9 bytes; 0 where unknown (`--accelerator=custom`)
    gpu: bool = True  # JAX preallocates a share of a GPU's memory (not of a TPU's)
    # bytes/s one device sends to the others of its host or slice, one direction (what
    # `mesh.sequence`'s all-to-alls move at); 0 where unknown
    interconnect: float = 0.0


# Vendors' data sheets; docs/plan.md cites each one.
ACCELERATORS = {
    a.name: a
    for a in (
        # NVLink 4: 900 GB/s both directions together, 450 each way
        Accelerator("h100", "NVIDIA H100 SXM", 989e12, 3.35e12, 80, interconnect=450e9),
        Accelerator("h200", "NVIDIA H200 SXM", 989e12, 4.8e12, 141, interconnect=450e9),
        # NVLink 3: 600 GB/s both directions
        Accelerator("a100", "NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80, interconnect=300e9),
        # NVLink 5: 1.8 TB/s both directions
        Accelerator("b200", "NVIDIA B200 (HGX)", 2250e12, 8e12, 180, interconnect=900e9),
        # A researcher's own card: bf16 with float32 accumulation runs at half its fp16 rate;
        # no NVLink, PCIe 4.0 x16 (32 GB/s each way)
        Accelerator(
            "rtx4090", "NVIDIA GeForce RTX 4090", 165.2e12, 1.008e12, 24, interconnect=32e9
        ),
        # ICI per chip, both directions together: 400 (v5e), 1,200 (v5p), 800 GB/s (v6e)
        Accelerator("tpu-v5e", "Google TPU v5e", 197e12, 0.819e12, 16, False, 200e9),
        Accelerator("tpu-v5p", "Google TPU v5p", 459e12, 2.765e12, 95, False, 600e9),
        Accelerator("tpu-v6e", "Google TPU v6e (Trillium)", 918e12, 1.64e12, 32, False, 400e9),
    )
}
# Above any accelerator's TFLOP/s, TB/s or GB/s (and any memory in GB): a figure this large is
# a typo.
FIGURE_LIMIT = 1e6
UNITS = {
    "--peak_tflops": ("TFLOP/s", "989"),
    "--bandwidth": ("TB/s", "3.35"),
    "--interconnect": ("GB/s", "450"),
}


def figure_sentence(figure: str, given: str) -> str:
    """The refusal of `--peak_tflops`, `--bandwidth` or `--interconnect` given as the text
    `given`."""
    unit, example = UNITS[figure]
    return (
        f"{figure}={given} must be a finite positive number of {unit} below {FIGURE_LIMIT:,.0f}, "
        f"e.g. {figure}={example}."
    )


# The share of the roofline bound a program is assumed to reach; docs/plan.md says why.
DEFAULT_EFFICIENCY = 0.35


def accelerator(
    name: str,
    peak_tflops: float | None = None,
    bandwidth_tb: float | None = None,
    interconnect_gb: float | None = None,
) -> Accelerator:
    """The named accelerator, with any figure replaced when given; name "custom" takes the
    peak and the bandwidth from the arguments (and the interconnect, when given). ValueError
    with one sentence for an unknown name or a figure that is not a finite positive number
    below FIGURE_LIMIT."""
    figures = (
        ("--peak_tflops", peak_tflops),
        ("--bandwidth", bandwidth_tb),
        ("--interconnect", interconnect_gb),
    )
    for figure, value in figures:
        if value is not None and not (0 < value < FIGURE_LIMIT):
            raise ValueError(figure_sentence(figure, f"{value:g}"))
    name = name.strip().lower()  # H100, TPU-v5p
    if name == "custom":
        if peak_tflops is None or bandwidth_tb is None:
            raise ValueError("--accelerator=custom needs both --peak_tflops and --bandwidth.")
        link = 0.0 if interconnect_gb is None else interconnect_gb * 1e9
        return Accelerator(
            "custom", "custom", peak_tflops * 1e12, bandwidth_tb * 1e12, interconnect=link
        )
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
        interconnect=chosen.interconnect if interconnect_gb is None else interconnect_gb * 1e9,
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
