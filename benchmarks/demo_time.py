"""The README's demo timed whole, cold and warm, for one or more checkouts side by side.

    python -m benchmarks.demo_time --checkout before=/path/to/old/checkout --checkout after=. \
        --rounds 3 --out=benchmarks/results

Each round runs every checkout in turn: a cold run (a fresh, empty compilation cache folder,
`$TREE_GRPO_JAX_COMPILE_CACHE`) and then a warm one (the same folder, filled by the cold
run), each `python -m tree_grpo_jax.main --config=configs/tiny.py` in a fresh workdir, from
the checkout's root (its package comes first on the path). Interleaving the checkouts round by
round puts them under the same load on a shared machine, so their ratios compare even when
their seconds do not.

Per run: the wall clock of the whole command, its CPU seconds (user + system), the load
average at its start, the seconds from its start at which its progress lines arrived (traced,
or lowered from the program store; compiled, first evaluation, first iteration, done) and the
traced (or lowered) and compiled seconds the lines report, and a digest of every number its
metrics.jsonl holds but the timings (equal digests: the same numbers, bit for bit).
Results: `<out>/demo_time.json` (written after every run) and a table of medians on stdout;
`<out>` is `runs/benchmarks/demo_time` unless `--out` says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import default_out
from tree_grpo_jax.errors import OneLineErrors

COMMAND = [sys.executable, "-m", "tree_grpo_jax.main", "--config=configs/tiny.py"]
MARKS = {  # progress line -> the name of the moment it arrives
    # "lowered ... (traced by an earlier run)" when the program store held them
    "traced": re.compile(r"^(?:traced|lowered) .* in ([0-9.]+) s"),
    "compiled": re.compile(r"^compiled in ([0-9.]+) s"),
    "first_eval": re.compile(r"^eval after 0 iterations"),
    "first_iteration": re.compile(r"^\[\s*1/"),
    "done": re.compile(r"^done: "),
}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(checkout: str, cache: str, workdir: str, extra: list[str]) -> dict:
    """One demo run from `checkout` with the cache folder `cache`; what it took."""
    env = {**os.environ, "TREE_GRPO_JAX_COMPILE_CACHE": cache, "PYTHONUNBUFFERED": "1"}
    load = os.getloadavg()[0]
    cpu0, start = _cpu_seconds(), time.perf_counter()
    proc = subprocess.Popen(
        [*COMMAND, f"--workdir={workdir}", *extra],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    at, reported = {}, {}
    for line in proc.stdout:
        for name, pattern in MARKS.items():
            match = pattern.match(line.strip())
            if match and name not in at:
                at[name] = round(time.perf_counter() - start, 2)
                if match.groups():
                    reported[f"{name}_s"] = float(match.group(1))
    code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the demo in {checkout} exited with status {code}.")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        metrics = [{k: v for k, v in json.loads(line).items() if "time" not in k} for line in f]
    # every number the run logged but its timings, as parsed JSON (floats to the last bit)
    digest = hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(_cpu_seconds() - cpu0, 2),
        "load_at_start": load,
        "arrived_s": at,
        **reported,
        "metrics_rows": len(metrics),
        "metrics_sha256": digest,
    }


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout",
        action="append",
        required=True,
        help="NAME=PATH of a checkout's root (repeat to compare; the first is the baseline)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=default_out("demo_time"))
    parser.add_argument("extra", nargs="*", help="more flags for the demo command")
    args = parser.parse_args(argv)
    checkouts = dict(c.split("=", 1) for c in args.checkout)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo_time.json")
    results = {
        "command": " ".join(["python", *COMMAND[1:], *args.extra]),
        "checkouts": checkouts,
        "runs": {name: {"cold": [], "warm": []} for name in checkouts},
    }
    scratch = tempfile.mkdtemp(prefix="demo_time_")
    try:
        for r in range(args.rounds):
            for name, checkout in checkouts.items():
                cache = os.path.join(scratch, f"cache_{name}_{r}")
                for kind in ("cold", "warm"):
                    workdir = os.path.join(scratch, f"run_{name}_{r}_{kind}")
                    run = run_once(os.path.abspath(checkout), cache, workdir, args.extra)
                    results["runs"][name][kind].append(run)
                    print(
                        f"round {r + 1} {name} {kind}: {run['wall_s']:.1f} s wall, "
                        f"{run['cpu_s']:.1f} s CPU, load {run['load_at_start']:.1f}",
                        flush=True,
                    )
                    with open(path, "w") as f:
                        json.dump(results, f, indent=1)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = next(iter(checkouts))
    print(f"\nmedians of {args.rounds} rounds (wall s / CPU s), ratio to {base}:")
    for kind in ("cold", "warm"):
        for name in checkouts:
            runs = results["runs"][name][kind]
            wall, cpu = _median(runs, "wall_s"), _median(runs, "cpu_s")
            ratio = wall / _median(results["runs"][base][kind], "wall_s")
            first = results["runs"][base]["cold"][0]["metrics_sha256"]
            same = all(run["metrics_sha256"] == first for run in runs)
            print(
                f"  {kind:4s} {name:8s} {wall:7.1f} / {cpu:6.1f}  x{ratio:.2f}  "
                f"metrics {'identical' if same else 'DIFFER'} to {base}'s first cold run"
            )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
