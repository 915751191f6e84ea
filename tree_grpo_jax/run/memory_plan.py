"""A run's programs compiled from abstract shapes on its mesh, and XLA's per-device memory of
each: what `python -m tree_grpo_jax.plan` reports before any weight is downloaded.

The model comes as shapes (`models.registry.abstract_model`: a family reads only its JSON
configs); the trainable state, LoRA, the optimizer and the train step are built as
`build.build` builds them, under `jax.eval_shape`, so nothing is allocated. Each program is
lowered with explicit shardings and compiled; `Compiled.memory_analysis()` gives the sizes of
the buffers XLA assigned to one device: arguments, outputs, temporaries, and the outputs that
reuse a donated argument (aliased). Their sum less the aliased bytes is the program's peak.

Programs:
  rollout     the iteration's tree over one prompt batch (window position traced, int32)
  train_step  one PPO step on `train.rows_per_minibatch` transition rows, optimizer included
              (with `train.updates_per_iteration`: `accumulate`, one minibatch's gradient
              added to a sum, and `apply`, the optimizer step from the sum)
  evaluate    the deterministic sampler over `prompts.eval_count` prompts
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
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_grpo_jax import config as cfg
from tree_grpo_jax import methods, sharding
from tree_grpo_jax.core import rollout
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import build, memory
from tree_grpo_jax.run.train_step import (
    TrainState,
    initial_state,
    make_optimizer,
    make_train_step,
    old_params,
)

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
    mesh: dict[str, int]  # {"data": d, "fsdp": f}
    training: str  # one line: full fine-tuning or LoRA, dtypes, remat
    parameters: int  # the denoiser's
    trained_parameters: int
    sample_shape: tuple[int, ...]  # one sample, channels first
    cond_shape: tuple[int, int]  # one prompt's conditioning [L, D]
    programs: tuple[ProgramMemory, ...]
    resident: dict[str, int]  # per-device bytes of what lives across programs
    not_planned: tuple[str, ...]

    @property
    def largest(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.total)


@dataclasses.dataclass(frozen=True)
class _Run:
    """The run as shapes, laid out on its mesh."""

    config: Any
    model: Any  # models.abstract.AbstractModel
    mesh: Any
    method: methods.Method
    spec: Any
    tx: Any
    state: TrainState  # abstract
    state_shardings: Any
    weights: Any  # what the denoiser runs with in the rollout and evaluation
    weights_shardings: Any
    base: Any  # LoRA's frozen base, or None
    base_shardings: Any
    ref: Any  # the KL reference when it is a copy of its own, or None


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
# The run's state, as `build.build` makes it.


def build_run(config, model, mesh) -> _Run:
    """The trainable state and the denoiser's weights as shapes, laid out as `build.build`
    lays them out: full fine-tuning in `model.param_dtype`, or LoRA factors on a frozen base
    in `model.compute_dtype`."""
    tx = make_optimizer(config.train)
    if int(config.lora.rank) == 0:
        base = None
        params = jax.eval_shape(functools.partial(build.trained_params, config), model.params)
        weights = params
    else:  # only the factors are trained; the rollout runs on the merged weights
        base = jax.eval_shape(functools.partial(build.frozen_base, config), model.params)
        paths = build.lora_paths(config, base)
        params = jax.eval_shape(
            lambda b: build.trained_params(config, model.params, b, paths), base
        )
        weights = base  # `lora.merge` keeps every leaf's shape and dtype
    method = methods.get(config.tree.method)
    old_policy = method.objective.keeps_old_policy
    state = jax.eval_shape(lambda p: initial_state(tx, p, old_policy), params)
    kl = config.train.kl_beta > 0
    return _Run(
        config=config,
        model=model,
        mesh=mesh,
        method=method,
        spec=method.run_spec(config),
        tx=tx,
        state=state,
        state_shardings=sharding.param_shardings(mesh, state),
        weights=weights,
        weights_shardings=sharding.param_shardings(mesh, weights),
        base=base,
        base_shardings=None if base is None else sharding.param_shardings(mesh, base),
        ref=params if kl and base is None else None,  # LoRA's reference is its base
    )


# ---------------------------------------------------------------------------------------------
# The programs: (what, jitted function, abstract arguments).


def _guidance(run: _Run):
    c = run.config
    uncond = None
    if c.sampling.guidance_scale != 1.0:
        uncond = jax.ShapeDtypeStruct(run.model.cond_shape, jnp.float32)
    return uncond, float(c.sampling.guidance_scale)


def _cond(num_prompts: int, run: _Run) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((num_prompts, *run.model.cond_shape), jnp.float32)


def _schedule(run: _Run, num_steps: int):
    return abstract_like(run.model.make_schedule(num_steps, run.config.sampling))


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
        )
        for s in tree.segments
    )
    return tree.replace(segments=segments, leaves=_split(mesh))


def rollout_program(run: _Run):
    c, model, mesh, spec = run.config, run.model, run.mesh, run.spec
    num_prompts = c.prompts.batch_size
    uncond, scale = _guidance(run)

    def roll(weights, cond, key, schedule, window_start, uncond):
        return rollout.rollout(
            model.denoise,
            weights,
            cond,
            key,
            schedule,
            spec=spec,
            sample_shape=model.sample_shape,
            uncond=uncond,
            guidance_scale=scale,
            reduce=c.sampling.log_prob_reduce,
            window_start=window_start,
            split_log_prob=c.tree.split_log_prob,
            **run.method.objective.rollout_options(c),
        )

    args = (
        run.weights,
        _cond(num_prompts, run),
        jax.eval_shape(jax.random.PRNGKey, 0),
        _schedule(run, c.sampling.num_steps),
        jax.ShapeDtypeStruct((), jnp.int32),  # the window position is data
        uncond,
    )
    rep = sharding.replicated(mesh)
    out = _tree_shardings(jax.eval_shape(roll, *args), mesh)
    fn = jax.jit(
        roll,
        in_shardings=(run.weights_shardings, _split(mesh), rep, rep, rep, rep),
        out_shardings=out,
    )
    what = (
        f"{num_prompts} prompts x {spec.leaves} leaves, {spec.num_steps} steps"
        f"{', guidance' if uncond is not None else ''}{_layout(mesh)}"
    )
    return what, fn, args


def transition_rows(run: _Run, tree):
    """One minibatch of the method's rows as `transitions.minibatches` cuts it."""
    k = max((b.step.k for b in run.spec.segment_blocks), default=1)
    return run.method.objective.zero_rows(
        run.config,
        run.config.train.rows_per_minibatch,
        run.model.sample_shape,
        k,
        tree.leaves.dtype,
        make=jax.ShapeDtypeStruct,
    )


