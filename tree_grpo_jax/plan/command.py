"""Command line: will a run fit, and how long will it take? Its programs' per-device memory
and a roofline estimate of their time, before any weight is read.

    python -m tree_grpo_jax.plan --config=configs/sd35m.py [--devices=8] \\
        [--config.mesh.fsdp=4] [--config.lora.rank=32] [--device_memory=80,141] [--json] \\
        [--programs=rollout,train_step,evaluate,decode] [--accelerator=h100,tpu-v5p] \\
        [--efficiency=0.4] [--interconnect=450] \\
        [--compare=grpo,treegrpo | --compare=configs/a.py,configs/b.py]

The run's programs (the rollout, the train step, evaluation and the decode of one iteration's
leaves) are compiled from abstract shapes on the run's mesh and XLA's memory analysis of one
device is printed (`memory_plan.py` says what each figure is), then each program's FLOPs and
bytes with every loop counted (`program_cost.py`) and the seconds they take on the named
accelerators at a fraction of the roofline (`time_plan.py`): an estimate, not a measurement.
The largest program's total is checked against each named accelerator's memory and each
`--device_memory` size, one verdict each; when none holds it, the time is marked not
runnable (no hours) and a mesh estimated to fit is suggested (`fit.py`).
`--compare` plans several runs (method names, each the config with `tree.method` replaced
and its other settings kept, or config files, each its own settings given the same
`--config.*` overrides) and prints one table of their rows per leaf, FLOPs and seconds per
iteration, and what each row's setting is. The model is read from its
folder's JSON configs only: a local folder, a hub id (only its `*.json` files are
downloaded), or `--config.model.path=builtin:<name>` for a release whose configs the
family keeps as data (the hub id of such a release needs no download either).

`--devices=N` plans for N devices. With more than this machine has, the command starts itself
again on N simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N,
JAX_PLATFORMS=cpu): a CPU compile, whose buffer sizes approximate an accelerator's.

Exit status: 0 planned; 2 bad input (one `error:` sentence on stderr); 1 the plan could not
be printed (stdout refused it: a full disk).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys

from tree_grpo_jax import interrupts
from tree_grpo_jax.cli import common
from tree_grpo_jax.cli import config_flag as cli
from tree_grpo_jax.errors import first_line
from tree_grpo_jax.gpu_flags import GPU_FLAGS
from tree_grpo_jax.plan import accelerators, time_table
from tree_grpo_jax.plan import fit as plan_fit

PARSER = cli.config_parser("plan", __doc__)
DEVICES = cli.define(
    PARSER,
    "devices",
    "0",
    "Plan for this many devices (0: this machine's); more than it has are simulated on CPU.",
    metavar="N",
)
DEVICE_MEMORY = cli.define(
    PARSER,
    "device_memory",
    [],
    "More device memory sizes in GB (10^9 bytes) to check the fit against, beside each "
    "--accelerator's own.",
    type=cli.comma_list,
    metavar="GB,GB",
)
PROGRAMS = cli.define(
    PARSER,
    "programs",
    ["rollout", "train_step", "evaluate", "decode"],
    "The programs to compile (default: all of them).",
    type=cli.comma_list,
    metavar="NAME,NAME",
)
JSON = cli.define(
    PARSER,
    "json",
    False,
    "Print one JSON object (byte counts, FLOPs, seconds) instead of tables.",
    action="store_true",
)
ACCELERATOR = cli.define(
    PARSER,
    "accelerator",
    ["h100"],
    "Accelerators to estimate the time on: "
    + ", ".join(accelerators.ACCELERATORS)
    + ", or custom (with --peak_tflops and --bandwidth). Default: h100.",
    type=cli.comma_list,
    metavar="NAME,NAME",
)
PEAK_TFLOPS = cli.define(
    PARSER,
    "peak_tflops",
    None,
    "One accelerator's dense bf16 peak in TFLOP/s, replacing its data sheet's.",
    metavar="TFLOPS",
)
BANDWIDTH = cli.define(
    PARSER,
    "bandwidth",
    None,
    "One accelerator's memory bandwidth in TB/s, replacing its data sheet's.",
    metavar="TB_PER_S",
)
INTERCONNECT = cli.define(
    PARSER,
    "interconnect",
    None,
    "One accelerator's device-to-device bandwidth in GB/s one way, replacing its data sheet's "
    "(mesh.sequence's all-to-alls).",
    metavar="GB_PER_S",
)
EFFICIENCY = cli.define(
    PARSER,
    "efficiency",
    str(accelerators.DEFAULT_EFFICIENCY),
    f"The fraction of the roofline a program reaches (default {accelerators.DEFAULT_EFFICIENCY}; "
    "docs/plan.md says why).",
    metavar="FRACTION",
)
COMPARE = cli.define(
    PARSER,
    "compare",
    [],
    "Runs to compare: method names (each at this config's other settings) or config files "
    "(each its own settings).",
    type=cli.comma_list,
    metavar="RUN,RUN",
)

MAX_DEVICES = 4096
FORCE_DEVICES = "--xla_force_host_platform_device_count"
SIMULATED = "TREE_GRPO_JAX_PLAN_SIMULATED"  # set in the re-started command
# The CPU compiler hands fused chains (a matmul, softmax, matmul) to libraries whose scratch
# memory its buffer analysis does not see; without them every intermediate is a counted buffer.
# Its default scheduler orders work for parallelism and runs a rematerialised forward as soon
# as it can, holding what remat frees; the memory-minded one orders as accelerators do.
CPU_FLAGS = (
    *(f"--xla_cpu_experimental_{lib}_fusion_type=" for lib in ("ynn", "xnn", "onednn")),
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
)


def xla_flags(current: str, devices: int | None = None) -> str:
    """`current` XLA_FLAGS with the CPU library fusions off and, given `devices`, that many
    simulated CPU devices."""
    if devices is not None:
        current = re.sub(rf"{FORCE_DEVICES}=\S*", "", current)
        current += f" {FORCE_DEVICES}={devices}"
    missing = [f for f in CPU_FLAGS if f.split("=")[0] + "=" not in current]
    return " ".join([*current.split(), *missing])


def _fail(message: str) -> None:
    common.fail(message, common.EXIT_BAD_INPUT)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _float(text: str) -> float | None:
    """`text` as a finite number; None for anything else (text, nan, inf, 1e400)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def device_memory(values) -> list[float]:
    """`--device_memory` as finite positive numbers of GB; one sentence for anything else."""
    sizes = [_float(v) for v in values]
    if (DEVICE_MEMORY.present and not sizes) or not all(
        s is not None and 0 < s < accelerators.FIGURE_LIMIT for s in sizes
    ):
        _fail(
            f"--device_memory={','.join(values)} must be finite positive sizes in GB below "
            f"{accelerators.FIGURE_LIMIT:,.0f}, e.g. --device_memory=40,80."
        )
    return sizes


