"""Building a run from its config: the mesh, the rewards, the model, LoRA, the optimizer,
the compiled train step and the initial state, gathered into a `trainer.Trainer`.

`setup(config, workdir, model=None)` checks the config and builds; the loop (`train`) and
the benchmarks start from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax import config as cfg
from tree_grpo_jax import lora, methods, sharding
from tree_grpo_jax.core import replay
from tree_grpo_jax.core.loss import LossSettings
from tree_grpo_jax.errors import PromptError, first_line, reason
from tree_grpo_jax.evaluation import diversity
from tree_grpo_jax.models import media as media_kinds
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.models.base import DTYPES, TextToImageModel, attention_heads, cast_floats
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.rewards.base import RewardShapeError, RewardUnavailable
from tree_grpo_jax.run import denoiser, precompile, reuse, scoring
from tree_grpo_jax.run.evaluation import Evaluator
from tree_grpo_jax.run.host_state import HostState
from tree_grpo_jax.run.input_images import check_prompt_images
from tree_grpo_jax.run.prompts import config_prompt_set, prompt_iterator
from tree_grpo_jax.run.tracking import make_tracker
from tree_grpo_jax.run.train_step import (
    StepLayout,
    TrainState,
    initial_state,
    make_accumulating_step,
    make_optimizer,
    make_train_step,
)
from tree_grpo_jax.run.trainer import Trainer


def check_batches(config, mesh) -> None:
    """The batches the trainer splits over every device must split evenly; one sentence."""
    shards = sharding.num_batch_shards(mesh)
    if config.train.rows_per_minibatch % shards:
        raise cfg.ConfigError(
            f"train.rows_per_minibatch ({config.train.rows_per_minibatch}) must be a multiple "
            f"of the {shards} devices the batch is split over."
        )
    # The rollout splits each process's prompts over that process's share of the devices.
    per_process = shards // jax.process_count()
    batch = config.prompts.batch_size
    if batch % per_process:
        raise cfg.ConfigError(
            f"prompts.batch_size ({batch}{', per process' if sharding.multi_process() else ''}) "
            f"must be a multiple of the {per_process} devices the rollout is split over "
            f"(mesh data x fsdp); {_would_work(batch, per_process)} would work."
        )
    # A chunk of the global batch's rows that the devices do not divide is not split: every
    # device would compute all of its rows.
    rows = config.sampling.denoise_rows
    if rows > 0 and rows % shards:
        raise cfg.ConfigError(
            f"sampling.denoise_rows ({rows}) must be 0 or a multiple of the {shards} devices "
            f"the batch is split over (mesh data x fsdp); {_would_work(rows, shards)} would work."
        )


def _would_work(value: int, of: int) -> str:
    """The multiples of `of` either side of `value` (the one above when none is below)."""
    lower, upper = value // of * of, (value // of + 1) * of
    return f"{lower} or {upper}" if lower else f"{upper}"


def check_sizes(config, spec, sample_shape, objective: methods.Objective, image_shape=None) -> None:
    """Refuses, before anything is compiled, a rollout or eval set whose stored samples
    alone cannot fit in memory (float32 states of every trained step, and the leaves, and
    what the objective's rows store beside them, and the leaves' decoded pictures; and the
    rows `train.replay` keeps on the host). When
    not even one prompt's fit, the batch is not at fault: the sentence names the tree and
    the settings that size a sample, the latter first when two samples (the least a group
    compares) would not fit on their own."""
    sample_bytes = 4 * int(np.prod(sample_shape))
    picture_bytes = 4 * int(np.prod(image_shape or sample_shape))
    prompts = config.prompts.batch_size
    states = spec.recorded_states + objective.row_samples(config, spec)
    per_prompt = (states + spec.leaves) * sample_bytes + spec.leaves * picture_bytes
    eval_rows = config.prompts.eval_count * config.eval.samples_per_prompt
    # the fixed noise (drawn, then copied to the host), the samples and their pictures
    per_eval = 3 * sample_bytes + picture_bytes
    limit, where = precompile.memory_limit()
    gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
    one = f"{gib(sample_bytes)} of latents {tuple(sample_shape)} and {gib(picture_bytes)} decoded"
    sized_by = model_registry.sample_settings(config.model)
    if per_prompt > limit:
        lower = [sized_by, "the tree's size"] if sized_by else ["the tree's size"]
        if 2 * (sample_bytes + picture_bytes) <= limit:
            lower.reverse()
        raise cfg.ConfigError(
            f"one rollout stores about {gib(per_prompt)} of samples and pictures even for one "
            f"prompt ({spec.leaves} leaves and {states} stored states or training rows, each "
            f"sample {one}), more than the {gib(limit)} of {where}; lower {' or '.join(lower)}."
        )
    if prompts * per_prompt > limit:
        raise cfg.ConfigError(
            f"one rollout stores about {gib(prompts * per_prompt)} of samples and pictures "
            f"({prompts} prompts x {spec.leaves} leaves, {states} stored states or training "
            f"rows per prompt), more than the {gib(limit)} of {where}; lower "
            f"prompts.batch_size (at most {limit // per_prompt} fit) or the tree's size."
        )
    # train.replay keeps N iterations' rows on the host (numpy, outside the device's memory)
    kept = config.train.replay
    held = kept and kept * prompts * objective.replay_samples(config, spec) * sample_bytes
    free = _host_available() if held else None
    if free is not None and held > free:
        raise cfg.ConfigError(
            f"train.replay={kept} keeps about {gib(held)} of past rows on the host ("
            f"{kept} iterations of {prompts} prompts' trained parents and their actions, "
            f"each {gib(sample_bytes)} of latents {tuple(sample_shape)}), more than the "
            f"{gib(free)} of free host memory; lower train.replay or prompts.batch_size."
        )
    # The eval set is held on the host as well: what is free there now bounds it too.
    free, free_where = _host_available(), "free host memory"
    if free is not None and free < limit:
        limit, where = free, free_where
    if per_eval > limit:
        raise cfg.ConfigError(
            f"one eval sample alone needs about {gib(per_eval)} for its noise, latents and "
            f"pictures (each sample {one}), more than the {gib(limit)} of {where}; lower "
            f"{sized_by or 'the size of its samples'}."
        )
    eval_bytes = eval_rows * per_eval
    if eval_bytes > limit:
        raise cfg.ConfigError(
            f"prompts.eval_count={config.prompts.eval_count} ({eval_rows:,} samples) needs "
            f"about {gib(eval_bytes)} for its noise, samples and pictures, more than the "
            f"{gib(limit)} of {where}; lower prompts.eval_count or eval.samples_per_prompt."
        )


def _host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_sequence(config, model) -> None:
    """mesh.sequence > 1 splits tokens inside a transformer's blocks: the model must have
    them (the family itself was checked with the config). Heads the axis divides are split
    over it in attention (Ulysses), others keep every head and pass the keys around a ring
    (`models.attention.attention`)."""
    sequence = config.mesh.get("sequence", 1)
    if sequence == 1:
        return
    if attention_heads(model) is None:
        raise cfg.ConfigError(
            f"mesh.sequence={sequence} splits tokens inside a transformer's blocks, and model "
            f"{model.name!r} has none; set mesh.sequence=1."
        )


def check_media(model: TextToImageModel, rewards) -> None:
    """The model's `decode` gives the media it says (on shapes: nothing is decoded) and
    every reward takes that media (an image reward takes videos frame by frame); else one
    sentence. A model whose `decode` gives latents (a benchmark's stand-in) scores nothing."""
    if model.media == media_kinds.LATENTS:
        return
    decoded = jax.eval_shape(
        model.decode, jax.ShapeDtypeStruct((1, *model.sample_shape), jnp.float32)
    )
    problem = media_kinds.shape_problem(model.media, decoded.shape)
    if problem:
        raise cfg.ConfigError(f"model {model.name!r} says it decodes {model.media}s but {problem}.")
    for reward in rewards:
        if not reward.takes(model.media):
            raise cfg.ConfigError(reward.refusal(model.media))


def check_prompts(
    model: TextToImageModel, rewards, prompts, where: str, chunk: int = 1, metadata=None
) -> None:
    """Every distinct prompt through the model's text encoder and through each reward that
    reads no model, on blank images (or videos), before anything is written: a prompt the
    model or a reward cannot read (the reward's `PromptError`), or a reward that does not
    give one score per sample or fails otherwise (named, not the prompts), is one sentence
    (rewards that read a model are built here and their shape is checked when they score).
    Each prompt goes with its `metadata` (in the same order; that of its first appearance),
    as the run will score it. The blanks go `chunk` at a time, as many as a rollout decodes
    (which `check_sizes` has seen fit): a prompt set's worth of videos may not.
    `check_media` has passed."""
    first = {}
    for prompt, meta in zip(prompts, metadata or [None] * len(prompts)):
        first.setdefault(prompt, meta)
    distinct = list(first)
    if not distinct:
        return
    try:
        model.encode_prompts(distinct)  # it reads only the prompts: its errors are theirs
    except ValueError as e:
        raise cfg.ConfigError(f"{where}: {first_line(e)}") from None
    scored = [r for r in rewards if not reward_registry.reads_model(r.name)]
    if model.media == media_kinds.LATENTS or not scored:
        return  # no pixels, or no reward to score them here
    decoded = jax.eval_shape(
        model.decode, jax.ShapeDtypeStruct((1, *model.sample_shape), jnp.float32)
    )
    chunk = max(1, min(chunk, len(distinct)))
    blank = np.zeros((chunk, *decoded.shape[1:]), np.float32)
    for start in range(0, len(distinct), chunk):
        part = distinct[start : start + chunk]
        for reward in scored:
            try:
                reward(blank[: len(part)], part, [first[p] for p in part])
            except (RewardShapeError, RewardUnavailable) as e:
                raise cfg.ConfigError(first_line(e)) from None
            except PromptError as e:  # the reward cannot read a prompt: the source's fault
                raise cfg.ConfigError(f"{where}: {first_line(e)}") from None
            except ValueError as e:  # anything else is the reward's, not the prompts'
                raise cfg.ConfigError(
                    f"reward {reward.name!r} failed when the start's check scored it on "
                    f"blank images ({reason(e)})."
                ) from None


def setup(
    config: ml_collections.ConfigDict, workdir: str, model: TextToImageModel | None = None
) -> tuple[Trainer, TrainState]:
    """Checks the config, builds the rewards, mesh, model (or takes `model`), optimizer and
    the initial state (fresh; `resume` may replace it)."""
    reward_weights = cfg.validate(config, known_rewards=reward_registry.available_rewards())
    return build(config, workdir, reward_weights, model)


# ---------------------------------------------------------------------------------------------
# What a run trains and how its step is laid out: one assembly for the real run (arrays) and
# the memory plan (`jax.eval_shape` of the same functions).


def lora_paths(config, base) -> list:
    """The kernels of `base` that LoRA adapts: `lora.targets`, or the family's defaults."""
    targets = tuple(config.lora.targets) or model_registry.family_of(config.model.name).lora_targets
    try:
        return lora.target_paths(base, targets)
    except ValueError as e:
        raise cfg.ConfigError(str(e)) from None


def frozen_base(config, model_params):
    """LoRA's frozen base: the model's weights in the compute dtype (bfloat16 for the
    releases' configs: only the trained factors keep `model.param_dtype` masters)."""
    return cast_floats(model_params, DTYPES[config.model.compute_dtype])


def trained_params(config, model_params, base=None, paths=None):
    """The parameters the run trains, at step 0, in `model.param_dtype`: the model's own
    (full fine-tuning), or LoRA factors on `base` at `paths` (only they are optimized and
    checkpointed)."""
    if base is None:
        return cast_floats(model_params, DTYPES[config.model.param_dtype])
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
    factors = lora.init_lora(key, base, paths, int(config.lora.rank))
    return cast_floats(factors, DTYPES[config.model.param_dtype])


def step_layout(
    config, objective, model, mesh, base_shardings=None
) -> tuple[LossSettings, StepLayout]:
    """(the loss's settings record, the train step's layout: its loss function and, under
    LoRA, the merge and where the frozen base and the KL reference lie)."""
    denoise = denoiser.training_denoise(model, config, mesh)
    loss_fn, loss_settings = objective.loss(config, denoise)
    if base_shardings is None:
        return loss_settings, StepLayout(loss_fn)
    rank = int(config.lora.rank)
    return loss_settings, StepLayout(
        loss_fn,
        # Factors merged block by block inside scanned runs, as the rollout samples: merged up
        # front, the step would hold every adapted kernel twice (the float32 delta and the sum).
        merge=functools.partial(lora.attach, alpha=float(config.lora.alpha or rank), rank=rank),
        frozen_shardings=base_shardings,
        ref_shardings=base_shardings if keeps_reference(config, objective) else None,
    )


def keeps_reference(config, objective) -> bool:
    """Whether the train step takes the initial weights: for a KL term, or for a loss that
    compares with them (DGPO's `dgpo.reference=initial`)."""
    return config.train.kl_beta > 0 or objective.needs_initial_model(config)


def references(config, params, base):
    """(the train step's reference, the evaluation's KL reference) of a run training
    `params` (LoRA: on `base`): the base itself under LoRA, else `params`' initial values
    (for a real run, pass a copy); None where the run keeps none."""
    keep = keeps_reference(config, methods.get(config.tree.method).objective)
    # the eval's exact KL to the initial policy: asked for, watched by the guard, or beside a
    # reference kept anyway
    eval_kl = config.eval.kl or cfg.guard_on(config) or keep
    initial = params if base is None else base
    return (initial if keep else None), (initial if eval_kl else None)


_kept_steps = reuse.Kept(4)  # a resume, or an evaluation after training, reuses its steps


def programs(config, model, mesh, objective, state_shardings, base_shardings=None) -> dict:
    """The run's jitted programs and the denoiser they sample with, built once: the train
    step, its accumulating form, `init_state` and `sampling_denoise` (Trainer fields). A
    run built again in this process with equal settings gets the same programs back, so
    nothing is traced or compiled twice."""
    tx = make_optimizer(config.train)
    loss_settings, layout = step_layout(config, objective, model, mesh, base_shardings)
    old_policy = objective.keeps_old_policy

    def build_steps():
        return {
            "train_step": make_train_step(tx, loss_settings, mesh, state_shardings, layout),
            "accumulating": make_accumulating_step(
                tx, loss_settings, mesh, state_shardings, layout
            ),
            "init_state": jax.jit(
                lambda p: initial_state(tx, p, old_policy), out_shardings=state_shardings
            ),
        }

    settings = (tx, loss_settings, layout, mesh, state_shardings, old_policy)
    steps = _kept_steps.get(settings, build_steps)
    return {**steps, "sampling_denoise": denoiser.sampling_denoise(model, config, mesh)}


def abstract_trainer(config, model, mesh) -> tuple[Trainer, TrainState]:
    """The run `build` builds, as shapes: a Trainer over `model` (a family's abstract model)
    whose state, frozen base and references are ShapeDtypeStructs carrying the shardings the
    real run gives them, and whose programs are the real run's (`Trainer.lower_programs`
    lowers them). Nothing is allocated; it reads no prompts and scores nothing."""
    method = methods.get(config.tree.method)
    tx = make_optimizer(config.train)
    adapter = None
    if int(config.lora.rank) == 0:
        params = jax.eval_shape(functools.partial(trained_params, config), model.params)
    else:
        base = jax.eval_shape(functools.partial(frozen_base, config), model.params)
        paths = lora_paths(config, base)
        params = jax.eval_shape(lambda b: trained_params(config, model.params, b, paths), base)
        rank = int(config.lora.rank)
        base = _placed(base, sharding.param_shardings(mesh, base))
        adapter = lora.Adapter(base, paths, rank, float(config.lora.alpha or rank), "")
    state = jax.eval_shape(
        lambda p: initial_state(tx, p, method.objective.keeps_old_policy), params
    )
    state_shardings = sharding.param_shardings(mesh, state)
    state = _placed(state, state_shardings)
    base_shardings = None if adapter is None else sharding.param_shardings(mesh, adapter.base)
    ref_params, kl_reference = references(
        config, state.params, None if adapter is None else adapter.base
    )
    uncond = loss_uncond = None
    embedding = jax.ShapeDtypeStruct(
        model.cond_shape, jnp.float32, sharding=sharding.replicated(mesh)
    )
    if config.sampling.guidance_scale != 1.0:
        uncond = embedding
    elif method.objective.loss_reads_empty_prompt(config):
        loss_uncond = embedding
    trainer = _trainer(
        {"rewards": {}, "prompts": [], "kl_reference": kl_reference},
        config=config,
        workdir="",
        model=model,
        mesh=mesh,
        method=method,
        reward=None,
        # no prompts drawn; the replay buffer sizes the step's conditioning
        host_state=HostState(None, None, replay.buffer(config.train.get("replay", 0))),
        uncond=uncond,
        loss_uncond=loss_uncond,
        ref_params=ref_params,
        key=jax.random.PRNGKey(config.seed),
        adapter=adapter,
        **programs(config, model, mesh, method.objective, state_shardings, base_shardings),
    )
    return trainer, state


def _trainer(evaluation: dict, **fields) -> Trainer:
    """The Trainer of `fields` holding its Evaluator (`evaluation`: the evaluator's own
    fields); the two share the model, the sampling denoiser, the decoder and the stored
    programs."""
    model, mesh, sampling = fields["model"], fields["mesh"], fields.get("sampling_denoise")
    decode = scoring.shared_decode(model.decode, sharding.local_mesh(mesh))
    stored = {}  # filled by `precompile` for both
    evaluator = Evaluator(
        config=fields["config"],
        workdir=fields["workdir"],
        model=model,
        mesh=mesh,
        reward=fields["reward"],
        uncond=fields["uncond"],
        denoise=model.denoise if sampling is None else sampling,
        decode=decode,
        adapter=fields.get("adapter"),
        programs=stored,
        **evaluation,
    )
    return Trainer(**fields, evaluator=evaluator, device_decode=decode, programs=stored)


def _placed(tree, shardings):
    """`tree`'s shapes carrying `shardings`."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _make_adapter(config, model: TextToImageModel, mesh) -> lora.Adapter | None:
    """LoRA on the model's weights when `lora.rank > 0`: the base in the compute dtype."""
    spec = config.lora
    if spec.rank == 0:
        return None
    base = frozen_base(config, model.params)
    paths = lora_paths(config, base)
    # The checksum is taken on the host before the base is laid out on the mesh, so a resume
    # on another mesh (allowed) finds the same value.
    fingerprint = lora.weights_fingerprint(base)
    return lora.Adapter(
        base=jax.device_put(base, sharding.param_shardings(mesh, base)),
        paths=paths,
        rank=int(spec.rank),
        alpha=float(spec.alpha or spec.rank),
        base_fingerprint=fingerprint,
    )


def _check_model_and_prompts(config, model, method, reward, eval_rewards, prompts, eval_set):
    """The checks that need the loaded model: its kind for the objective, the sizes of the
    run's rows, the media its rewards score, and every prompt it will be given (the text
    encoders prepared for them first). Returns the eval prompts, `prompts.eval_count` of
    `eval_set` in turn, listed only once their count has passed the size check."""
    objective = method.objective
    check_sequence(config, model)
    sentence = objective.check_model(config, model)
    if sentence is not None:
        raise cfg.ConfigError(sentence)
    image_shape = None
    if model.media != media_kinds.LATENTS:
        one = jax.ShapeDtypeStruct((1, *model.sample_shape), jnp.float32)
        image_shape = jax.eval_shape(model.decode, one).shape[1:]
    check_sizes(config, method.run_spec(config), model.sample_shape, objective, image_shape)
    eval_rows = eval_set.cycled(config.prompts.eval_count)
    eval_prompts, eval_metadata = list(eval_rows.prompts), list(eval_rows.metadata)
    if model.prepare_prompts is not None:
        said = model.prepare_prompts([*prompts.prompts, *eval_prompts, ""])
        if jax.process_index() == 0 and config.log.progress:
            print(f"text encoders: {said}", flush=True)
    check_media(model, [*reward.rewards.values(), *eval_rewards.values()])
    # input images: a model or a reward to read them, and every one of them readable
    trained_by, held_out = list(reward.rewards.values()), list(eval_rewards.values())
    check_prompt_images(model, trained_by, prompts.metadata, "prompts.source", held_out)
    check_prompt_images(model, [*trained_by, *held_out], eval_metadata, "the eval prompts")
    trained = prompts.prompts
    chunk = config.prompts.batch_size * method.run_spec(config).leaves  # a rollout's pictures
    check_prompts(
        model, reward.rewards.values(), trained, "prompts.source", chunk, prompts.metadata
    )
    # the eval's own prompts: through the training reward, and every prompt through the
    # held-out ones
    seen = set(trained)
    unseen = [i for i, p in enumerate(eval_prompts) if p not in seen]
    check_prompts(
        model,
        reward.rewards.values(),
        [eval_prompts[i] for i in unseen],
        "the eval prompts",
        chunk,
        [eval_metadata[i] for i in unseen],
    )
    check_prompts(
        model, eval_rewards.values(), eval_prompts, "the eval prompts", chunk, eval_metadata
    )
    return eval_prompts


def _initial_state(config, model, mesh, objective, adapter):
    """(the train state at step 0, the run's programs (`programs`), (the train step's KL
    reference, the evaluation's)) for `model`, trained whole or through `adapter`."""
    if adapter is None:
        params = trained_params(config, model.params)
    else:
        params = trained_params(config, model.params, adapter.base, adapter.paths)
    tx = make_optimizer(config.train)
    fresh = jax.eval_shape(lambda p: initial_state(tx, p, objective.keeps_old_policy), params)
    state_shardings = sharding.param_shardings(mesh, fresh)
    base_shardings = None if adapter is None else sharding.param_shardings(mesh, adapter.base)
    built = programs(config, model, mesh, objective, state_shardings, base_shardings)
    state = built["init_state"](params)

    if adapter is None:  # a copy of the initial weights: the state's are donated
        kept = references(config, state.params, None)
        initial = jax.tree_util.tree_map(jnp.copy, state.params) if any(kept) else None
        references_kept = tuple(None if r is None else initial for r in kept)
    else:  # the KL reference is the base itself: no second copy
        references_kept = references(config, state.params, adapter.base)
    return state, built, references_kept


def build(config, workdir, reward_weights, model=None) -> tuple[Trainer, TrainState]:
    """`setup` on a config already checked (`reward_weights`: what `config.validate` parsed)."""
    sharding.maybe_initialize_distributed()
    mesh = sharding.config_mesh(config)
    check_batches(config, mesh)
    method = methods.get(config.tree.method)
    # Rewards score the images where they were decoded: each process has its own copy.
    reward_mesh = sharding.local_mesh(mesh)
    loaded = reward_registry.load_rewards(
        (*reward_weights, *config.eval.extra_rewards),
        config.reward_models,
        config.reward_options,
        reward_mesh,
    )
    reward = reward_registry.combined_reward(reward_weights, loaded)
    eval_rewards = {n: loaded[n] for n in config.eval.extra_rewards}
    prompts = prompt_iterator(config)
    eval_set = config_prompt_set(config, eval_set=True)
    if model is None:
        model = model_registry.load_model(config.model, seed=config.seed)
    objective = method.objective
    eval_prompts = _check_model_and_prompts(
        config, model, method, reward, eval_rewards, prompts, eval_set
    )
    guidance = config.sampling.guidance_scale != 1.0
    empty = guidance or objective.loss_reads_empty_prompt(config)
    empty = np.asarray(model.encode_prompts([""])[0]) if empty else None
    shared = getattr(model, "unconditional_rows", None)  # the rest: each prompt's own
    empty = empty[:shared] if empty is not None and shared else empty
    uncond, loss_uncond = (empty, None) if guidance else (None, empty)

    adapter = _make_adapter(config, model, mesh)
    state, built, (ref_params, kl_reference) = _initial_state(
        config, model, mesh, objective, adapter
    )
    evaluation = {
        "rewards": eval_rewards,
        "prompts": eval_prompts,
        "metadata": eval_set.cycled(config.prompts.eval_count).metadata,
        **eval_embeddings(config, eval_prompts, reward_mesh, model.media),
        "kl_reference": kl_reference,
    }
    trainer = _trainer(
        evaluation,
        config=config,
        workdir=workdir,
        model=model,
        mesh=mesh,
        method=method,
        reward=reward,
        host_state=HostState(
            prompts, make_tracker(config, method), replay.buffer(config.train.get("replay", 0))
        ),
        uncond=uncond,
        loss_uncond=loss_uncond,
        ref_params=ref_params,
        key=jax.random.PRNGKey(config.seed),
        adapter=adapter,
        **built,
    )
    return trainer, state


def eval_embeddings(config, eval_prompts, mesh, media: str) -> dict:
    """The evaluator's `embed` (`diversity_embed`) and, for videos, its `frame_embed`: the same
    image embedding, built once, applied to each frame (the temporal distance)."""
    if media != media_kinds.VIDEO:
        return {"embed": diversity_embed(config, eval_prompts, mesh, media)}
    image_embed = diversity.make_embed(config, mesh)[0]
    return {
        "embed": diversity_embed(config, eval_prompts, mesh, media, image_embed),
        "frame_embed": diversity.per_frame(image_embed),
    }


def diversity_embed(config, eval_prompts, mesh, media: str = media_kinds.IMAGE, image_embed=None):
    """The eval's diversity embedding, when some eval prompt has several samples (repeated
    in the eval list, or `eval.samples_per_prompt` > 1); else None, or one sentence when
    the guard would watch a diversity there is none of. Videos are embedded frame by
    frame. `image_embed`: the image embedding already built (else it is built here)."""
    if config.eval.samples_per_prompt < 2 and not diversity.repeats(eval_prompts):
        if config.eval.guard.min_diversity_fraction > 0:
            raise cfg.ConfigError(
                "eval.guard.min_diversity_fraction needs several samples of an eval prompt: "
                f"set eval.samples_per_prompt >= 2 (the {len(eval_prompts)} eval prompts are "
                "all different)."
            )
        return None
    embed = image_embed or diversity.make_embed(config, mesh)[0]
    return diversity.over_frames(embed) if media == media_kinds.VIDEO else embed