def _step_setup(run: _Run, tree):
    """What `build.build` gives the train step: the loss settings, the LoRA layout, and the
    step's abstract arguments after the state: (batch, cond, schedule, uncond, ref)."""
    c = run.config
    uncond, _ = _guidance(run)
    loss_kwargs, layout = build.step_layout(c, run.method.objective, run.model, run.base_shardings)
    kl = c.train.kl_beta > 0
    args = (
        transition_rows(run, tree),
        _cond(c.prompts.batch_size, run),
        _schedule(run, c.sampling.num_steps),
        uncond,
        run.ref if run.base is None else (run.base if kl else None),
    )
    rows = c.train.rows_per_minibatch
    what = (
        f"{rows} rows{', guidance' if uncond is not None else ''}, "
        f"{'remat' if c.model.remat else 'no remat'}{_layout(run.mesh)}"
    )
    return loss_kwargs, layout, args, what


def train_step_program(run: _Run, tree):
    loss_kwargs, layout, args, what = _step_setup(run, tree)
    fn = make_train_step(run.tx, loss_kwargs, run.mesh, run.state_shardings, **layout)
    frozen = () if run.base is None else (run.base,)
    return what, fn, (run.state, *args, jax.ShapeDtypeStruct((), jnp.float32), *frozen)


def accumulating_programs(run: _Run, tree):
    """With `train.updates_per_iteration`, the trainer's update spans minibatches: one
    gradient per minibatch added to a sum (`accumulate`), then one optimizer step (`apply`)."""
    from tree_grpo_jax.run.train_step import make_accumulating_step

    loss_kwargs, layout, args, what = _step_setup(run, tree)
    step = make_accumulating_step(run.tx, loss_kwargs, run.mesh, run.state_shardings, **layout)
    acc = jax.eval_shape(step.start, run.state)
    frozen = () if run.base is None else (run.base,)
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    return [
        ("accumulate", what, step.accumulate, (acc, run.state, *args, *frozen)),
        (
            "apply",
            "one optimizer update from the summed gradients",
            step.apply,
            (run.state, acc, lr),
        ),
    ]


def evaluate_program(run: _Run):
    c, model, mesh = run.config, run.model, run.mesh
    count_ = padded(c.prompts.eval_count, mesh)
    steps = c.eval.num_steps or c.sampling.num_steps
    uncond, scale = _guidance(run)

    def sample(weights, cond, noise, schedule, uncond):
        return rollout.sample_deterministic(
            model.denoise, weights, cond, noise, schedule, uncond=uncond, guidance_scale=scale
        )

    rep, split = sharding.replicated(mesh), _split(mesh)
    fn = jax.jit(
        sample,
        in_shardings=(run.weights_shardings, split, split, rep, rep),
        out_shardings=split,
    )
    args = (
        run.weights,
        _cond(count_, run),
        jax.ShapeDtypeStruct((count_, *model.sample_shape), jnp.float32),
        _schedule(run, steps),
        uncond,
    )
    return f"{count_} prompts, {steps} steps{_layout(mesh)}", fn, args