def device_count(text: str) -> int:
    """`--devices` as a whole number from 0 to MAX_DEVICES; one sentence for anything else."""
    if not text.strip().isdigit() or not 0 <= int(text) <= MAX_DEVICES:
        _fail(
            f"--devices={text} is not a device count to plan for; give a whole number from 1 "
            f"to {MAX_DEVICES} (0: this machine's)."
        )
    return int(text)


def figure(flag, text: str | None) -> float | None:
    """`--peak_tflops`, `--bandwidth` or `--interconnect` as a number (None when not given);
    one sentence for anything but a finite positive one (plan/accelerators.py checks the
    range)."""
    if text is None:
        return None
    value = _float(text)
    if value is None or not 0 < value < accelerators.FIGURE_LIMIT:
        _fail(accelerators.figure_sentence(f"--{flag.dest}", text))
    return value


def efficiency(text: str) -> float:
    value = _float(text)
    try:
        return accelerators.check_efficiency(float("nan") if value is None else value, text)
    except ValueError as e:
        _fail(str(e))


def simulate(count: int) -> None:
    """Starts this command again on `count` simulated CPU devices (never returns)."""
    # The restarted command carries its count: the same count again means XLA made fewer
    # devices than asked; any other value was left in the environment by hand, and is replaced.
    if os.environ.get(SIMULATED) == str(count):
        _fail(f"XLA did not make {count} simulated CPU devices; plan with fewer --devices.")
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(os.environ.get("XLA_FLAGS", ""), count),
        "JAX_PLATFORMS": "cpu",
        SIMULATED: str(count),
    }
    _progress(f"planning on {count} simulated CPU devices (this machine has fewer)")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tree_grpo_jax.plan", *sys.argv[1:]], env)


def plannable(config):
    """The config as validation sees it for a plan: reward models are not read, so a reward
    whose folder is not given yet is no error."""
    config = config.copy_and_resolve_references()
    for name in config.reward_models:
        if not config.reward_models[name]:
            config.reward_models[name] = "(not read by the plan)"
    return config


# ---------------------------------------------------------------------------------------------
# Output.


