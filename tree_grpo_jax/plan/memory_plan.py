"""A run's programs compiled from abstract shapes on its mesh, and XLA's per-device memory of
each: what `python -m tree_grpo_jax.plan` reports before any weight is downloaded.

The model comes as shapes (`models.registry.abstract_model`: a family reads only its JSON
configs); the run is `build.abstract_trainer`: the trainer `build.build` builds, its state,
LoRA base and references as shapes carrying the real run's shardings, so nothing is
allocated. The programs are the trainer's own (`Trainer.lower_programs`: the rollout, the
evaluation, the train step), lowered for those shapes and compiled; `Compiled.
memory_analysis()` gives the sizes of the buffers XLA assigned to one device: arguments,
outputs, temporaries, and the outputs that reuse a donated argument (aliased). Their sum less
the aliased bytes is the program's peak.

Programs:
  rollout     the iteration's tree over one prompt batch (window position traced, int32)
  train_step  one PPO step on `train.rows_per_minibatch` transition rows, optimizer included
              (with `train.updates_per_iteration`: `accumulate`, one minibatch's gradient
              added to a sum, and `apply`, the optimizer step from the sum)
  evaluate    the deterministic sampler over the evaluation's samples (with the eval KL
              where the run measures it)
  decode      the VAE decode of one iteration's leaves

Batches split their leading axis over every device of the mesh, as the trainer lays them out:
the rollout's prompts, the minibatch's rows, the evaluation prompts (topped up to a multiple of
the devices) and the leaves to decode. Parameters and optimizer state follow
`sharding.param_shardings`. Beside each program's own buffers, the run holds others on the
device that the program does not take (the optimizer state while the tree is rolled out, the
rollout's tree while the train step runs, the decoder's weights): `held`, counted from their
shapes and shardings.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_grpo_jax import config as cfg
from tree_grpo_jax import sharding
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import remat_mode
from tree_grpo_jax.plan import sequence_traffic
from tree_grpo_jax.plan.program_cost import ProgramCost, program_cost
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import build, memory, scoring
from tree_grpo_jax.run.train_step import old_params

# How a fusion the CPU compiler hands to a library (XNNPACK, oneDNN) is marked in its HLO.
LIBRARY_FUSION = '"kind":"__'
PROGRAMS = ("rollout", "train_step", "evaluate", "decode")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's buffers on one device, in bytes."""

    name: str
    what: str  # what it computes, at what size
    argument: int
    output: int
    temp: int
    alias: int  # outputs written into donated arguments
    generated_code: int
    held: int  # what the run keeps on the device meanwhile that is not an argument
    compile_s: float
    library_fusions: bool = False  # the CPU compiler used library fusions: scratch unseen
    cost: ProgramCost | None = None  # one call's FLOPs and bytes, every loop counted

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @property
    def total(self) -> int:
        return self.peak + self.held


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str  # where the shapes came from
    platform: str  # the devices' platform ("cpu" for simulated devices)
    devices: int
    mesh: dict[str, int]  # {"data": d, "fsdp": f} (and "sequence": s where s > 1)
    training: str  # one line: full fine-tuning or LoRA, dtypes, remat
    parameters: int  # the denoiser's
    trained_parameters: int
    sample_shape: tuple[int, ...]  # one sample, as the model's `sample_shape`
    cond_shape: tuple[int, int]  # one prompt's conditioning [L, D]
    programs: tuple[ProgramMemory, ...]
    resident: dict[str, int]  # per-device bytes of what lives across programs
    not_planned: tuple[str, ...]
    notes: tuple[str, ...] = ()  # how the figures were compiled
    exchange: sequence_traffic.Exchange | None = None  # mesh.sequence's attention arrays

    @property
    def largest(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.total)


# ---------------------------------------------------------------------------------------------
# Shapes and bytes.


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def abstract_like(tree):
    """Every array leaf of `tree` as a ShapeDtypeStruct."""
    return jax.tree_util.tree_map(_struct, tree)


