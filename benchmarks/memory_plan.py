"""The memory plan of the SD1.5 and SD3.5-Medium runs at several FSDP sizes on 8 simulated
devices, full fine-tuning and LoRA: `python -m tree_grpo_jax.plan` once per setting, its JSON
gathered into one file and one table.

    python -m benchmarks.memory_plan          # -> runs/benchmarks/memory_plan/memory_plan.{json,md}
    python -m benchmarks.memory_plan --configs sd15 --fsdp 1,8 --lora 0
    python -m benchmarks.memory_plan --out benchmarks/results     # adds to the committed results
    python -m benchmarks.memory_plan --out benchmarks/results --table-only   # table from the JSON

Every setting plans a config's own run with the release's built-in configs
(`--config.model.path=builtin:<name>`), one prompt per device
(`--config.prompts.batch_size=<devices>`: the rollout splits its prompts over every device),
on more than one device one train row per device (`--config.train.rows_per_minibatch`), and
`--config.mesh.fsdp=K` (mesh.data takes the rest). The JSON is written after each
setting; settings it already holds are not planned again, so an interrupted run continues
where it stopped (`--fresh` starts over). Results go to `runs/benchmarks/memory_plan`
(git-ignored, under the working directory) unless `--out` is given; the committed results in
`benchmarks/results/` change only with `--out benchmarks/results`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import default_out
from tree_grpo_jax.errors import OneLineErrors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = {
    "sd15": "builtin:sd15",
    "sd35m": "builtin:sd35m",
    "flux_branchgrpo": "builtin:flux-dev",
}
GB = 1e9


def parse_args(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="sd15,sd35m", help="configs/<name>.py, comma-separated")
    p.add_argument("--fsdp", default="1,2,4,8", help="mesh.fsdp values")
    p.add_argument("--lora", default="0,32", help="lora.rank values (0: full fine-tuning)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument(
        "--rows-per-device",
        type=int,
        default=1,
        help="train rows per device on more than one device (rows_per_minibatch = devices x this)",
    )
    p.add_argument(
        "--out",
        default=default_out("memory_plan"),
        help="results folder (default runs/benchmarks/memory_plan; benchmarks/results updates "
        "the committed results)",
    )
    p.add_argument("--table-only", action="store_true", help="rewrite the table from the JSON")
    p.add_argument("--fresh", action="store_true", help="plan every setting again")
    return p.parse_args(argv)


def command(config: str, fsdp: int, rank: int, devices: int, rows_per_device: int = 1) -> list[str]:
    args = [
        f"--config=configs/{config}.py",
        f"--config.model.path={RELEASES[config]}",
        f"--devices={devices}",
        f"--config.prompts.batch_size={devices}",
        f"--config.mesh.fsdp={fsdp}",
    ]
    if devices > 1:  # rows_per_device rows per device, one prompt per device
        args.append(f"--config.train.rows_per_minibatch={devices * rows_per_device}")
    if rank:
        args.append(f"--config.lora.rank={rank}")
    return [sys.executable, "-m", "tree_grpo_jax.plan", *args, "--json"]


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _fits(total: int, gb: float) -> str:
    """yes: within JAX's default 75% of the memory; "over 75%": only with more of it."""
    if total <= 0.75 * gb * GB:
        return "yes"
    return "over 75%" if total <= gb * GB else "no"


def table(rows: list[dict]) -> str:
    """Per-device GiB: each program's peak, the largest peak + held, and what it fits (GB =
    10^9 bytes)."""
    names = ("rollout", "train_step", "evaluate", "decode")
    lines = [
        "| config | training | mesh (data x fsdp) | rows per device | "
        + " | ".join(names)
        + " | largest total (program) | 80 GB | 141 GB | compile s |",
        "|---" * (len(names) + 8) + "|",
    ]
    for row in rows:
        plan = row["plan"]
        programs = plan["programs"]
        largest = max(programs.values(), key=lambda p: p["total_bytes"])
        which = next(n for n, p in programs.items() if p is largest)
        peaks = [_gib(programs[n]["peak_bytes"]) if n in programs else "-" for n in names]
        mesh = plan["mesh"]
        fits = [_fits(largest["total_bytes"], gb) for gb in (80, 141)]
        compile_s = sum(p["compile_seconds"] for p in programs.values())
        training = "full" if row["lora"] == 0 else f"LoRA r{row['lora']}"
        # one device trains its config's own rows per minibatch
        rows = row.get("rows_per_device", 1) if plan["devices"] > 1 else "config's"
        lines.append(
            f"| {row['config']} | {training} | {mesh['data']} x {mesh['fsdp']} | {rows} | "
            + " | ".join(peaks)
            + f" | {_gib(largest['total_bytes'])} ({which}) | {fits[0]} | {fits[1]} | "
            f"{compile_s:.0f} |"
        )
    return "\n".join(lines)


def _key(row: dict) -> tuple:
    return (
        row["config"],
        row["lora"],
        row["fsdp"],
        row["plan"]["devices"],
        row.get("rows_per_device", 1),
    )


def _write(out: str, rows: list[dict]) -> None:
    rows.sort(key=_key)
    with open(os.path.join(out, "memory_plan.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "memory_plan.md"), "w") as f:
        f.write(table(rows) + "\n")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_plan.json")
    if args.table_only:
        if not os.path.exists(path):
            raise SystemExit(
                f"error: there is no {path} to make the table from; --out names the results "
                "folder (--out benchmarks/results for the committed one)."
            )
        with open(path) as f:
            rows = json.load(f)
        _write(args.out, rows)
        print(table(rows))
        return rows
    rows = []
    if os.path.exists(path) and not args.fresh:
        with open(path) as f:
            rows = json.load(f)
    done_before = {_key(r) for r in rows}
    for config in args.configs.split(","):
        for rank in (int(r) for r in args.lora.split(",")):
            for fsdp in (int(k) for k in args.fsdp.split(",")):
                key = (config, rank, fsdp, args.devices, args.rows_per_device)
                if key in done_before:
                    continue
                cmd = command(config, fsdp, rank, args.devices, args.rows_per_device)
                print(" ".join(cmd[1:]), flush=True)
                start = time.perf_counter()
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr, flush=True)
                    continue
                rows.append(
                    {
                        "config": config,
                        "lora": rank,
                        "fsdp": fsdp,
                        "rows_per_device": args.rows_per_device,
                        "command": " ".join(["python", *cmd[1:-1]]),
                        "seconds": round(time.perf_counter() - start),
                        "plan": json.loads(done.stdout),
                    }
                )
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                _write(args.out, rows)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
