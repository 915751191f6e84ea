"""The run's rollout and evaluation compiled ahead, side by side, before anything is written.

Both programs are lowered for exactly the arguments the run will pass them (`Trainer.
lowered_programs`) and compiled in parallel threads (XLA compiles without holding Python's
lock), so the first iteration and the first evaluation find them compiled. XLA's memory
analysis of each compiled program, with what the run keeps on the device meanwhile (the
optimizer state, the KL reference), is then held against the device's memory: a tree or an
eval set too large for it is refused in one sentence, naming the largest batch that fits,
before the first sample is drawn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable

import jax

from tree_grpo_jax import config as cfg
from tree_grpo_jax import sharding
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import remat_mode
from tree_grpo_jax.run import memory
from tree_grpo_jax.run.train_step import old_params


@dataclasses.dataclass(frozen=True)
class ProgramFit:
    name: str
    peak: int  # XLA's buffers of the program on one device, less what outputs alias
    argument: int  # of which its arguments
    held: int  # what the run keeps on the device meanwhile that it does not take
    compile_s: float

    @property
    def total(self) -> int:
        return self.peak + self.held


def memory_limit() -> tuple[int, str]:
    """Bytes one of this process's devices can hold, and what they are. CPU devices share the
    host's memory: each gets its share."""
    devices = jax.local_devices()
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{devices[0].device_kind} memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if len(devices) > 1:
        return host // len(devices), f"host memory (a 1/{len(devices)} share per device)"
    return host, "host memory"


def device_bytes(tree) -> int:
    """What the arrays of `tree` occupy on this process's first device."""
    device = jax.local_devices()[0]
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def compile_programs(
    lowered: dict, held: dict[str, int], progress: Callable[[str], None] = lambda s: None
) -> dict[str, ProgramFit]:
    """Compiles every lowered program at once; their memory on one device."""

    def compile_one(name):
        start = time.perf_counter()
        compiled = lowered[name].compile()
        return compiled, time.perf_counter() - start

    start = time.perf_counter()
    progress(f"compiling {_listed(lowered)} side by side (the first run of a config is slow)...")
    done = {}
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        futures = {pool.submit(compile_one, name): name for name in lowered}
        for future in concurrent.futures.as_completed(futures):
            done[futures[future]] = future.result()
            progress(f"  compiled the {futures[future]} in {done[futures[future]][1]:.1f} s")
    done = {name: done[name] for name in lowered}
    progress(f"compiled in {time.perf_counter() - start:.0f} s")
    fits = {}
    for name, (compiled, seconds) in done.items():
        stats = memory.read(compiled)
        if stats is None:  # a backend without the analysis: nothing to hold against
            continue
        fits[name] = ProgramFit(name, stats.peak, stats.argument, held[name], seconds)
    return fits


def _listed(programs) -> str:
    names = [f"the {name}" for name in programs]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def largest_batch(fit: ProgramFit, rows: int, limit: int) -> int:
    """How many of a program's `rows` per device would fit in `limit`, its memory beyond its
    arguments (the weights) and what is held taken as growing with the rows."""
    per_row = max(fit.peak - fit.argument, 1) / rows
    return max(int((limit - fit.held - fit.argument) // per_row), 0)


def check_fits(
    config, fits: dict[str, ProgramFit], per_device: int, limit: int, where: str
) -> None:
    """One sentence for the first program that cannot fit in `limit` bytes per device
    (`per_device`: how many of a process's devices its batches split over), naming the
    largest setting of its batch that would."""
    samples = config.prompts.eval_count * config.eval.samples_per_prompt
    remat = "" if remat_mode(config.model.remat) != "none" else " (or set model.remat=True)"
    # when not even one fits, the sample's own size may be what to lower
    sized_by = model_registry.sample_settings(config.model)
    sample = f", or {sized_by}" if sized_by else ""
    sizes = {  # program -> (its rows per device, the setting that sizes them, when none fit)
        "rollout": (
            config.prompts.batch_size // per_device,
            "prompts.batch_size={}",
            "even one prompt's tree does not fit: lower tree.k, tree.window, tree.num_trees "
            f"or tree.group_size{sample}",
        ),
        "evaluation": (
            -(-samples // per_device),
            "at most {} eval samples (prompts.eval_count x eval.samples_per_prompt)",
            f"even one eval sample does not fit{': lower ' + sized_by if sized_by else ''}",
        ),
        "train step": (
            config.train.rows_per_minibatch // per_device,
            "train.rows_per_minibatch={}",
            f"even one row does not fit{remat}{sample}",
        ),
    }
    for name, (rows, setting, none_fit) in sizes.items():
        fit = fits.get(name)
        if fit is None or fit.total <= limit:
            continue
        largest = largest_batch(fit, rows, limit)
        advice = f"{setting.format(largest * per_device)} would fit" if largest else none_fit
        if largest and name == "train step":
            advice += remat
        raise cfg.ConfigError(
            f"the {name} needs about {_gib(fit.total)} per device (XLA's plan of the compiled "
            f"program, with what the run keeps meanwhile), more than the {_gib(limit)} of "
            f"{where}; {advice}."
        )


def _held(trainer, state) -> dict[str, int]:
    """Per program, what stays on the device while it runs without being its argument."""
    # the state's other parts; an old policy (DiffusionNFT) is the rollout's argument while
    # the trained weights stay: the same bytes either way
    old = old_params(state)
    optimizer = device_bytes(state.opt_state) + (0 if old is None else device_bytes(old))
    if trainer.adapter is not None:
        # the programs take the base and the factors, less the kernels merged up front
        # (outside scanned runs) whose merged copies they take instead
        base, factors = trainer.adapter.merged_up_front(state.params)
        kept = optimizer + device_bytes(factors)
        with_kl = trainer.kl_reference is not None  # then the eval takes the whole base
        return {
            "rollout": kept + device_bytes(base),
            "evaluation": kept + (not with_kl) * device_bytes(base),
            "train step": 0,  # it takes them all; the rollout's tree is small beside it
        }
    # full fine-tuning keeps a copy of the initial weights for the KL (taken by the eval)
    copy = trainer.kl_reference if trainer.kl_reference is not None else trainer.ref_params
    return {"rollout": optimizer + device_bytes(copy), "evaluation": optimizer, "train step": 0}


def precompile(trainer, state, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Compiles the run's rollout and evaluation ahead and refuses, in one sentence, a run
    whose programs cannot fit in the device's memory; returns their fits."""
    start = time.perf_counter()
    progress("tracing the run's programs...")
    lowered = trainer.lowered_programs(state)
    progress(f"traced {_listed(lowered)} in {time.perf_counter() - start:.1f} s")
    fits = compile_programs(lowered, _held(trainer, state), progress)
    if "train step" not in lowered:  # updates spanning minibatches: compiled at first use
        progress(
            "the train step (train.updates_per_iteration spreads an update over minibatches) "
            "compiles during the first iteration."
        )
    limit, where = memory_limit()
    per_device = sharding.num_batch_shards(trainer.mesh) // jax.process_count()
    check_fits(trainer.config, fits, per_device, limit, where)
    return fits