size = plan_fit.size
COLUMNS = ("arguments", "outputs", "temps", "aliased", "peak", "held", "total")


def _figures(p) -> tuple[int, ...]:
    return (p.argument, p.output, p.temp, p.alias, p.peak, p.held, p.total)


def fit(plan, config, checked) -> tuple[list, list]:
    """(a verdict per memory checked, and when none fits, a mesh estimated to fit each)."""
    verdicts = plan_fit.verdicts(plan.largest.total, checked)
    if any(v.fits for v in verdicts):
        return verdicts, []
    return verdicts, [plan_fit.suggest(plan, config, t, MAX_DEVICES) for t in checked]


def _fit_lines(plan, verdicts, suggestions) -> list[str]:
    largest = plan.largest
    head = f"largest total: {size(largest.total)} per device ({largest.name})"
    if not verdicts:
        return [f"{head}; no device memory to check it against (--device_memory=GB gives one)."]
    lines = [
        f"{head}: "
        + ", ".join(v.sentence() for v in verdicts)
        + f" per device (GB = 10^9 bytes; JAX on a GPU takes {plan_fit.GPU_DEFAULT_SHARE:.0%} "
        "of it by default)."
    ]
    if suggestions:
        lines.append(
            "nothing fits: the run as planned fits none of the memories checked, so its time "
            "below is marked NOT RUNNABLE and gives no hours."
        )
        lines += [f"{s.sentence()}." for s in suggestions]
    return lines


def gpu_notes() -> list[str]:
    """The XLA flags a GPU run starts with (launch/gpu.sh), each with why."""
    return [
        f"a GPU run starts with XLA_FLAGS {flag} (launch/gpu.sh, python -m "
        f"tree_grpo_jax.gpu_flags): {why}"
        for flag, why in GPU_FLAGS
    ]


def table(plan, config_path: str, verdicts, suggestions) -> str:
    kind = "simulated CPU" if FORCE_DEVICES in os.environ.get("XLA_FLAGS", "") else plan.platform
    where = f"{kind} device{'s' if plan.devices > 1 else ''}"
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [
        f"memory plan of {config_path}: {plan.model}",
        f"{plan.devices} {where}, mesh {mesh}; "
        f"{plan.training}; {plan.trained_parameters:,} trained of {plan.parameters:,} "
        f"denoiser parameters; samples {list(plan.sample_shape)}, conditioning "
        f"{list(plan.cond_shape)} per prompt",
        "",
    ]
    width = max(len(p.name) for p in plan.programs)
    lines.append(f"{'per device':<{width}}  " + "  ".join(f"{c:>10}" for c in COLUMNS))
    for p in plan.programs:
        cells = "  ".join(f"{size(n):>10}" for n in _figures(p))
        lines.append(f"{p.name:<{width}}  {cells}  {p.what}")
    lines += [
        "",
        "peak = arguments + outputs + temps - aliased: the buffers XLA assigned to the compiled "
        "program on one device (aliased: outputs written into donated arguments); held = what "
        "the run keeps on that device meanwhile without passing it in; total = peak + held.",
        "held between programs: "
        + ", ".join(f"{k} {size(v)}" for k, v in plan.resident.items() if v),
        "not planned: " + "; ".join(plan.not_planned) + ".",
        *(f"note: {n}." for n in plan.notes),
        *(f"note: {n}" for n in gpu_notes()),
    ]
    lines += _fit_lines(plan, verdicts, suggestions)
    return "\n".join(lines)


def _cost_json(cost) -> dict:
    """One call's FLOPs and bytes with every loop counted (`xla_flops`: XLA's own figure,
    every loop body once; `loops`: each loop's trip count, null where XLA does not know it)."""
    return {
        "flops": cost.flops,
        "transcendentals": cost.transcendentals,
        "bytes_accessed": cost.bytes_accessed,
        "xla_flops": cost.xla_flops,
        "loops": [loop.trips for loop in cost.loops],
    }


