"""The run's rollout and evaluation compiled ahead, side by side, before anything is written.

Both programs are lowered for exactly the arguments the run will pass them (`Trainer.
lower_programs`) and compiled in parallel threads, each from the moment it is lowered (XLA
compiles without holding Python's lock, so the next program traces meanwhile), so the first
iteration and the first evaluation find them compiled. A tiny-model run lowers the programs an
earlier run traced (`run.program_store`), or traces, exports and stores them. XLA's memory
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
from tree_grpo_jax.run import memory, program_store
from tree_grpo_jax.run.train_step import old_params

MAX_PROGRAMS = 4  # a run's programs compiled ahead: rollout, evaluation, one or two steps


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
    lowered,
    held: dict[str, int],
    progress: Callable[[str], None] = lambda s: None,
    on_lowered: Callable[[list[str]], None] = lambda names: None,
) -> dict[str, ProgramFit]:
    """Compiles every lowered program (a dict, or (name, lowered) pairs as each is ready),
    each in its own thread from the moment it arrives (XLA compiles without holding Python's
    lock, so the next one traces meanwhile); their memory on one device. `on_lowered(names)`
    runs once the last one has arrived."""

    def compile_one(name, program):  # `name`: what an out-of-memory sentence names
        start = time.perf_counter()
        compiled = program.compile()
        return compiled, time.perf_counter() - start

    done = {}
    with concurrent.futures.ThreadPoolExecutor(MAX_PROGRAMS) as pool:
        futures = {}
        for name, program in lowered.items() if isinstance(lowered, dict) else lowered:
            futures[pool.submit(compile_one, name, program)] = name
        names = list(futures.values())
        on_lowered(names)
        start = time.perf_counter()
        progress(f"compiling {_listed(names)} side by side (the first run of a config is slow)...")
        for future in concurrent.futures.as_completed(futures):
            done[futures[future]] = future.result()
            progress(f"  compiled the {futures[future]} in {done[futures[future]][1]:.1f} s")
    done = {name: done[name] for name in names}
    progress(f"compiled in {time.perf_counter() - start:.0f} s")
    fits = {}
    for name, (compiled, seconds) in done.items():
        stats = memory.read(compiled)
        if stats is None:  # a backend without the analysis: nothing to hold against
            continue
        fits[name] = ProgramFit(name, stats.peak, stats.argument, held[name], seconds)
    return fits


def display_name(name: str) -> str:
    """A `Trainer.lower_programs` name as the progress lines say it ("train step")."""
    return "evaluation" if name == "evaluate" else name.replace("_", " ")


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
        with_kl = trainer.evaluator.kl_reference is not None  # then the eval takes the whole base
        return {
            "rollout": kept + device_bytes(base),
            "evaluation": kept + (not with_kl) * device_bytes(base),
            "train step": 0,  # it takes them all; the rollout's tree is small beside it
        }
    # full fine-tuning keeps a copy of the initial weights for the KL (taken by the eval)
    kl_reference = trainer.evaluator.kl_reference
    copy = kl_reference if kl_reference is not None else trainer.ref_params
    return {"rollout": optimizer + device_bytes(copy), "evaluation": optimizer, "train step": 0}


def stores_programs(trainer) -> bool:
    """Whether the run keeps its programs in the program store (its docstring says when)."""
    return (
        trainer.model.programs_from_code
        and program_store.may_store(trainer.config, trainer.mesh)
        and program_store.folder() is not None
    )


def precompile(trainer, state, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Compiles the run's rollout and evaluation ahead and refuses, in one sentence, a run
    whose programs cannot fit in the device's memory; returns their fits. A run that keeps
    its programs in the program store takes them from there (loaded meanwhile when
    `program_store.start_early` was called), or traces, exports and stores them."""
    start = time.perf_counter()
    cond, eval_args = trainer.program_inputs()
    directory = program_store.folder() if stores_programs(trainer) else None
    stored = False
    if directory is not None:
        arguments = (state, cond, eval_args, trainer.ref_params, trainer.evaluator.kl_reference)
        run_key = program_store.key(trainer.config, (arguments, trainer.train_uncond))
        name = program_store.file_key(trainer.config)
        early = program_store.early_programs(name)
        found = early.result() if early is not None else program_store.read(directory, name)
        stored = found is not None and found.key == run_key  # else another run's arguments
        trainer.programs.update(found.programs if stored else {})
    if not stored:
        progress("tracing the run's programs...")
    export = directory is not None and not stored
    names = []

    def lowered(programs: list[str]) -> None:
        names.extend(programs)
        seconds = time.perf_counter() - start
        if stored:
            progress(f"lowered {_listed(names)} in {seconds:.1f} s (traced by an earlier run)")
        else:
            progress(f"traced {_listed(names)} in {seconds:.1f} s")
        if export and set(trainer.programs) == set(program_store.DUE):
            program_store.write(directory, name, run_key, trainer.programs)

    staged = trainer.lower_programs(state, cond, eval_args, export=export)
    named = ((display_name(n), p) for n, p in staged)
    fits = compile_programs(named, _held(trainer, state), progress, lowered)
    if "train step" not in names:  # updates spanning minibatches: compiled at first use
        progress(
            "the train step (train.updates_per_iteration spreads an update over minibatches) "
            "compiles during the first iteration."
        )
    limit, where = memory_limit()
    per_device = sharding.num_batch_shards(trainer.mesh) // jax.process_count()
    check_fits(trainer.config, fits, per_device, limit, where)
    return fits
