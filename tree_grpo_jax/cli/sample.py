"""Pictures from a trained run's checkpoint, drawn with the run's own evaluation sampler.

    python -m tree_grpo_jax.sample --workdir=<a training run> [--step=N]
        [--prompts=FILE_OR_SET | --prompt="a photo of a cat"] [--out=DIR] [--seed=S]
        [--num_steps=N] [--batch_size=B] [--model_path=BASE]

The run is read as its `config.json` says (its model, LoRA or full fine-tuning, sampling
settings) and its checkpoint: the newest readable one (when the newest cannot be read, the
line that names the checkpoint says which one was used instead and why) or `--step`'s,
opened read-only. Every prompt gets one fixed noise (row i of the eval noise drawn from
`--seed`, default the run's `eval.seed`) and the deterministic sampler the run's evaluations
use (`--num_steps`, default the run's eval steps), so the same command draws the same
pictures. Without `--prompts` it draws the run's own eval prompts: for a run that evaluated
one sample per prompt, without the eval KL, its grid is the run's own `eval_<step>.png`.
Tiny and diffusers models alike, LoRA or full fine-tuning.

It writes one PNG per prompt (`<index>_<prompt>.png`) and `grid.png` (ten prompts a row) to
`--out` (default `<workdir>/samples/step_<N>/`) and prints the paths; a video model's PNGs
are strips of the frames, each with an animated GIF of the same name beside it. Bad input
(no such run, no checkpoint, no readable one, a prompt the model cannot read, an `--out`
that cannot be written) is one `error:` sentence and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

from tree_grpo_jax import interrupts
from tree_grpo_jax.cli import common
from tree_grpo_jax.errors import echo, first_line

DESCRIPTION = """\
Draw pictures from a training run's checkpoint with the run's deterministic eval sampler:
one PNG per prompt and a grid."""
EPILOG = """\
examples:
  python -m tree_grpo_jax.sample --workdir=runs/tiny/20250101-120000
      the run's own eval prompts, from its newest readable checkpoint
  python -m tree_grpo_jax.sample --workdir=RUN --prompts=animals --step=40 --out=pictures
      a built-in prompt set (or a prompt file: .txt, .jsonl, .csv, ...) from checkpoint 40
  python -m tree_grpo_jax.sample --workdir=RUN --prompt="a photo of a cat" --seed=7