def device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` laid out as `shardings` (one sharding for every leaf,
    or a tree of them)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if isinstance(shardings, jax.sharding.Sharding):
        layouts = [shardings] * len(leaves)
    else:
        layouts = jax.tree_util.tree_leaves(shardings)
    return sum(
        math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        for x, s in zip(leaves, layouts, strict=True)
    )


def count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def _split(mesh, axis: int = 0) -> NamedSharding:
    """Axis `axis` split over every device of the mesh, as the trainer lays out batches."""
    return NamedSharding(mesh, P(*([None] * axis), sharding.BATCH_AXES))


def padded(size: int, mesh) -> int:
    """`size` rows topped up to a multiple of the devices (evaluation repeats prompts)."""
    shards = sharding.num_batch_shards(mesh)
    return -(-size // shards) * shards


# ---------------------------------------------------------------------------------------------
# The programs: the trainer's own, lowered for shapes.


def _layout(mesh) -> str:
    """How batches are laid out, as the end of a program's description."""
    n = sharding.num_batch_shards(mesh)
    return f", split over {n} devices" if n > 1 else ""


def _tree_shardings(tree, mesh):
    """The rollout's tree with its prompt axis split over the devices."""
    rep = sharding.replicated(mesh)
    on_prompts = _split(mesh, axis=1)
    segments = tuple(
        s.replace(
            parents=on_prompts,
            children=on_prompts,
            log_probs=on_prompts,
            steps=rep,
            active=rep,
            means=None if s.means is None else on_prompts,
            x0_hats=None if s.x0_hats is None else on_prompts,
        )
        for s in tree.segments
    )
    return tree.replace(segments=segments, leaves=_split(mesh))


def _shaped(shape, mesh, split: bool = True) -> jax.ShapeDtypeStruct:
    layout = _split(mesh) if split else sharding.replicated(mesh)
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout)


def eval_arguments(trainer):
    """The evaluation's arguments after the weights, as `Evaluator.sampler_args` makes them, as
    shapes: every eval sample (`eval.samples_per_prompt` rounds of the prompts) topped up to
    a multiple of the devices."""
    c, model, mesh = trainer.config, trainer.model, trainer.mesh
    count = padded(c.prompts.eval_count * c.eval.get("samples_per_prompt", 1), mesh)
    return (
        _shaped((count, *model.cond_shape), mesh),
        _shaped((count, *model.sample_shape), mesh),
        trainer.evaluator.schedule(),
        trainer.uncond,
        c.sampling.guidance_scale,
    )


def _exchange(trainer, model, eval_args) -> sequence_traffic.Exchange | None:
    """The denoiser's all-to-alls over mesh.sequence (None where it is 1), with the
    evaluation's denoiser rows: each sample at every step, twice with guidance, and again
    through the reference with the eval KL."""
    mesh = trainer.mesh
    ex = sequence_traffic.exchange(
        model, sharding.sequence_size(mesh), sharding.num_batch_shards(mesh)
    )
    if ex is None:
        return None
    c = trainer.config
    steps = c.eval.num_steps or c.sampling.num_steps
    with_kl = trainer.evaluator.kl_reference is not None
    rows = eval_args[0].shape[0] * steps * (2 if trainer.guidance else 1) * (1 + with_kl)
    return dataclasses.replace(ex, evaluate_rows=float(rows))


def _descriptions(trainer, eval_args) -> dict[str, str]:
    c, mesh, spec = trainer.config, trainer.mesh, trainer.spec()
    guidance = ", guidance" if trainer.guidance else ""
    rows = c.sampling.get("denoise_rows", 0)
    chunks = f", {rows} denoiser rows at a time" if rows else ""
    steps = c.eval.num_steps or c.sampling.num_steps
    kl = ", with the eval KL" if trainer.evaluator.kl_reference is not None else ""
    remat = "no remat" if remat_mode(c.model.remat) == "none" else "remat"
    step = f"{c.train.rows_per_minibatch} rows{guidance}, {remat}{_layout(mesh)}"
    return {
        "rollout": f"{c.prompts.batch_size} prompts x {spec.leaves} leaves, {spec.num_steps} "
        f"steps{guidance}{chunks}{_layout(mesh)}",
        "evaluate": f"{eval_args[0].shape[0]} samples, {steps} steps{kl}{chunks}{_layout(mesh)}",
        "train_step": step,
        "accumulate": step,
        "apply": "one optimizer update from the summed gradients",
    }


def decode_program(trainer, tree):
    """The run's decode of the leaves (`scoring.on_each_device`: each device its own rows,
    over the 'sequence' axis too where the rows divide every device)."""
    mesh, model = trainer.mesh, trainer.model
    leaves = tree.leaves
    rows = math.prod(leaves.shape[:2])
    axes = sharding.row_axes(mesh, rows) or sharding.BATCH_AXES
    split = NamedSharding(mesh, P(axes))
    latents = jax.ShapeDtypeStruct((rows, *leaves.shape[2:]), leaves.dtype, sharding=split)
    params = jax.tree_util.tree_map(
        lambda x: x.update(sharding=sharding.replicated(mesh)), model.decode_params
    )
    devices = math.prod(mesh.shape[a] for a in axes)
    what = f"{rows} leaves" + (f", split over {devices} devices" if devices > 1 else "")
    return scoring.device_decoder(model.decode, mesh, axes).lower(params, latents), what


# ---------------------------------------------------------------------------------------------
# Compiling and measuring.


def compile_memory(
    name: str, what: str, lowered, held: int, progress, options: dict | None = None
) -> ProgramMemory:
    """Compiles a lowered program (with compiler `options`) and reads XLA's memory analysis
    of one device."""
    progress(f"compiling {name}: {what} ...")
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    seconds = time.perf_counter() - start
    stats = memory.read(compiled)
    if stats is None:
        raise cfg.ConfigError(
            f"the {jax.devices()[0].platform} backend gives no memory analysis of compiled "
            "programs, so it cannot plan one."
        )
    progress(f"compiled {name} in {seconds:.0f} s")
    library = LIBRARY_FUSION in compiled.as_text()
    cost = program_cost(compiled)
    return ProgramMemory(
        name=name,
        what=what,
        argument=stats.argument,
        output=stats.output,
        temp=stats.temp,
        alias=stats.alias,
        generated_code=stats.generated_code,
        held=held,
        compile_s=seconds,
        library_fusions=library,
        cost=cost,
    )


def resident_bytes(trainer, state, tree, tree_shardings) -> dict[str, int]:
    """Per device: what the run keeps across programs (`state` and the trainer's arrays are
    shapes carrying their shardings)."""
    rep = sharding.replicated(trainer.mesh)
    out = {
        "trained params": _bytes(state.params),
        "optimizer state": _bytes(state.opt_state),
    }
    if old_params(state) is not None:  # DiffusionNFT's sampling policy
        out["old policy"] = _bytes(old_params(state))
    kl_reference = trainer.evaluator.kl_reference
    if trainer.adapter is not None:
        out["LoRA base"] = _bytes(trainer.adapter.base)
    elif trainer.ref_params is not None or kl_reference is not None:
        copy = trainer.ref_params if trainer.ref_params is not None else kl_reference
        out["KL reference"] = _bytes(copy)
    if trainer.model.decode is not None:
        out["decoder weights"] = device_bytes(trainer.model.decode_params, rep)
    out["rollout tree"] = device_bytes(tree, tree_shardings)
    return out


def _bytes(tree) -> int:
    """Per device bytes of shapes that carry their shardings."""
    leaves = jax.tree_util.tree_leaves(tree)
    return device_bytes(leaves, [x.sharding for x in leaves])


def _held(name: str, resident: dict[str, int], lora_beside: dict[str, int]) -> int:
    """What stays on the device while `name` runs but is not one of its arguments
    (`lora_beside`: the LoRA base and factors the sampling programs do not take)."""
    # (with an old policy, the rollout takes it and the trained params stay: the same bytes)
    state = ["optimizer state", "old policy"]
    between = [*state, "KL reference", "decoder weights"]  # rollout, evaluation
    held = {
        "rollout": between,
        "evaluate": between,
        "train_step": ["decoder weights", "rollout tree"],
        "accumulate": ["decoder weights", "rollout tree"],
        "apply": ["decoder weights", "rollout tree"],
        "decode": [
            "trained params",
            "optimizer state",
            "old policy",
            "LoRA base",
            "KL reference",
            "rollout tree",
        ],
    }[name]
    return sum(resident.get(k, 0) for k in held) + lora_beside.get(name, 0)


def _lora_beside(trainer, state) -> dict[str, int]:
    """Per device, the LoRA base kernels and factors the rollout and the evaluation do not
    take: those merged up front (outside scanned runs), whose merged copies they take."""
    if trainer.adapter is None:
        return {}
    base, factors = trainer.adapter.merged_up_front(state.params)
    with_kl = trainer.evaluator.kl_reference is not None  # then it takes the whole base
    return {
        "rollout": _bytes(base) + _bytes(factors),
        "evaluate": (not with_kl) * _bytes(base) + _bytes(factors),
    }


def _not_planned(config, model, measured, names) -> tuple[str, ...]:
    notes = ["the text encoders (prompts are encoded outside these programs)"]
    left_out = [n for n in names if n not in {p.name for p in measured}]
    if left_out:
        notes.append(f"{', '.join(left_out)} (not asked for)")
    hidden = [p.name for p in measured if p.library_fusions]
    if hidden:
        notes.append(
            f"the scratch memory of the CPU library fusions in {', '.join(hidden)} (run the "
            "plan as a command of its own: it switches them off before JAX starts)"
        )
    names = [*reward_registry.parse_rewards(config.rewards), *config.eval.extra_rewards]
    models = [n for n in dict.fromkeys(names) if reward_registry.needs_weights(n)]
    if models:
        notes.append(f"the reward models ({', '.join(models)}): their weights are not read")
    if model.decode is None:
        notes.append("the decoder (the model family gives no abstract decoder)")
    return tuple(notes)


def _training(config, trainer) -> str:
    m = config.model
    if trainer.adapter is None:
        what = "full fine-tuning"
    else:
        dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(trainer.adapter.base)}
        what = f"LoRA rank {config.lora.rank} (frozen base {'/'.join(sorted(dtypes))})"
    mode = remat_mode(m.remat)
    remat = "no remat" if mode == "none" else f"remat ({mode})"
    rows = config.sampling.denoise_rows
    chunks = f", sampling {rows} denoiser rows at a time" if rows else ""
    return f"{what}, params {m.param_dtype}, compute {m.compute_dtype}, {remat}{chunks}"


# The CPU computes bfloat16 dots in float32, and loop-invariant code motion would hoist a
# float32 copy of every bfloat16 weight out of the sampling loops: memory a GPU, computing them
# natively, never holds. The plan's CPU compiles run without that pass.
CPU_COMPILE = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
CPU_NOTE = (
    "CPU compiles with loop-invariant code motion off, so that the float32 copies of "
    "bfloat16 weights the CPU would hoist out of the sampling loops (a GPU makes none) are "
    "not counted; what a GPU would hoist besides (such as a bfloat16 copy of float32 master "
    "weights) is not counted either"
)


def compile_options(platform: str) -> dict | None:
    """The plan's compiler options on `platform` (None: the run's own)."""
    return dict(CPU_COMPILE) if platform == "cpu" else None


def _chosen(only: Sequence[str] | None) -> set[str]:
    """The programs to compile ("train_step" includes its accumulating form)."""
    chosen = set(PROGRAMS if only is None else only)
    unknown = sorted(chosen - set(PROGRAMS))
    if unknown or not chosen:
        raise cfg.ConfigError(
            f"unknown program {unknown[0]!r}; plan some of {', '.join(PROGRAMS)}."
            if unknown
            else f"plan at least one of {', '.join(PROGRAMS)}."
        )
    if "train_step" in chosen:
        chosen |= {"accumulate", "apply"}
    return chosen


def plan_memory(
    config,
    devices=None,
    progress: Callable[[str], None] = lambda s: None,
    only: Sequence[str] | None = None,
) -> MemoryPlan:
    """Compiles the run's programs (or those named in `only`) from shapes on `devices`
    (default: all) and returns their per-device memory. Raises ConfigError or ModelLoadError
    with one sentence for bad input."""
    chosen = _chosen(only)
    devices = list(jax.devices() if devices is None else devices)
    try:
        mesh = sharding.config_mesh(config, devices)
    except ValueError as e:
        raise cfg.ConfigError(str(e)) from None
    build.check_batches(config, mesh)
    model = model_registry.abstract_model(config.model, seed=config.seed)
    if model.attention_note:  # the plan compiles another attention than the run's kernel
        progress(model.attention_note)
    trainer, state = build.abstract_trainer(config, model, mesh)
    cond = _shaped((config.prompts.batch_size, *model.cond_shape), mesh)
    eval_args = eval_arguments(trainer)
    lowered = dict(trainer.lower_programs(state, cond, eval_args, accumulating=True))
    tree = lowered["rollout"].out_info
    resident = resident_bytes(trainer, state, tree, _tree_shardings(tree, mesh))
    what = _descriptions(trainer, eval_args)
    order = ("rollout", "train_step", "accumulate", "apply", "evaluate")
    programs = [(name, what[name], lowered[name]) for name in order if name in lowered]
    if model.decode is not None and "decode" in chosen:
        decode, decode_what = decode_program(trainer, tree)
        programs.append(("decode", decode_what, decode))
    elif model.decode is not None:
        programs.append(("decode", "", None))
    beside = _lora_beside(trainer, state)
    platform = devices[0].platform
    options = compile_options(platform)
    measured = [
        compile_memory(name, what, program, _held(name, resident, beside), progress, options)
        for name, what, program in programs
        if name in chosen
    ]
    return MemoryPlan(
        model=model.source,
        platform=platform,
        devices=len(devices),
        mesh=sharding.mesh_sizes(mesh),
        training=_training(config, trainer),
        parameters=count(model.params),
        trained_parameters=count(state.params),
        sample_shape=tuple(model.sample_shape),
        cond_shape=tuple(model.cond_shape),
        programs=tuple(measured),
        resident=resident,
        not_planned=_not_planned(config, model, measured, [p[0] for p in programs]),
        notes=(CPU_NOTE,) if options else (),
        exchange=_exchange(trainer, model, eval_args),
    )