def as_json(plan, config_path: str, sizes_gb, verdicts, suggestions) -> dict:
    return {
        "config": config_path,
        "model": plan.model,
        "platform": plan.platform,
        "devices": plan.devices,
        "mesh": plan.mesh,
        "training": plan.training,
        "parameters": plan.parameters,
        "trained_parameters": plan.trained_parameters,
        "sample_shape": list(plan.sample_shape),
        "cond_shape": list(plan.cond_shape),
        "programs": {
            p.name: {
                "what": p.what,
                "argument_bytes": p.argument,
                "output_bytes": p.output,
                "temp_bytes": p.temp,
                "alias_bytes": p.alias,
                "generated_code_bytes": p.generated_code,
                "peak_bytes": p.peak,
                "held_bytes": p.held,
                "total_bytes": p.total,
                "compile_seconds": round(p.compile_s, 1),
                **_cost_json(p.cost),
            }
            for p in plan.programs
        },
        "held_bytes": plan.resident,
        "largest_total_bytes": plan.largest.total,
        "device_memory_gb": sizes_gb,
        # each accelerator named (by its name) and each --device_memory size (in GB)
        "memory_checked_gb": {v.target.label: v.target.memory_gb for v in verdicts},
        "fits": {v.target.label: v.fits for v in verdicts},
        "fits_default_gpu_share": {v.target.label: v.fits_default for v in verdicts},
        "suggestions": [s.as_json() for s in suggestions],
        "not_planned": list(plan.not_planned),
        "notes": list(plan.notes),
        "gpu_flags": [flag for flag, _ in GPU_FLAGS],
    }


# ---------------------------------------------------------------------------------------------
# The command.


def time_devices() -> list:
    """The accelerators of `--accelerator`, `--peak_tflops`, `--bandwidth` and
    `--interconnect`; one sentence for a name or figure that is not one."""
    names = ACCELERATOR.value
    figures = tuple(figure(f, f.value) for f in (PEAK_TFLOPS, BANDWIDTH, INTERCONNECT))
    if not names:
        _fail("--accelerator needs a name, e.g. --accelerator=h100.")
    if len(names) > 1 and figures != (None, None, None):
        _fail(
            "--peak_tflops, --bandwidth and --interconnect replace one accelerator's figures: "
            "name one."
        )
    try:
        return [accelerators.accelerator(name, *figures) for name in dict.fromkeys(names)]
    except ValueError as e:
        _fail(str(e))


def own_setting(config_path: str, method: str) -> str | None:
    """The config file beside `config_path` that holds `method` at its own setting, by the
    configs' naming (configs/sd35m.py -> configs/sd35m_grpo.py), when there is one."""
    path = pathlib.Path(config_path.partition(":")[0])
    own = path.with_name(f"{path.stem}_{method}.py")
    return str(own) if own.is_file() and own != path else None


def compared_configs(config) -> list[tuple[str, object, str]]:
    """`--compare`'s runs: (name, config, its setting in words) for each method name (the
    config with that `tree.method`, every other setting kept) or config file (its own
    settings, given the command line's `--config.*` overrides; named by its `name` field)."""
    from tree_grpo_jax import methods

    runs = []
    for entry in dict.fromkeys(COMPARE.value):
        if entry in methods.METHODS:
            other = config.copy_and_resolve_references()
            other.tree.method = entry
            setting = f"{cli.CONFIG.path} with tree.method={entry}, its other settings kept"
        elif entry.partition(":")[0].endswith(".py"):
            try:
                other = cli.load_config(entry)
                cli.apply_overrides(other, cli.CONFIG.overrides, entry)
            except cli.BadCommandLine as e:
                _fail(str(e))
            setting = f"{entry}'s own settings" + (
                ", with this command line's --config.* overrides" if cli.CONFIG.overrides else ""
            )
        else:
            _fail(
                f"--compare entry {entry!r} is neither a method ({', '.join(methods.METHODS)}) "
                "nor a config file (ending in .py)."
            )
        name = entry if entry in methods.METHODS else other.get("name", entry)
        runs.append((name, other, setting))
    return runs


