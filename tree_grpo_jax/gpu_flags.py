"""The XLA flags a GPU run starts with: the one list the launch scripts, the docs and the
memory plan's notes read.

    python -m tree_grpo_jax.gpu_flags        # prints $XLA_FLAGS with the missing ones added

These are the flags JAX's GPU performance guide recommends for training
(https://docs.jax.dev/en/latest/gpu_performance_tips.html) that suit a data-parallel or
fsdp-sharded denoiser and that the other public JAX GPU recipes (MaxText's, NVIDIA's
JAX-Toolbox) agree on; docs/devices-and-hosts.md says which were left out and why. A flag
already in the user's XLA_FLAGS keeps the user's value, so
`XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false launch/gpu.sh ...` turns it off.
XLA reads its flags once, when JAX starts its backend: they go in the environment before
Python starts, which is why the launch scripts call this module rather than the run setting
them itself.
"""

import os
import sys

# (flag=value, why): each why is one sentence, printed by the plan and tabled in the docs.
GPU_FLAGS: tuple[tuple[str, str], ...] = (
    (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "Schedules the collectives (fsdp's weight all-gathers and gradient reduce-scatters, "
        "data parallelism's gradient all-reduce) to run while independent compute goes on, "
        "instead of each device waiting on them; XLA leaves it off by default.",
    ),
)


def _name(token: str) -> str:
    """`--flag=value`, `-flag=value` or `--flag` -> `flag`."""
    return token.lstrip("-").split("=", 1)[0]


def with_gpu_flags(current: str) -> str:
    """`current` XLA_FLAGS with each of GPU_FLAGS it does not name appended; a flag it names
    keeps its value there, whatever it is."""
    tokens = current.split()
    named = {_name(t) for t in tokens}
    missing = [flag for flag, _ in GPU_FLAGS if _name(flag) not in named]
    return " ".join([*tokens, *missing])


def main(argv: list[str]) -> int:
    if argv:
        usage = "usage: python -m tree_grpo_jax.gpu_flags (prints XLA_FLAGS with GPU_FLAGS added)"
        print(usage, file=sys.stdout if argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv[0] in ("-h", "--help") else 2
    print(with_gpu_flags(os.environ.get("XLA_FLAGS", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