def decode_program(run: _Run, tree):
    mesh = run.mesh
    latents = jax.ShapeDtypeStruct(
        (math.prod(tree.leaves.shape[:2]), *tree.leaves.shape[2:]), tree.leaves.dtype
    )
    split = _split(mesh)
    fn = jax.jit(
        run.model.decode, in_shardings=(sharding.replicated(mesh), split), out_shardings=split
    )
    what = f"{latents.shape[0]} leaves{_layout(mesh)}"
    return what, fn, (run.model.decode_params, latents)


# ---------------------------------------------------------------------------------------------
# Compiling and measuring.


def compile_memory(name: str, what: str, fn, args, held: int, progress) -> ProgramMemory:
    """Lowers and compiles `fn` on `args` and reads XLA's memory analysis of one device."""
    progress(f"compiling {name}: {what} ...")
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - start
    stats = memory.read(compiled)
    if stats is None:
        raise cfg.ConfigError(
            f"the {jax.devices()[0].platform} backend gives no memory analysis of compiled "
            "programs, so it cannot plan one."
        )
    progress(f"compiled {name} in {seconds:.0f} s")
    library = LIBRARY_FUSION in compiled.as_text()
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
    )


def resident_bytes(run: _Run, tree, tree_shardings) -> dict[str, int]:
    """Per device: what the run keeps across programs."""
    rep = sharding.replicated(run.mesh)
    state_sh = run.state_shardings
    out = {
        "trained params": device_bytes(run.state.params, state_sh.params),
        "optimizer state": device_bytes(run.state.opt_state, state_sh.opt_state),
    }
    if old_params(run.state) is not None:  # DiffusionNFT's sampling policy
        out["old policy"] = device_bytes(old_params(run.state), old_params(state_sh))
    if run.base is not None:
        out["LoRA base"] = device_bytes(run.base, run.base_shardings)
    if run.ref is not None:
        out["KL reference"] = device_bytes(run.ref, rep)
    if run.model.decode is not None:
        out["decoder weights"] = device_bytes(run.model.decode_params, rep)
    out["rollout tree"] = device_bytes(tree, tree_shardings)
    return out


def _held(name: str, resident: dict[str, int], lora_run: bool) -> int:
    """What stays on the device while `name` runs but is not one of its arguments."""
    # (with an old policy, the rollout takes it and the trained params stay: the same bytes)
    state = ["optimizer state", "old policy"]
    state += ["trained params", "LoRA base"] if lora_run else []
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
    return sum(resident.get(k, 0) for k in held)


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
    weights = config.rewards.split(",")
    names = [w.partition(":")[0].strip() for w in weights] + list(config.eval.extra_rewards)
    models = [n for n in dict.fromkeys(names) if reward_registry.needs_weights(n)]
    if models:
        notes.append(f"the reward models ({', '.join(models)}): their weights are not read")
    if model.decode is None:
        notes.append("the decoder (the model family gives no abstract decoder)")
    return tuple(notes)


def _training(config, run: _Run) -> str:
    m = config.model
    what = "full fine-tuning" if run.base is None else f"LoRA rank {config.lora.rank}"
    remat = "remat" if m.remat else "no remat"
    return f"{what}, params {m.param_dtype}, compute {m.compute_dtype}, {remat}"


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
        mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, devices)
    except ValueError as e:
        raise cfg.ConfigError(str(e)) from None
    build.check_batches(config, mesh)
    model = model_registry.abstract_model(config.model, seed=config.seed)
    run = build_run(config, model, mesh)
    what, fn, args = rollout_program(run)
    tree = jax.eval_shape(fn, *args)
    resident = resident_bytes(run, tree, _tree_shardings(tree, mesh))
    programs = [("rollout", what, fn, args)]
    if config.train.get("updates_per_iteration", 0):
        programs += accumulating_programs(run, tree)
    else:
        programs.append(("train_step", *train_step_program(run, tree)))
    programs.append(("evaluate", *evaluate_program(run)))
    if model.decode is not None:
        programs.append(("decode", *decode_program(run, tree)))
    lora_run = run.base is not None
    measured = [
        compile_memory(name, what, fn, args, _held(name, resident, lora_run), progress)
        for name, what, fn, args in programs
        if name in chosen
    ]
    return MemoryPlan(
        model=model.source,
        platform=devices[0].platform,
        devices=len(devices),
        mesh={"data": mesh.shape["data"], "fsdp": mesh.shape["fsdp"]},
        training=_training(config, run),
        parameters=count(model.params),
        trained_parameters=count(run.state.params),
        sample_shape=tuple(model.sample_shape),
        cond_shape=tuple(model.cond_shape),
        programs=tuple(measured),
        resident=resident,
        not_planned=_not_planned(config, model, measured, [p[0] for p in programs]),
    )