The same arguments draw the same pictures. Bad input is one "error:" line and exit status
2, with nothing written.
"""

BadInput = common.BadInput
GRID_COLUMNS = 10
# Sampler steps a drawing may take: far beyond any model's use (their schedules take 20-50),
# and below what a flow schedule's arrays (its sigmas, num_steps + 1 of them) could not hold.
MOST_STEPS = 10_000
# Sampling scores nothing: a reward that reads no weights stands in for the run's, so that
# reward models (and their weights) are not needed to draw pictures.
STAND_IN_REWARD = "jpeg_compressibility"


def _parser() -> argparse.ArgumentParser:
    parser = common.command_parser("sample", DESCRIPTION, EPILOG)
    parser.add_argument("--workdir", required=True, help="a training run's folder")
    parser.add_argument(
        "--step", type=int, help="the checkpoint to draw from (default: the newest readable)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--prompts",
        help="a built-in prompt set or a prompt file (.txt one prompt a line, .jsonl, .json, "
        ".csv, .tsv, .parquet) (default: the run's eval prompts)",
    )
    which.add_argument("--prompt", help="one prompt of your own")
    parser.add_argument("--out", help="output folder (default: <workdir>/samples/step_<N>/)")
    parser.add_argument(
        "--seed", type=int, help="seed of the fixed noises (default: the run's eval.seed)"
    )
    parser.add_argument(
        "--num_steps", type=int, help="sampler steps (default: the run's evaluation steps)"
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        help="prompts sampled at once (default: as many as the run's evaluation sampled)",
    )
    parser.add_argument(
        "--model_path", help="the base model folder (default: the run's model.path)"
    )
    return parser


@dataclasses.dataclass(frozen=True)
class Drawn:
    """What `sample` drew and wrote."""

    step: int  # the checkpoint
    out: str
    images: list[str]  # one PNG per prompt, in prompt order (a video's: its frames' strip)
    grid: str
    # videos: the animated GIFs beside the PNGs, the prompts' in order, then the grid's
    animations: list[str] = dataclasses.field(default_factory=list)


def _prompts(args, config) -> tuple[list[str], list]:
    """The prompts to draw and their metadata (which carries their input images)."""
    from tree_grpo_jax.run.prompts import (
        config_prompt_set,
        load_prompt_set,
        prompt_sets,
        prompt_settings,
    )

    if args.prompt is not None:
        if not args.prompt.strip():
            raise BadInput("--prompt is empty; give the words to draw, e.g. --prompt='a cat'.")
        return [args.prompt.strip()], [{}]
    if args.prompts is None:  # the run's eval prompts, as the run's evaluation lists them
        eval_set = config_prompt_set(config, eval_set=True).cycled(config.prompts.eval_count)
        return list(eval_set.prompts), list(eval_set.metadata)
    if args.prompts not in prompt_sets() and not os.path.isfile(os.path.expanduser(args.prompts)):
        raise BadInput(
            f"--prompts {echo(args.prompts)} is neither a built-in prompt set "
            f"({', '.join(sorted(prompt_sets()))}) nor a prompt file; give one prompt of your "
            'own with --prompt="...".'
        )
    chosen = load_prompt_set(args.prompts, *prompt_settings(config))
    return list(chosen.prompts), list(chosen.metadata)


def _check_numbers(args) -> None:
    from tree_grpo_jax import config as cfg

    if args.seed is not None and not 0 <= args.seed < cfg.SEED_LIMIT:
        raise BadInput(f"--seed must be a whole number in [0, 2**32), got {args.seed}.")
    if args.num_steps is not None and not 2 <= args.num_steps <= MOST_STEPS:
        raise BadInput(f"--num_steps must be in [2, {MOST_STEPS:,}], got {args.num_steps:,}.")
    if args.batch_size is not None and args.batch_size < 1:
        raise BadInput(f"--batch_size must be at least 1, got {args.batch_size}.")


def _sampling_config(config, args):
    """The run's config with what sampling changes: the seed, the steps, the base folder,
    and nothing loaded that only training or its evaluation reads (reward models, a
    reference copy of the weights, the diversity embedding)."""
    from tree_grpo_jax.evaluation import diversity

    c = config.copy_and_resolve_references()
    c.rewards = STAND_IN_REWARD
    c.eval.extra_rewards = ()
    c.eval.samples_per_prompt = 1
    c.eval.kl = False
    c.train.kl_beta = 0.0
    c.eval.guard.min_diversity_fraction = 0.0
    c.eval.guard.held_out_drop = 0.0
    c.prompts.eval_count = 1  # the trainer's own eval list: one prompt, no repeats
    # a video model's trainer embeds frames for the eval's temporal distance, which drawing
    # never reads: no CLIP folder is opened for it
    for name, _ in diversity.CLIP_FOLDERS:
        if c.reward_models.get(name):
            c.reward_models[name] = ""
    if args.prompts is not None:  # the run's training prompt file need not be at hand
        c.prompts.source, c.prompts.eval_source = args.prompts, ""
    c.log.progress = False
    if args.seed is not None:
        c.eval.seed = args.seed
    if args.num_steps is not None:
        c.eval.num_steps = args.num_steps
    if args.model_path:
        from tree_grpo_jax.models import registry as model_registry

        if not model_registry.family_of(c.model.name).needs_path:
            raise BadInput(
                f"--model_path changes nothing here: the run's model.name {c.model.name!r} is "
                "a built-in model with no base folder; leave --model_path out."
            )
        c.model.path = args.model_path
    return c


def _model(config, prompts: list[str]):
    """The run's model, told that `prompts` will be encoded (SD3 and FLUX encode the prompts
    they are told of ahead and release T5), after checking that it reads every one."""
    from tree_grpo_jax.models import registry as model_registry

    model = model_registry.load_model(config.model, seed=config.seed)
    try:
        model.encode_prompts(list(dict.fromkeys(prompts)))
    except ValueError as e:
        raise BadInput(f"the model cannot read a prompt: {first_line(e)}") from None
    if model.prepare_prompts is None:
        return model
    prepare = model.prepare_prompts
    return dataclasses.replace(model, prepare_prompts=lambda told: prepare([*told, *prompts]))


def _file_name(index: int, prompt: str, width: int) -> str:
    words = re.sub(r"[^a-z0-9]+", "_", prompt.lower()).strip("_")[:60].rstrip("_")
    return f"{index:0{width}d}_{words or 'prompt'}.png"


def _draw(evaluator, params, prompts: list[str], batch: int, metadata=None):
    """uint8 pictures [N, H, W, C] (videos [N, T, H, W, C]) of `prompts`, `batch` at a time
    (the last batch topped up with repeats, so one compiled sampler serves all), each from its
    row of the noise; `metadata` (one per prompt) carries the input images of a family that
    conditions on them."""
    import numpy as np

    from tree_grpo_jax.run import eval_metrics

    c = evaluator.config
    n = len(prompts)
    noise = eval_metrics.eval_noise(c.eval.seed, n, evaluator.model.sample_shape)
    size = min(batch, n)
    parts = []
    for start in range(0, n, size):
        t0 = time.time()
        ids = np.arange(start, min(n, start + size))
        rows = np.resize(ids, size)
        chosen = None if metadata is None else [metadata[i] for i in rows]
        drawn = evaluator.batch(params, [prompts[i] for i in rows], noise[rows], metadata=chosen)
        drawn = drawn.all_images()
        pixels = (np.clip(np.asarray(drawn[: len(ids)], np.float32), 0, 1) * 255).round()
        parts.append(pixels.astype(np.uint8))
        print(f"prompts {ids[0] + 1}-{ids[-1] + 1} of {n} in {time.time() - t0:.1f}s", flush=True)
    return np.concatenate(parts)


def _write(out: str, prompts: list[str], pictures) -> tuple[list[str], str, list[str]]:
    """One PNG per prompt and the grid (for videos, each PNG a strip of the frames, with an
    animated GIF beside it), each put in place whole: on a failure `out` is as it was."""
    with interrupts.critical():  # a signal waits for the pictures to be written
        written = _write_all(out, prompts, pictures)
        interrupts.set_stop_line(
            lambda name: f"{name} stopped the sampling; its pictures are written in {out}."
        )
        return written


def _write_all(out: str, prompts: list[str], pictures):
    import numpy as np

    from tree_grpo_jax.run import reporting
    from tree_grpo_jax.weights import staging

    existed = os.path.exists(out)
    width = max(3, len(str(len(prompts) - 1)))
    names, animations = [], []  # written in the hidden folder, then moved into `out`
    try:
        with staging.files_in_place(out) as stage:
            for i, (prompt, picture) in enumerate(zip(prompts, pictures)):
                png, *animation = reporting.save_sample(
                    os.path.join(stage, _file_name(i, prompt, width)), picture
                )
                names.append(os.path.basename(png))
                animations.extend(os.path.basename(a) for a in animation)
            columns = min(GRID_COLUMNS, len(prompts))
            grid = reporting.save_grid(
                os.path.join(stage, "grid.png"), pictures.astype(np.float32) / 255.0, columns
            )
            if reporting.is_video(pictures):
                animations.append(os.path.basename(reporting.animation_path(grid)))
    except BaseException:
        if not existed:
            common.remove_if_empty(out)
        raise

    def placed(names):
        return [os.path.join(out, name) for name in names]

    return placed(names), os.path.join(out, "grid.png"), placed(animations)


def sample(args) -> Drawn:
    """Draws `args`' prompts from the run's checkpoint and writes the pictures."""
    from tree_grpo_jax import sharding
    from tree_grpo_jax.run import loop as train
    from tree_grpo_jax.run import out_of_memory
    from tree_grpo_jax.run.build import setup
    from tree_grpo_jax.run.checkpoint import Checkpointer
    from tree_grpo_jax.run.input_images import NO_IMAGES, takes_input_images

    workdir = args.workdir
    config = common.run_config(workdir)
    _check_numbers(args)
    prompts, metadata = _prompts(args, config)
    if args.out is not None:
        common.check_out(args.out)
    else:
        common.check_out(os.path.join(workdir, "samples"))
    directory = train.checkpoint_dir(config, workdir)
    listing = Checkpointer(directory, read_only=True)  # before the model loads: is it futile?
    steps = listing.all_steps()
    listing.close()
    if not steps:
        raise BadInput(f"there is no checkpoint in {directory}.")
    if args.step is not None and args.step not in steps:
        raise BadInput(
            f"there is no checkpoint {args.step} in {directory}; it holds "
            f"{', '.join(map(str, steps))}."
        )
    batch = args.batch_size or config.prompts.eval_count * config.eval.samples_per_prompt

    config = _sampling_config(config, args)
    model = _model(config, prompts)
    if args.prompts is None and not takes_input_images(model):
        # the run's input images served its rewards; drawing without them reads none
        config.prompts.image_field = NO_IMAGES
        metadata = None
    trainer, state = setup(config, workdir, model=model)
    trainer.evaluator.schedule()  # steps the model cannot take: refused now
    restored, meta, step, skipped = common.restore_run_state(directory, args.step, target=state)
    train.check_base_weights(trainer, meta, directory)
    steps_used = config.eval.num_steps or config.sampling.num_steps
    count = f"{len(prompts)} prompt{'s' if len(prompts) > 1 else ''}"
    print(
        f"checkpoint {step} of {workdir}{', ' + skipped if skipped else ''}: {count}, "
        f"deterministic sampler ({steps_used} steps, guidance "
        f"{config.sampling.guidance_scale:g}), seed {config.eval.seed}",
        flush=True,
    )
    size = min(batch, len(prompts))
    with out_of_memory.said_as(
        lambda needed: (
            f"the device ran out of memory{needed} drawing {size} prompt(s) at once; "
            f"{out_of_memory.lower_flags({'--batch_size': size})}."
        )
    ):
        pictures = _draw(trainer.evaluator, restored.params, prompts, batch, metadata)
    out = args.out or os.path.join(workdir, "samples", f"step_{step}")
    if not sharding.is_primary():
        return Drawn(step, out, [], "")
    images, grid, animations = _write(out, prompts, pictures)
    for path in [*images, grid, *animations]:
        print(path)
    return Drawn(step, out, images, grid, animations)


def _typed(args) -> dict[str, str]:
    """The config fields this command's flags set (those given), each with its flag: the
    sentences of the config's checks and the model's loader name the field. The base folder
    is always --model_path: training's flag for it would be refused here."""
    given = {
        "eval.num_steps": ("--num_steps", args.num_steps),
        "eval.seed": ("--seed", args.seed),
        "prompts.source": ("--prompts", args.prompts),
    }
    flags = {field: flag for field, (flag, value) in given.items() if value is not None}
    flags["model.path" if args.model_path else "--config.model.path"] = "--model_path"
    return flags


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from tree_grpo_jax.run import loop as train

    try:
        sample(args)
    except (BadInput, *train.BAD_INPUT) as e:
        line = common.typed_flags(first_line(e), _typed(args))
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    except (train.RewardError, train.DivergenceError, train.OutOfMemory) as e:
        print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # writing the pictures failed (disk full, permissions)
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not write{where}: {e.strerror or e}.", file=sys.stderr, flush=True)
        return 2
    return 0


def run() -> None:
    common.starting("sample")
    interrupts.set_stop_line(lambda name: f"{name} stopped the sampling; nothing was written.")
    interrupts.finish(main())


if __name__ == "__main__":
    run()