def main(argv=None) -> None:
    del argv
    common.quiet_orbax()
    # Compiling needs no device memory: take none on an accelerator another job may be using.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    config = cli.CONFIG.value
    if config is None:
        _fail("give a config file, e.g. --config=configs/sd35m.py.")
    sizes_gb = device_memory(DEVICE_MEMORY.value)
    count = device_count(DEVICES.value)
    targets = time_devices()
    fraction = efficiency(EFFICIENCY.value)
    checked = plan_fit.targets(targets, sizes_gb)

    from tree_grpo_jax import config as cfg
    from tree_grpo_jax.models.base import ModelLoadError
    from tree_grpo_jax.plan import memory_plan, time_plan
    from tree_grpo_jax.rewards import registry as reward_registry

    if COMPARE.present and not COMPARE.value:
        _fail("--compare needs runs: method names or config files, e.g. --compare=grpo,treegrpo.")
    runs = compared_configs(config) if COMPARE.value else [(None, config, None)]
    bad_input = (cfg.ConfigError, ModelLoadError, FileNotFoundError, ValueError)
    for name, run_config, _ in runs:
        try:
            cfg.validate(plannable(run_config), known_rewards=reward_registry.available_rewards())
        except bad_input as e:
            _fail(f"{name}: {first_line(e)}" if name else first_line(e))

    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""))  # before JAX starts
    import jax

    devices = jax.devices()
    if count > len(devices):
        simulate(count)
    plans = []
    for name, run_config, setting in runs:
        if name:
            _progress(f"planning {name}")
        try:
            plan = memory_plan.plan_memory(
                run_config, devices[: count or None], progress=_progress, only=PROGRAMS.value
            )
        except bad_input as e:
            _fail(f"{name}: {first_line(e)}" if name else first_line(e))
        costs = {p.name: p.cost for p in plan.programs}
        times = [
            time_plan.plan_time(
                run_config, costs, plan.devices, a, fraction, plan.platform != "cpu", plan.exchange
            )
            for a in targets
        ]
        plans.append((name, run_config, setting, plan, times))
    config_path = cli.CONFIG.path
    if COMPARE.value:
        _print_comparison(plans, config_path)
        return
    _, _, _, plan, times = plans[0]
    verdicts, suggestions = fit(plan, config, checked)
    fitted = {v.target.label: v for v in verdicts}
    unfit = [_unfit(plan, fitted.get(t.accelerator.name), bool(suggestions)) for t in times]
    if JSON.value:
        out = as_json(plan, config_path, sizes_gb, verdicts, suggestions)
        out["time"] = [time_table.as_json(t, not u) for t, u in zip(times, unfit)]
        common.print_out(json.dumps(out, indent=2))
    else:
        blocks = [
            table(plan, config_path, verdicts, suggestions),
            *(time_table.table(t, u) for t, u in zip(times, unfit)),
        ]
        common.print_out("\n\n".join(blocks))


def _unfit(plan, verdict, nothing_fits: bool) -> str:
    """Why the run cannot run as planned on an accelerator ("": it fits, or its memory is not
    known and some memory checked holds the run)."""
    largest = f"the largest program's {size(plan.largest.total)} per device"
    if verdict is None:
        return f"{largest} fits none of the memories checked" if nothing_fits else ""
    return "" if verdict.fits else f"{largest} is above its {verdict.target.memory_gb:g} GB"


def _settings_note(plans, config_path: str) -> list[str]:
    """What each compared row's setting is, and where a method's own setting is kept."""
    lines = [f"{name}: {setting}." for name, _, setting, _, _ in plans]
    methods = [name for name, _, setting, _, _ in plans if "tree.method=" in setting]
    own = {m: own_setting(config_path, m) for m in methods}
    lines += [
        f"{m} has a config of its own beside {config_path}: {path} (--compare={config_path},"
        f"{path} compares the two files' own settings)."
        for m, path in own.items()
        if path
    ]
    return lines


def _print_comparison(plans, config_path: str) -> None:
    from tree_grpo_jax.plan import time_plan

    per_accelerator = []
    for index in range(len(plans[0][4])):
        rows = []
        for name, run_config, _, plan, times in plans:
            leaves, rollout_rows, train_rows = time_plan.rows_per_leaf(run_config)
            memory = times[index].accelerator.memory_gb
            runnable = None if not memory else plan.largest.total <= memory * plan_fit.GB
            rows.append(
                time_table.Compared(
                    name,
                    leaves,
                    rollout_rows,
                    train_rows,
                    plan.largest.total,
                    times[index],
                    runnable,
                )
            )
        per_accelerator.append(rows)
    if JSON.value:
        compared = [time_table.compare_json(rows) for rows in per_accelerator]
        settings = {name: setting for name, _, setting, _, _ in plans}
        out = {"config": config_path, "settings": settings, "compared": compared}
        common.print_out(json.dumps(out, indent=2))
    else:
        devices = plans[0][3].devices
        blocks = [time_table.compare_table(rows, devices) for rows in per_accelerator]
        common.print_out("\n\n".join([*blocks, "\n".join(_settings_note(plans, config_path))]))


def run() -> None:
    # XLA's C++ log (read when JAX starts) warns of a "Very slow compile? If you want to file a
    # bug" past two minutes, which reads as a failure: the plan's own lines say what compiles
    # and for how long; errors still come back as exceptions.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    common.starting("plan")
    interrupts.set_stop_line(lambda name: f"{name} stopped the plan; nothing was written.")
    main(cli.parse_flags(sys.argv, PARSER))


if __name__ == "__main__":
    run()
